"""The ledger's row: its fields and schema, its hash, the row a receipt determines, and reading rows.

A row is one canonical-JSON line of ``ledger.jsonl`` (fields ``ROW_FIELDS`` and the optional
``OPTIONAL_FIELDS``; schema ``ROW_SCHEMA``); ``row_hash`` is the sha256 of its canonical JSON
without ``row_hash``. ``row_from_receipt`` is the one place a receipt becomes row fields (the
verification re-derives them with it). ``read_rows`` parses a whole ledger without checking
hashes (``harness.evidence.verify`` does). Part of the ledger package of modules: rows, chain,
pages, verify, views (``harness.evidence.ledger`` re-exports them all).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from harness.errors import InvalidInput
from harness.evidence.ledger_cache import MAX_SEQ, seq_problem
from harness.evidence.receipts import canonical_json, report_only_headline
from harness.provenance import sha256_bytes
from harness.validation import best_error, make_validator

GENESIS = "0" * 64
"""``prev_hash`` of the first row."""

KINDS = ("parity", "self-consistency", "probe", "mtp", "calibration", "tokenizer", "chat-parsers", "discharge", "supersede", "signoff")

RECEIPT_FIELDS = (
    "kind",
    "model",
    "model_sha256",
    "quant",
    "candidate",
    "reference",
    "positions",
    "min_cosine",
    "verdict",
    "argmax_agreement",
    "near_tie_flips",
    "hard_flips",
    "kld_mean",
    "basis_kind",
    "receipt_id",
    "free_running",
)
"""Fields a row copies from its receipt (``row_from_receipt``); ``verify_ledger`` re-derives them."""

TIMING_FIELDS = ("candidate_wall_s", "candidate_load_s", "candidate_tokens_per_s", "reference_wall_s", "reference_tokens_per_s")
"""The run's speed (``timing_fields``), in rows of runs that recorded it: this run's own
measurement, so not re-derived from the receipt by ``verify_ledger`` (identical runs share one
receipt, whose timings are the first run's)."""

TIER_FIELDS = ("compute_class", "release", "calibrated")
"""The candidate's compute class and each tier's status (ok, fail, unmeasured), in rows of
receipts that judge two tiers (``harness-thresholds/v2``)."""

FREE_RUNNING_FIELD = "free_running"
"""The free-running greedy headline (``harness.runs.greedy.headline``), in rows of parity
receipts that recorded ``report_only.free_running``; report-only."""

SIGNOFF_FIELDS = ("release_name", "builds", "cells", "relied_on", "blocked")
"""A sign-off row's own fields: the manifest's release name, ``{candidate: build id}``, one entry
per cell (``{model, candidate, backend, status, parity, probe}``: the cell's status and the receipt
ids it used), ``[{id, sha256}]`` of every receipt relied on, and one line per missing, stale or
failed item with the command that would produce it (``verdict`` is SIGNED or BLOCKED)."""

DISCHARGE_FIELDS = ("contract", "obligations")
"""A discharge row's own fields: the contract's id and ``{result: count}`` over its selected
obligations (``candidate`` is the GREEN subject, ``verdict`` DISCHARGED, FAIL or UNMEASURED)."""

OPTIONAL_FIELDS = ("model_sha256", "supersedes", "reason", FREE_RUNNING_FIELD, *TIMING_FIELDS, *TIER_FIELDS, *SIGNOFF_FIELDS,
                   *DISCHARGE_FIELDS)
"""Fields a row may lack (rows written before ``model_sha256`` was recorded, non-supersede rows,
rows of runs that recorded no timings)."""

ROW_FIELDS = ("seq", "time", *(f for f in RECEIPT_FIELDS if f not in OPTIONAL_FIELDS), "receipt_sha256", "prev_hash", "row_hash")
"""Every row has these (null where not applicable); see ``ROW_SCHEMA``."""

CACHE_COLUMNS = (*ROW_FIELDS, *(f for f in OPTIONAL_FIELDS if f not in ROW_FIELDS))
"""The row fields the query cache (``harness.evidence.ledger_cache``) keeps as columns."""

REPORT_ONLY_MIN_RECORDS = 20
"""Records a report-only field needs before the ledger proposes a threshold for it (docs/design.md, "Thresholds")."""

_HEX64 = {"type": "string", "pattern": "^[0-9a-f]{64}$"}
_NULLABLE_HEX64 = {"type": ["string", "null"], "pattern": "^[0-9a-f]{64}$"}
ROW_SCHEMA: dict[str, Any] = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "type": "object",
    "required": list(ROW_FIELDS),
    "additionalProperties": False,
    "properties": {
        "seq": {"type": "integer", "minimum": 1},
        "time": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}T"},
        "kind": {"enum": list(KINDS)},
        "model": {"type": ["string", "null"]},
        "model_sha256": _NULLABLE_HEX64,
        "quant": {"type": ["string", "null"]},
        "candidate": {"type": ["string", "null"]},
        "reference": {"type": ["string", "null"]},
        "positions": {"type": ["integer", "null"], "minimum": 0},
        "min_cosine": {"type": ["number", "null"]},
        "verdict": {"type": ["string", "null"]},
        "argmax_agreement": {"type": ["number", "null"], "minimum": 0, "maximum": 1},
        "near_tie_flips": {"type": ["integer", "null"], "minimum": 0},
        "hard_flips": {"type": ["integer", "null"], "minimum": 0},
        "kld_mean": {"type": ["number", "null"]},
        "basis_kind": {"enum": ["measured", "declared", None]},
        "receipt_id": _NULLABLE_HEX64,
        "receipt_sha256": _NULLABLE_HEX64,
        "prev_hash": _HEX64,
        "row_hash": _HEX64,
        "supersedes": {"type": "integer", "minimum": 1},
        **{f: {"type": ["number", "null"], "minimum": 0} for f in TIMING_FIELDS},
        "compute_class": {"enum": ["f64", "f32", "bf16", "f16", "mixed", None]},
        "release": {"enum": ["ok", "fail", "unmeasured", None]},
        "calibrated": {"enum": ["ok", "fail", "unmeasured", None]},
        "reason": {"type": "string", "minLength": 1},
        "free_running": {"type": "string", "minLength": 1},
        "release_name": {"type": "string", "minLength": 1},
        "builds": {"type": "object", "additionalProperties": _HEX64},
        "cells": {"type": "array", "items": {"type": "object", "required": ["model", "candidate", "backend", "status"]}},
        "relied_on": {"type": "array", "items": {"type": "object", "required": ["id", "sha256"], "additionalProperties": False,
                                                 "properties": {"id": _HEX64, "sha256": _HEX64}}},
        "blocked": {"type": "array", "items": {"type": "string"}},
        "contract": {"type": "string", "minLength": 1},
        "obligations": {"type": "object", "additionalProperties": {"type": "integer", "minimum": 0}},
    },
    "allOf": [
        {
            "if": {"properties": {"kind": {"const": "supersede"}}},
            "then": {"required": ["supersedes", "reason"]},
            "else": {"not": {"required": ["supersedes"]}},
        },
        {
            "if": {"properties": {"kind": {"const": "signoff"}}},
            "then": {"required": list(SIGNOFF_FIELDS), "properties": {"verdict": {"enum": ["SIGNED", "BLOCKED"]}}},
            "else": {"not": {"anyOf": [{"required": [f]} for f in SIGNOFF_FIELDS]}},
        },
        {
            "if": {"properties": {"kind": {"const": "discharge"}}},
            "then": {"required": list(DISCHARGE_FIELDS), "properties": {"verdict": {"enum": ["DISCHARGED", "FAIL", "UNMEASURED"]}}},
            "else": {"not": {"anyOf": [{"required": [f]} for f in DISCHARGE_FIELDS]}},
        },
    ],
}
_ROW_VALIDATOR = make_validator(ROW_SCHEMA)

