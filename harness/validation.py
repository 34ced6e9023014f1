"""JSON Schema validation of every format the harness reads or writes: one validator factory.

Schemas live in ``harness/schemas/`` (``harness.paths.SCHEMA_DIR``) or, for the ledger row, in
code (draft 2020-12, named in ``$schema``). Two well-kept libraries share the work:

- **jsonschema-rs** (Rust) decides whether a document is valid: about 0.5 ms for the 290 kB
  thresholds.yaml, where jsonschema takes 85 ms, and it checks each schema against its
  meta-schema when the validator is made (a broken schema raises, rather than accepting
  everything).
- **jsonschema** (Python) explains a document jsonschema-rs rejects: every error with its path,
  validator and message, which the loaders turn into one line naming the field. It is imported
  only then, and its word is final: a document it finds no error in is valid.

So the pair can only let a broken document through where jsonschema-rs accepts what jsonschema
rejects; ``tests/test_validation.py`` looks for that on valid and broken documents of every
schema.
"""

from __future__ import annotations

import json
from functools import cached_property, lru_cache
from typing import TYPE_CHECKING, Any, Iterable, Iterator, Mapping

import jsonschema_rs

from harness.paths import SCHEMA_DIR

if TYPE_CHECKING:
    import jsonschema


class Validator:
    """A compiled schema: ``iter_errors(doc)`` yields nothing for a valid document, else
    jsonschema's ``ValidationError`` objects (the interface of a ``jsonschema`` validator that
    the loaders use). Made by ``make_validator``."""

    def __init__(self, schema: Mapping[str, Any]):
        self.schema = schema
        self._fast = jsonschema_rs.validator_for(dict(schema))  # raises for an invalid schema

    @cached_property
    def _explainer(self) -> "jsonschema.protocols.Validator":
        import jsonschema

        cls = jsonschema.validators.validator_for(self.schema)
        cls.check_schema(self.schema)
        return cls(self.schema)

    def _accepted(self, doc: Any) -> bool:
        """jsonschema-rs's verdict; False, so that jsonschema judges, for what it cannot take as
        JSON data (e.g. a non-str key)."""
        try:
            return bool(self._fast.is_valid(doc))
        except (ValueError, TypeError, OverflowError):
            return False

    def is_valid(self, doc: Any) -> bool:
        """Whether ``doc`` (JSON data: dicts with str keys, lists, str, numbers, bool, None) is valid."""
        return self._accepted(doc) or self._explainer.is_valid(doc)

    def iter_errors(self, doc: Any) -> Iterator["jsonschema.ValidationError"]:
        """jsonschema's errors for ``doc``; none (without importing jsonschema) when
        jsonschema-rs finds it valid."""
        return iter(()) if self._accepted(doc) else self._explainer.iter_errors(doc)


def make_validator(schema: Mapping[str, Any]) -> Validator:
    """A ``Validator`` of ``schema`` (its ``$schema`` names the draft), after checking the schema
    itself. Raises ``jsonschema_rs.ValidationError`` for an invalid schema (a harness bug)."""
    return Validator(schema)


@lru_cache(maxsize=None)
def schema_validator(filename: str) -> Validator:
    """The validator of ``harness/schemas/<filename>`` (made once per process)."""
    return make_validator(json.loads((SCHEMA_DIR / filename).read_text()))


def best_error(errors: Iterable["jsonschema.ValidationError"]) -> tuple[str, str] | None:
    """``(dotted field path, message)`` of the most relevant error (``jsonschema``'s
    ``best_match``); the path is ``""`` for the top level; None when there is no error."""
    errors = list(errors)
    if not errors:
        return None
    import jsonschema

    e = jsonschema.exceptions.best_match(errors)
    return ".".join(str(k) for k in e.absolute_path), e.message


def unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """``json.loads(..., object_pairs_hook=unique_keys)``: a JSON object's pairs as a dict, and
    ``ValueError`` naming a key given twice (Python's default keeps the last silently, so two
    readers of one file could disagree on its value)."""
    d: dict[str, Any] = {}
    for k, v in pairs:
        if k in d:
            raise ValueError(f"key {k!r} appears twice")
        d[k] = v
    return d
