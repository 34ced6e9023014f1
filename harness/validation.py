"""JSON Schema validation of every format the harness reads or writes: one validator factory.

Schemas live in ``harness/schemas/`` (``harness.paths.SCHEMA_DIR``) or, for the ledger row, in
code; each is checked against its own meta-schema (``$schema``, draft 2020-12) once, when its
validator is first made, so a broken schema fails loudly rather than accepting everything.
"""

from __future__ import annotations

import json
from functools import lru_cache
from typing import Any, Iterable, Mapping

import jsonschema

from harness.paths import SCHEMA_DIR

Validator = jsonschema.protocols.Validator


def make_validator(schema: Mapping[str, Any]) -> Validator:
    """A validator of the draft ``schema`` names in ``$schema``, after checking the schema
    itself. Raises ``jsonschema.SchemaError`` for an invalid schema (a harness bug)."""
    cls = jsonschema.validators.validator_for(schema)
    cls.check_schema(schema)
    return cls(schema)


@lru_cache(maxsize=None)
def schema_validator(filename: str) -> Validator:
    """The validator of ``harness/schemas/<filename>`` (made once per process)."""
    return make_validator(json.loads((SCHEMA_DIR / filename).read_text()))


def best_error(errors: Iterable[jsonschema.ValidationError]) -> tuple[str, str] | None:
    """``(dotted field path, message)`` of the most relevant error (``jsonschema``'s
    ``best_match``); the path is ``""`` for the top level; None when there is no error."""
    e = jsonschema.exceptions.best_match(errors)
    if e is None:
        return None
    return ".".join(str(k) for k in e.absolute_path), e.message