# ----------------------------------------------------------------------------- rows


def row_hash(row: Mapping[str, Any]) -> str:
    """sha256 of the canonical JSON of ``row`` without its ``row_hash`` field."""
    return sha256_bytes(canonical_json({k: v for k, v in row.items() if k != "row_hash"}))


def _engine_label(info: Mapping[str, Any]) -> str:
    version = str(info.get("version") or "").strip()
    return f"{info['name']} {version}".strip()


def row_from_receipt(receipt: Mapping[str, Any]) -> dict[str, Any]:
    """The ledger fields a receipt determines (``RECEIPT_FIELDS``, and for receipts that judge two
    tiers ``compute_class``, ``release`` and ``calibrated``: each tier's status), for ``append_row``.

    ``model`` is the receipt's ``model.name`` (else the file name), ``quant`` its GGUF file type,
    ``candidate``/``reference`` ``"NAME VERSION"``, ``min_cosine`` the observed minimum,
    ``basis_kind`` the kind of the basis of the cosine threshold that judged it. A calibration
    receipt's row names the class as its candidate and its verdict is MEASURED; a tokenizer
    receipt's row (``harness tokenizer``) counts the reference's token ids compared as its
    positions and has no cosine and no basis (exact equality is its gate); a chat-parsers receipt's
    row (``harness chat-parsers``) names the server and its version as its candidate and counts the
    fields compared (three per script run) as its positions.
    A discharge receipt's row (``harness discharge``) names the GREEN subject as its candidate,
    its contract and the count of obligations per result; it has no model, positions or cosine.
    Long because it is a table: one literal row per receipt kind.
    """
    if receipt.get("schema") == "harness-discharge-receipt/v1":
        return {"kind": "discharge", "model": None, "model_sha256": None, "quant": None, "receipt_id": receipt["id"],
                "candidate": receipt["candidate"], "reference": None, "positions": None, "min_cosine": None,
                "verdict": receipt["verdict"], "argmax_agreement": None, "near_tie_flips": None, "hard_flips": None,
                "kld_mean": None, "basis_kind": None, "contract": receipt["contract"]["id"], "obligations": dict(receipt["counts"])}
    model = receipt["model"]
    base = {"model": model.get("name") or Path(model["path"]).name, "model_sha256": model["sha256"], "quant": model["file_type"],
            "receipt_id": receipt["id"]}
    if receipt.get("schema") == "harness-calibration-receipt/v1":
        gates = receipt["row"]["gates"]
        return {"kind": "calibration", **base, "candidate": f"class {receipt['compute_class']}", "reference": "llama.cpp",
                "positions": receipt["positions"], "min_cosine": min(p["min_cosine"] for p in receipt["pairs"]),
                "verdict": receipt["verdict"], "argmax_agreement": None, "near_tie_flips": None, "hard_flips": None,
                "kld_mean": max(p["kld_mean"] for p in receipt["pairs"]), "basis_kind": gates["min_cosine"]["basis"]["kind"],
                "compute_class": receipt["compute_class"]}
    if receipt.get("schema") in ("harness-tokenizer-receipt/v1", "harness-chat-parsers-receipt/v1"):  # no logits: exact equality
        return {"kind": receipt["kind"], **base, "candidate": _engine_label(receipt["engines"]["candidate"]),
                "reference": _engine_label(receipt["engines"]["reference"]), "positions": receipt["positions"], "min_cosine": None,
                "verdict": receipt["verdict"], "argmax_agreement": None, "near_tie_flips": None, "hard_flips": None, "kld_mean": None,
                "basis_kind": None}
    if receipt.get("schema") in ("harness-probe-receipt/v1", "harness-mtp-receipt/v1"):
        row = {
            "kind": receipt["kind"],
            **base,
            "candidate": _engine_label(receipt["engines"]["candidate"]),
            "reference": _engine_label(receipt["engines"]["reference"]) if receipt["engines"].get("reference") else None,
            "positions": receipt["positions"],
            "min_cosine": receipt["min_cosine"],
            "verdict": receipt["verdict"],
            "argmax_agreement": None,
            "near_tie_flips": None,
            "hard_flips": None,
            "kld_mean": None,
            "basis_kind": receipt["basis_kind"],
        }
        if "compute_class" in receipt:
            row["compute_class"] = receipt["compute_class"]
        return row
    gated = receipt["gated"]
    row = {
        "kind": receipt["kind"],
        **base,
        "candidate": _engine_label(receipt["engines"]["candidate"]),
        "reference": _engine_label(receipt["engines"]["reference"]),
        "positions": gated["positions"],
        "min_cosine": gated["min_cosine_observed"],
        "verdict": gated["verdict"],
        **report_only_headline(receipt["report_only"]),
        "basis_kind": gated.get("basis_kind") or _cosine_basis_kind(receipt["thresholds"]),
    }
    if "release" in gated:  # two-tier receipts (harness-thresholds/v2)
        row.update(compute_class=gated["compute_class"], release=gated["release"]["status"], calibrated=gated["calibrated"]["status"])
    if receipt["report_only"].get("free_running"):
        row[FREE_RUNNING_FIELD] = free_running_headline(receipt["report_only"]["free_running"])
    return row


