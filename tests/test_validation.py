"""harness.validation: jsonschema-rs decides validity, jsonschema explains a rejection.

The pair lets a broken document through only where jsonschema-rs accepts what jsonschema would
reject, so these tests compare the two libraries on every schema the harness ships: on real
documents (the shipped thresholds.yaml and contracts, the committed parity receipts and ledger
rows, a release manifest) and on many broken copies of each (a key removed, a value of another
type, an unknown key, a number out of range).
"""

from __future__ import annotations

import copy
import datetime
import json
from pathlib import Path
from typing import Any, Iterator

import jsonschema
import jsonschema_rs
import pytest
import yaml

from harness.evidence.ledger import ROW_SCHEMA
from harness.paths import SCHEMA_DIR, SOURCE_ROOT
from harness.validation import make_validator, schema_validator

REPLACEMENTS: tuple[Any, ...] = (None, "x", "", 0, -1, 1.5, -1e300, True, [], {}, ["x"], {"x": 1})


def _text_dates(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {k: _text_dates(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_text_dates(v) for v in obj]
    return obj.isoformat() if isinstance(obj, datetime.date) else obj


def _yaml(path: Path) -> Any:
    return _text_dates(yaml.safe_load(path.read_text()))


def _trimmed_thresholds() -> dict:
    """thresholds.yaml with each row list cut to its first two rows (still valid; jsonschema takes
    85 ms on the whole file, and every row has the same schema)."""
    data = _yaml(SOURCE_ROOT / "thresholds.yaml")
    for k, v in data.items():
        if isinstance(v, list):
            data[k] = v[:2]
    return data


def _manifest() -> dict:
    return {"schema": "harness-release/v1", "release": "demo-1", "prompts": "prompts.jsonl",
            "thresholds": {"path": "thresholds.yaml", "sha256": "0" * 64}, "probes": ["split", "decode", "determinism"],
            "candidates": [{"engine": "oracle", "compute_class": "f64"}, {"engine": "command:example", "compute_class": "f32"}],
            "models": [{"model": "fixture:tiny-qwen35", "sha256": "1" * 64}]}


def documents() -> Iterator[tuple[str, dict, Any]]:
    """(label, schema, a document that schema accepts) for every schema the harness ships."""
    files = {p.name: json.loads(p.read_text()) for p in SCHEMA_DIR.glob("*.schema.json")}
    yield "thresholds.yaml", files["thresholds.schema.json"], _trimmed_thresholds()
    for c in sorted((SOURCE_ROOT / "contracts").glob("*.yaml"))[:2]:
        yield c.name, files["contract.schema.json"], _yaml(c)
    receipts = sorted((SOURCE_ROOT / "evidence" / "parity" / "receipts").glob("*.json"))
    yield "parity receipt", files["receipt.schema.json"], json.loads(receipts[0].read_text())
    rows = [json.loads(line) for line in (SOURCE_ROOT / "evidence" / "parity" / "ledger.jsonl").read_text().splitlines() if line]
    yield "ledger row", ROW_SCHEMA, rows[0]
    yield "release manifest", files["release-manifest.schema.json"], _manifest()


def _paths(doc: Any, prefix: tuple = ()) -> Iterator[tuple]:
    yield prefix
    if isinstance(doc, dict):
        for k, v in doc.items():
            yield from _paths(v, prefix + (k,))
    elif isinstance(doc, list):
        for i, v in enumerate(doc[:2]):
            yield from _paths(v, prefix + (i,))


def _at(doc: Any, path: tuple) -> Any:
    for k in path:
        doc = doc[k]
    return doc


def broken_copies(doc: Any, limit: int = 400) -> Iterator[tuple[str, Any]]:
    """Copies of ``doc`` with one change each: a key removed, a value replaced, a key added."""
    made = 0
    for path in _paths(doc):
        if not path:
            continue
        parent, key = _at(doc, path[:-1]), path[-1]
        if isinstance(parent, dict):
            d = copy.deepcopy(doc)
            del _at(d, path[:-1])[key]
            yield f"without {path}", d
            made += 1
        for new in REPLACEMENTS:
            d = copy.deepcopy(doc)
            _at(d, path[:-1])[key] = new
            yield f"{path} = {new!r}", d
            made += 1
        value = _at(doc, path)
        if isinstance(value, dict):
            d = copy.deepcopy(doc)
            _at(d, path)["zz_not_a_field"] = 1
            yield f"{path} + unknown key", d
        if made > limit:
            return


@pytest.mark.parametrize("label, schema, doc", list(documents()), ids=lambda x: x if isinstance(x, str) else "")
def test_jsonschema_rs_and_jsonschema_agree_on_valid_and_broken_documents(label, schema, doc):
    rs = jsonschema_rs.validator_for(schema)
    py = jsonschema.validators.validator_for(schema)(schema)
    assert rs.is_valid(doc) and py.is_valid(doc), f"{label} should be valid"
    disagree, rejected = [], 0
    for what, d in broken_copies(doc):
        r, p = rs.is_valid(d), py.is_valid(d)
        rejected += not p
        if r != p:
            disagree.append(f"{what}: jsonschema-rs {'accepts' if r else 'rejects'}, jsonschema {'accepts' if p else 'rejects'}")
    assert not disagree, f"{label}: {len(disagree)} disagreements, e.g. " + "; ".join(disagree[:3])
    assert rejected >= 20, f"{label}: the broken copies should mostly be invalid ({rejected} were)"


def test_every_shipped_schema_is_valid_against_its_meta_schema():
    # jsonschema-rs checks a schema when its validator is made; jsonschema's check is here, once,
    # not at every process start.
    for p in SCHEMA_DIR.glob("*.schema.json"):
        schema = json.loads(p.read_text())
        jsonschema.validators.validator_for(schema).check_schema(schema)
        schema_validator(p.name)
    jsonschema.validators.validator_for(ROW_SCHEMA).check_schema(ROW_SCHEMA)


def test_a_broken_schema_is_refused_when_its_validator_is_made():
    with pytest.raises(jsonschema_rs.ValidationError):
        make_validator({"$schema": "https://json-schema.org/draft/2020-12/schema", "type": "no-such-type"})


def test_a_rejected_document_is_explained_by_jsonschema_and_non_json_data_is_judged_too():
    v = make_validator({"$schema": "https://json-schema.org/draft/2020-12/schema", "type": "object",
                        "required": ["a"], "properties": {"a": {"type": "integer", "minimum": 0}}})
    assert list(v.iter_errors({"a": 3})) == [] and v.is_valid({"a": 3})
    (e,) = list(v.iter_errors({"a": -2}))
    assert isinstance(e, jsonschema.ValidationError) and e.validator == "minimum" and list(e.absolute_path) == ["a"]
    # jsonschema-rs refuses a non-str key outright; jsonschema still gives the verdict
    assert not v.is_valid({1: 2}) and [x.validator for x in v.iter_errors({1: 2})] == ["required"]