def free_running_headline(fr: Mapping[str, Any]) -> str:
    """A receipt's ``report_only.free_running`` in one line: ``identical 5/6, diverged 1
    (near-tie 1, hard 0) over 64 tokens``, or ``unmeasured: REASON``."""
    if "unmeasured" in fr:
        return f"unmeasured: {fr['unmeasured']}"
    n = fr["identical"] + fr["diverged"]
    return f"identical {fr['identical']}/{n}, diverged {fr['diverged']} (near-tie {fr['near_tie']}, hard {fr['hard']}) over {fr['n_tokens']} tokens"


def _cosine_basis_kind(thresholds: Mapping[str, Any]) -> str:
    """The basis kind of the cosine threshold in a receipt's thresholds: the one gate of a
    harness-thresholds/v1 receipt, else the release gate's."""
    section = thresholds.get("gates") or thresholds["release"]
    return section["min_cosine"]["basis"]["kind"]


def timing_fields(receipt: Mapping[str, Any]) -> dict[str, Any]:
    """``TIMING_FIELDS`` from a receipt's ``timings`` (empty when it has none): the candidate's
    wall, load and prefill tokens/s, the reference's wall and tokens/s."""
    t = receipt.get("timings") or {}
    out: dict[str, Any] = {}
    for role, keys in (("candidate", ("wall_s", "load_s", "tokens_per_s")), ("reference", ("wall_s", "tokens_per_s"))):
        e = t.get(role)
        if e:
            for k in keys:
                out[f"{role}_{k}"] = e["prefill_tokens_per_s"] if k == "tokens_per_s" else e[k]
    return out


def receipt_row(written: Mapping[str, Any], run: Mapping[str, Any]) -> dict[str, Any]:
    """The row fields of a receipt as written (``row_from_receipt(written)``) with the timings of
    this run's receipt ``run`` (``timing_fields``): an identical earlier run may have written the
    file, and so its timings."""
    return {**row_from_receipt(written), **timing_fields(run)}


def supersede_row(seq: int, reason: str) -> dict[str, Any]:
    """A row that withdraws row ``seq`` (rows are never edited); append it with ``append_row``."""
    return {"kind": "supersede", "supersedes": int(seq), "reason": reason}


def _complete(row: Mapping[str, Any]) -> dict[str, Any]:
    out = {k: None for k in ROW_FIELDS if k not in ("seq", "time", "prev_hash", "row_hash")}
    out.update(row)
    return out


def _validate_row(row: Mapping[str, Any]) -> str | None:
    err = best_error(_ROW_VALIDATOR.iter_errors(row))
    return None if err is None else f"{err[0] or 'row'}: {err[1]}"


def _parse_lines(data: bytes) -> list[tuple[int, dict[str, Any] | None, str | None]]:
    """``(line_no, row or None, error or None)`` for each line of a ledger file."""
    lines = data.split(b"\n")
    if lines and lines[-1] == b"":
        lines.pop()  # after the final newline
    out = []
    for i, raw in enumerate(lines, start=1):
        try:
            row = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            out.append((i, None, f"not a JSON row: {e}"))
            continue
        if not isinstance(row, dict):
            out.append((i, None, "not a JSON object"))
        elif isinstance(row.get("seq"), int) and not 1 <= row["seq"] <= MAX_SEQ:
            out.append((i, None, seq_problem(row)))
        else:
            out.append((i, row, None))
    return out


def _read(ledger_path: Path) -> bytes:
    try:
        return ledger_path.read_bytes()
    except FileNotFoundError:
        return b""
    except OSError as e:
        raise InvalidInput(f"{ledger_path}: cannot read ledger: {e.strerror or e}") from e


def read_rows(ledger_path: str | Path) -> list[dict[str, Any]]:
    """All rows of a ledger (empty if the file does not exist).

    Raises ``InvalidInput`` naming the line when a line is not a JSON object; it does not check
    hashes (``verify_ledger`` does).
    """
    ledger_path = Path(ledger_path)
    data = _read(ledger_path)
    rows = []
    for line, row, err in _parse_lines(data):
        if err:
            raise InvalidInput(f"{ledger_path}:{line}: {err}; run `harness ledger verify`")
        rows.append(row)
    return rows


@dataclass(frozen=True)
class Problem:
    """One finding of ``verify_ledger``: a ``code``, a message, and where (seq, 1-based line).

    Codes: MALFORMED, EDITED, SEQUENCE, CHAIN, HEAD, MARKDOWN, SUPERSEDE, RECEIPT-MISSING,
    RECEIPT-HASH, RECEIPT-INVALID, RECEIPT-MISMATCH, SIGNOFF-ORDER.
    """

    code: str
    message: str
    seq: int | None = None
    line: int | None = None

    def __str__(self) -> str:
        where = " ".join(x for x in (f"line {self.line}" if self.line else "", f"seq {self.seq}" if self.seq else "") if x)
        return f"{self.code}{' (' + where + ')' if where else ''}: {self.message}"
