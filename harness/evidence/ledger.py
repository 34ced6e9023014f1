"""The sign-off ledger: append-only, hash-chained ``ledger.jsonl`` and its rendering, LEDGER.md.

``evidence/parity/ledger.jsonl`` is the source of truth: one canonical-JSON row per line (fields
in ``ROW_FIELDS``), each carrying the hash of the row before it (``prev_hash``; the first row
holds ``GENESIS``), its own hash (``row_hash``: sha256 of the canonical JSON of the row without
``row_hash``) and the sha256 of its receipt file. LEDGER.md is the rendered table and shows the
head (last seq and row_hash), so removing the last row is detected too. Rows are never edited; a
wrong row is superseded by a ``kind: supersede`` row naming it (``supersede_row``). A release
sign-off is a ``kind: signoff`` row (``SIGNOFF_FIELDS``: the release, each candidate's build, every
cell's status, the receipts it relied on with their sha256, and what blocked it), rendered in its
own LEDGER.md section; ``verify_ledger`` checks that every receipt it names exists, hashes as
recorded and has a row earlier in the chain.

``append_row`` holds a file lock (``filelock``) across read-head → append → render, so
concurrent runs neither lose nor duplicate rows. ``verify_ledger`` reports edited, malformed,
removed (the last too), inserted, reordered and forged rows, each with its seq and line.

What the chain cannot do: someone who rewrites the file, recomputes every hash and re-renders
LEDGER.md is caught only by the receipts (``receipts_dir``: a forged row has no receipt whose
bytes and content match it) and by git history.
"""

from __future__ import annotations

import contextlib
import functools
import glob
import hashlib
import json
import os
import re
import stat
import sys
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Mapping

import numpy as np
from filelock import FileLock, Timeout

from harness import display
from harness.errors import InvalidInput
from harness.fschecks import read_limited
from harness.evidence.ledger_cache import MAX_SEQ, LedgerCache, seq_problem
from harness.evidence.receipts import (
    canonical_json,
    load_receipt,
    SHARD_CHARS,
    receipt_file,
    report_only_headline,
    utc_now,
)
from harness.provenance import sha256_bytes, sha256_file
from harness.rundir import pid_alive
from harness.validation import best_error, make_validator, unique_keys


class _Pandas:
    """``pandas``, imported on first use: only the ledger views (``ledger show``, trends) need it,
    and importing it costs a parity run about a second it would otherwise not spend."""

    def __getattr__(self, name: str) -> Any:
        import pandas

        return getattr(pandas, name)


pd = _Pandas()

GENESIS = "0" * 64
"""``prev_hash`` of the first row."""

KINDS = ("parity", "self-consistency", "probe", "mtp", "calibration", "tokenizer", "supersede", "signoff")

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

OPTIONAL_FIELDS = ("model_sha256", "supersedes", "reason", FREE_RUNNING_FIELD, *TIMING_FIELDS, *TIER_FIELDS, *SIGNOFF_FIELDS)
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
    ],
}
_ROW_VALIDATOR = make_validator(ROW_SCHEMA)

_HEAD_RE = re.compile(r"^Head: seq (\d+) · row_hash `([0-9a-f]{64})`$", re.M)
_EMPTY_HEAD = "Head: none (empty ledger)"


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
    positions and has no cosine and no basis (exact equality is its gate).
    Long because it is a table: one literal row per receipt kind.
    """
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
    if receipt.get("schema") == "harness-tokenizer-receipt/v1":  # no logits: positions are the reference's token ids compared
        return {"kind": "tokenizer", **base, "candidate": _engine_label(receipt["engines"]["candidate"]),
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


# ----------------------------------------------------------------------------- paths and reading


def default_markdown_path(ledger_path: str | Path) -> Path:
    """LEDGER.md at the repo root for ``<root>/evidence/parity/ledger.jsonl``, else the ledger's
    path with suffix ``.md``."""
    p = Path(ledger_path)
    if p.name == "ledger.jsonl" and p.parent.name == "parity" and p.parent.parent.name == "evidence":
        return p.parent.parent.parent / "LEDGER.md"
    return p.with_suffix(".md")


RENDER_TITLE = "# Sign-off ledger"
"""First line of every rendering; with the ``Rendered from `LEDGER`.`` line it marks a file the
harness wrote (``markdown_path_for`` refuses to write over anything else)."""


def _shown_ledger(ledger_path: Path, md_path: Path | None) -> str:
    """How a rendering names its ledger: the ledger's path relative to the rendering's folder."""
    base = md_path.parent if md_path else ledger_path.parent
    try:
        return display.plain(os.path.relpath(ledger_path, base))
    except ValueError:
        return display.plain(ledger_path)


def markdown_path_for(ledger_path: str | Path, markdown_path: str | Path | None = None) -> Path:
    """The rendering ``append_row`` will write for ``ledger_path`` (``markdown_path`` or
    ``default_markdown_path``), refused with ``InvalidInput`` (exit 2) when writing it could
    destroy something the harness did not create:

    - the ledger's name does not end in ``.jsonl`` (``--ledger LEDGER.md`` would make the
      rendering the ledger itself; any other suffix makes the pair ambiguous);
    - the rendering is the ledger file (same path, or a link to it);
    - the rendering exists and is not a regular file, or is not a rendering of this ledger (its
      first line is not ``RENDER_TITLE`` or it names another ledger): ``--ledger
      notes/README.jsonl`` must never overwrite ``notes/README.md``.

    Only the first 4 KiB of an existing rendering are read.
    """
    ledger_path = Path(ledger_path)
    if ledger_path.suffix != ".jsonl":
        raise InvalidInput(f"{ledger_path}: a ledger's file name must end in .jsonl (its Markdown rendering is written "
                           "beside it as .md); refusing an ambiguous ledger path")
    md = Path(markdown_path) if markdown_path else default_markdown_path(ledger_path)
    same = os.path.abspath(md) == os.path.abspath(ledger_path)
    if not same and md.exists() and ledger_path.exists():
        same = os.path.samefile(md, ledger_path)
    if same:
        raise InvalidInput(f"{md}: the rendered ledger would be the ledger itself; refusing")
    try:
        st = os.lstat(md)
    except (FileNotFoundError, NotADirectoryError):  # nothing there to protect (fschecks says whether it can be created)
        return md
    except OSError as e:
        raise InvalidInput(f"{md}: cannot use as the rendered ledger: {e.strerror or e}") from None
    if not stat.S_ISREG(st.st_mode):
        raise InvalidInput(f"{md}: the rendered ledger path is not a regular file; refusing to write over it")
    try:
        with open(md, "rb") as f:
            head = f.read(4096).decode("utf-8", errors="replace").split("\n")
    except OSError as e:
        raise InvalidInput(f"{md}: cannot read the rendered ledger: {e.strerror or e}") from None
    if head[0] != RENDER_TITLE or not any(ln.startswith("Rendered from `") for ln in head[1:4]):
        raise InvalidInput(f"{md}: exists and is not a ledger rendering written by the harness; refusing to overwrite it "
                           f"(choose a --ledger whose .md sibling is free)")
    shown = _shown_ledger(ledger_path, md)
    if not any(ln.startswith(f"Rendered from `{shown}`") for ln in head[1:4]):
        raise InvalidInput(f"{md}: is the rendering of another ledger, not {shown}; refusing to overwrite it")
    return md


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


# ----------------------------------------------------------------------------- append


def _bind_receipt(new: dict[str, Any], receipt_path: Path) -> None:
    """Set the row's ``receipt_id`` (the file's stem) unless given, check a given one names this
    file, and set ``receipt_sha256`` from the file's bytes. Raises ``InvalidInput``."""
    if new.get("receipt_id") is None:
        new["receipt_id"] = receipt_path.stem
    elif new["receipt_id"] != receipt_path.stem:
        raise InvalidInput(f"row names receipt {new['receipt_id']} but the receipt file is {receipt_path.name}")
    new["receipt_sha256"] = sha256_file(receipt_path)


def _chain(new: dict[str, Any], head: dict[str, Any] | None, rows: list[dict[str, Any]] | None, ledger_path: Path) -> None:
    """Link ``new`` after ``head`` (None: the first row): ``seq``, ``time`` (unless given),
    ``prev_hash``, then validate it against the row schema and its supersede target (among
    ``rows`` when given, else by seq: a chain's seqs run 1..head without gaps), then set
    ``row_hash``. Raises ``InvalidInput``."""
    if head and head["seq"] >= MAX_SEQ:
        raise InvalidInput(f"{ledger_path}: the last row's seq {str(head['seq'])[:30]} leaves no room for another (at most 2**63-1); "
                           "run `harness ledger verify`")
    new["seq"] = head["seq"] + 1 if head else 1
    new.setdefault("time", None)
    if new["time"] is None:
        new["time"] = utc_now()
    new["prev_hash"] = head["row_hash"] if head else GENESIS
    new["row_hash"] = GENESIS  # placeholder so the schema sees every field
    err = _validate_row(new)
    if err:
        raise InvalidInput(f"ledger row: {err}")
    if new["kind"] == "supersede":
        target = new["supersedes"]
        known = any(r.get("seq") == target for r in rows) if rows is not None else 1 <= target <= (head["seq"] if head else 0)
        if not known:
            raise InvalidInput(f"{ledger_path}: cannot supersede seq {target}: no such row")
    new["row_hash"] = row_hash(new)


LOCK_NOTICE_S = 5.0
"""After this many seconds waiting for the ledger lock, ``ledger_lock`` says so on stderr, then
every ``LOCK_NOTICE_EVERY_S``: a wait on a lock held by another live process is never silent."""
LOCK_NOTICE_EVERY_S = 30.0


@contextlib.contextmanager
def ledger_lock(ledger_path: Path, timeout: float, notice: Any = None) -> Iterator[None]:
    """Hold the ledger's file lock (``<ledger>.lock``, ``filelock``), waiting at most ``timeout``
    seconds; while it waits longer than ``LOCK_NOTICE_S`` a line goes to ``notice`` (default:
    stderr) then every ``LOCK_NOTICE_EVERY_S``: ``harness: waiting for the ledger lock … (held by
    another process; N s of at most T s)``. Raises ``filelock.Timeout`` when the time runs out."""
    lock = FileLock(str(ledger_path) + ".lock")
    say = notice or (lambda line: print(line, file=sys.stderr, flush=True))
    t0 = time.monotonic()
    step = min(LOCK_NOTICE_S, timeout)
    while True:
        try:
            lock.acquire(timeout=step)
            break
        except Timeout:
            waited = time.monotonic() - t0
            if waited >= timeout:
                raise
            say(display.plain(f"harness: waiting for the ledger lock {ledger_path}.lock (held by another process; "
                              f"{waited:.0f} s of at most {timeout:g} s)"))
            step = min(LOCK_NOTICE_EVERY_S, timeout - waited)
    try:
        yield
    finally:
        lock.release()


def append_row(
    ledger_path: str | Path,
    row: Mapping[str, Any],
    receipt_path: str | Path | None = None,
    markdown_path: str | Path | None = None,
    *,
    lock_timeout: float = 120.0,
) -> dict[str, Any]:
    """Append one row under the ledger's file lock, then re-render the markdown; return the row.

    Its cost does not grow with the ledger: it reads the last line it chains from
    (``check_ledger_head`` reads the file backwards from its end), appends one line, and
    re-renders only the LEDGER.md pages the row changes (``render_pages``: the newest page, and
    the page of a row a supersede row withdraws).

    ``row`` gives the content fields (``row_from_receipt(receipt)``, or ``supersede_row``); the
    ledger sets ``seq``, ``prev_hash``, ``row_hash``, ``time`` (unless given) and, from
    ``receipt_path``, ``receipt_sha256`` (sha256 of the receipt file's bytes). Missing content
    fields become null. ``markdown_path`` defaults to ``default_markdown_path(ledger_path)``.

    Raises ``InvalidInput`` when the row breaks the row schema, names a receipt other than the
    file given, supersedes a row that does not exist, or when the ledger's last row is partial,
    malformed or edited (the chain is not extended from a broken head; run ``verify_ledger``),
    when the lock cannot be taken within ``lock_timeout`` seconds, when the ledger or its
    rendering path is refused (``markdown_path_for``) or cannot be written. One function on
    purpose: everything from taking the lock to releasing it is one critical section.
    """
    ledger_path = Path(ledger_path)
    md_path = markdown_path_for(ledger_path, markdown_path)
    new = _complete(row)
    for owned in ("seq", "prev_hash", "row_hash"):
        new.pop(owned, None)
    if receipt_path is not None:
        _bind_receipt(new, Path(receipt_path))
    try:
        ledger_path.parent.mkdir(parents=True, exist_ok=True)
        with ledger_lock(ledger_path, lock_timeout):
            head = check_ledger_head(ledger_path)
            _chain(new, head, None, ledger_path)
            with open(ledger_path, "ab") as f:
                f.write(canonical_json(new) + b"\n")
                f.flush()
                os.fsync(f.fileno())
            try:
                render_pages(ledger_path, md_path)
            except OSError as e:
                raise InvalidInput(f"{md_path}: row seq {new['seq']} was appended to {ledger_path}, but the rendering could not "
                                   f"be rewritten ({e.strerror or e}); the next append re-renders it") from None
    except Timeout as e:
        raise InvalidInput(f"{ledger_path}: could not take the ledger lock within {lock_timeout:g} s") from e
    except OSError as e:
        raise InvalidInput(f"{ledger_path}: cannot append to the ledger: {e.strerror or e}") from None
    return new


def check_ledger_head(ledger_path: str | Path) -> dict[str, Any] | None:
    """The row a new row would chain from (None for an empty or missing ledger), checked as
    ``append_row`` checks it; raises ``InvalidInput`` when the ledger cannot be extended (a
    partial, malformed or edited last row, an unreadable file). Called before engines run."""
    ledger_path = Path(ledger_path)
    data = _tail_bytes(ledger_path)
    parsed = _parse_lines(data)
    try:
        return _check_head_for_append(ledger_path, data, parsed)
    except InvalidInput:
        # Name the line as before (line numbers need the whole file; this is the error path only).
        full = _read(ledger_path)
        _check_head_for_append(ledger_path, full, _parse_lines(full))
        raise


def _tail_bytes(ledger_path: Path, block: int = 1 << 16) -> bytes:
    """The ledger file's last line with its newline, read backwards from the end in
    ``block``-byte steps (the whole file when it has one line; the unterminated tail when it ends
    in a partial line); ``b""`` for a missing or empty file. Raises ``InvalidInput`` when the file
    cannot be read."""
    try:
        with open(ledger_path, "rb") as f:
            pos = f.seek(0, os.SEEK_END)
            buf = b""
            while pos > 0:
                step = min(block, pos)
                pos -= step
                f.seek(pos)
                buf = f.read(step) + buf
                if not buf.endswith(b"\n"):
                    return buf  # a partial last line: the caller refuses it
                cut = buf.rfind(b"\n", 0, len(buf) - 1)
                if cut >= 0:
                    return buf[cut + 1:]
            return buf
    except FileNotFoundError:
        return b""
    except OSError as e:
        raise InvalidInput(f"{ledger_path}: cannot read ledger: {e.strerror or e}") from e


def _check_head_for_append(ledger_path: Path, data: bytes, parsed: list) -> dict[str, Any] | None:
    if data and not data.endswith(b"\n"):
        partial = data.count(b"\n") + 1
        raise InvalidInput(f"{ledger_path}: ends in a partial row (line {partial}); run `harness ledger verify`")
    if not parsed:
        return None
    line, head, err = parsed[-1]
    if err:
        raise InvalidInput(f"{ledger_path}:{line}: last row is malformed ({err}); run `harness ledger verify`")
    if head.get("row_hash") != row_hash(head) or not isinstance(head.get("seq"), int):
        raise InvalidInput(f"{ledger_path}:{line}: last row (seq {head.get('seq')}) does not match its row_hash; run `harness ledger verify`")
    return head


def _write_text_atomic(path: Path, text: str) -> None:
    """Write ``text`` to a temporary file beside ``path`` and rename it over ``path``; the
    temporary file is removed when anything fails, and those of killed runs (their process is
    gone) are removed first. Called under the ledger lock."""
    path.parent.mkdir(parents=True, exist_ok=True)
    for stale in path.parent.glob(f".{glob.escape(path.name)}.*.tmp"):  # left by runs killed mid-render
        pid = stale.name[len(path.name) + 2 : -4]
        if pid.isdigit() and int(pid) != os.getpid() and not pid_alive(int(pid)):
            stale.unlink(missing_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


# ----------------------------------------------------------------------------- render


def _fmt(v: Any, spec: str) -> str:
    if v is None:
        return "—"
    return format(v, spec)


def _cell(v: Any) -> str:
    """A row's value as a Markdown table cell (``display.md_text``: no control characters, no cell
    breaks, links, code spans or HTML). Strings are memoized (``_cell_str``): a ledger repeats its
    models, candidates and dates on every row, and a full verification renders every row."""
    return _cell_str(v) if type(v) is str else display.md_text(v)


@functools.lru_cache(maxsize=4096)
def _cell_str(v: str) -> str:
    return display.md_text(v)


def _speed(r: Mapping[str, Any]) -> str:
    """The candidate's prefill tokens/s and wall seconds of a row, or a dash (rows before timings)."""
    tps, wall = r.get("candidate_tokens_per_s"), r.get("candidate_wall_s")
    if tps is None and wall is None:
        return "—"
    return f"{_fmt(tps, ',.0f')} ({_fmt(wall, '.1f')})"


def _table_line(r: Mapping[str, Any], superseded: Mapping[Any, Any], speed: bool) -> str:
    """One LEDGER.md table line: row ``r``'s fields, its verdict struck through when a later row
    in ``superseded`` (seq → superseding seq) withdraws it, and the speed column when ``speed``."""
    verdict = _cell(r.get("verdict") or "—")
    if r.get("seq") in superseded:
        verdict = f"~~{verdict}~~ (superseded by #{superseded[r.get('seq')]})"
    model = _cell(r.get("model") or "—")
    if r.get("kind") == "supersede":
        model = f"supersedes #{r.get('supersedes')}: {_cell(r.get('reason', ''))}"
    flips = "—" if r.get("near_tie_flips") is None else f"{r.get('near_tie_flips')} / {r.get('hard_flips')}"
    receipt = f"`{r['receipt_id'][:12]}`" if r.get("receipt_id") else "—"
    return (
        "| "
        + " | ".join(
            [
                str(r.get("seq")),
                _cell(str(r.get("time") or "")[:10]),
                _cell(r.get("kind")),
                model,
                _cell(r.get("quant") or "—"),
                _cell(r.get("candidate") or "—"),
                _cell(r.get("reference") or "—"),
                _fmt(r.get("positions"), "d"),
                _fmt(r.get("min_cosine"), ".6f"),
                verdict,
                _fmt(r.get("argmax_agreement"), ".4f"),
                flips,
                _fmt(r.get("kld_mean"), ".3g"),
                _cell(r.get("basis_kind") or "—"),
                receipt,
            ]
            + ([_speed(r)] if speed else [])
        )
        + " |"
    )


PAGE_ROWS = 100
"""Rows per LEDGER.md page: page ``c`` holds seqs ``(c-1)*PAGE_ROWS+1 .. c*PAGE_ROWS``. LEDGER.md
shows the newest page (the head's); older pages are files in ``<stem>-pages/`` beside it
(``page_path``), newest first inside each, so an append rewrites one page of at most 100 rows."""

_TABLE_HEADER = ("| seq | date | kind | model | quant | candidate | reference | positions | min cos | verdict | argmax agr | "
                 "near-tie / hard flips | KLD mean | basis | receipt | candidate tok/s (wall s) |")
_TABLE_RULE = "|---:|---|---|---|---|---|---|---:|---:|---|---:|---:|---:|---|---|---:|"
_SIGNOFF_HEAD = ["", "## Sign-offs", "",
                 "Each row lists every receipt it relied on (`harness ledger verify` checks they exist, match and come before it); "
                 "`head` is the chain's head when it was signed.", "",
                 "| seq | date | release | builds | cells | verdict | head |", "|---:|---|---|---|---|---|---|"]
_PAGES_LINE = "Older rows, newest first: "


PAGE_LINKS = 10
"""How many of the newest older pages LEDGER.md (and the index) link by number; the first page is
linked too, and every older page links the one before it, so the line stays the same length at
any ledger size."""


def linked_pages(top: int) -> list[int | None]:
    """The older pages the head's page ``top`` links, newest first: the ``PAGE_LINKS`` newest, then
    (None: a gap, shown as an ellipsis) page 1 when it is not among them."""
    newest = list(range(top - 1, max(top - 1 - PAGE_LINKS, 0), -1))
    if newest and newest[-1] > 1:
        newest += ([None] if newest[-1] > 2 else []) + [1]
    return newest


def page_of(seq: int) -> int:
    """The page (1-based) holding row ``seq``."""
    return (int(seq) - 1) // PAGE_ROWS + 1


def page_seqs(page: int) -> tuple[int, int]:
    """The first and last seq of ``page``."""
    return (page - 1) * PAGE_ROWS + 1, page * PAGE_ROWS


def pages_dir(markdown_path: str | Path) -> Path:
    """Where the older pages of a rendering live: ``<stem>-pages/`` beside it (``LEDGER-pages/``)."""
    md = Path(markdown_path)
    return md.with_name(md.stem + "-pages")


def page_path(markdown_path: str | Path, page: int) -> Path:
    """The file of older page ``page`` (``LEDGER-pages/page-000001.md``)."""
    return pages_dir(markdown_path) / f"page-{page:06d}.md"


def _preamble(shown: str, head: Mapping[str, Any] | None) -> list[str]:
    return [RENDER_TITLE, "",
            f"Rendered from `{shown}`, the source of truth, after every append. Do not edit by hand:",
            "`harness ledger verify` checks the hash chain, this file's head and each row against its receipt.", "",
            f"Head: seq {head['seq']} · row_hash `{head['row_hash']}`" if head else _EMPTY_HEAD, ""]


def _body(rows: list[Mapping[str, Any]], superseded: Mapping[Any, Any]) -> tuple[list[str], list[str]]:
    """The table lines and the sign-off lines of ``rows``, newest first."""
    newest = sorted(rows, key=lambda r: -(r.get("seq") or 0))
    return ([_table_line(r, superseded, True) for r in newest if r.get("kind") != "signoff"],
            [_signoff_line(r, superseded) for r in newest if r.get("kind") == "signoff"])


def _assemble(top: list[str], table: list[str], signoffs: list[str]) -> str:
    lines = top + [_TABLE_HEADER, _TABLE_RULE] + table
    if signoffs:
        lines += _SIGNOFF_HEAD + signoffs
    return "\n".join(lines) + "\n"


def render_markdown(rows: list[Mapping[str, Any]], ledger_path: str | Path, markdown_path: str | Path | None = None) -> str:
    """The full rendering of ``rows`` in one text: a header, the head (last seq and row_hash), one
    table line per row, newest first, and the sign-offs in their own section, newest first.

    Superseded rows stay, their verdict struck through and pointing at the superseding row. The
    last column shows the candidate's prefill tokens/s and wall seconds (a dash for rows without
    timings). What ``append_row`` writes is this text cut into pages (``render_page``);
    ``join_pages`` puts them back together into exactly this text.
    """
    ledger_path = Path(ledger_path)
    shown = _shown_ledger(ledger_path, Path(markdown_path) if markdown_path else None)
    superseded = {r.get("supersedes"): r.get("seq") for r in rows if r.get("kind") == "supersede"}
    table, signoffs = _body(rows, superseded)
    return _assemble(_preamble(shown, rows[-1] if rows else None), table, signoffs)


def render_page(page: int, rows: list[Mapping[str, Any]], superseded: Mapping[Any, Any], head: Mapping[str, Any] | None,
                ledger_path: str | Path, markdown_path: str | Path) -> str:
    """One page of the rendering: ``rows`` are the rows of ``page`` (``page_seqs``) that exist,
    ``superseded`` maps each of them that a later row withdraws to that row's seq. The head's
    page (``page == page_of(head seq)``) is LEDGER.md itself: the full rendering's header and
    head, a line linking the newest older pages and the first (``linked_pages``), and its rows;
    an older page has a title naming its seqs and a line linking back and to the page before it. Both have the same table and sign-off section as the full
    rendering, restricted to their rows."""
    md = Path(markdown_path)
    shown = _shown_ledger(Path(ledger_path), md)
    table, signoffs = _body(rows, superseded)
    last = page_of(head["seq"]) if head else 1
    if page == last:
        top = _preamble(shown, head)
        if last > 1:
            folder = pages_dir(md).name
            links = ", ".join("…" if n is None else f"[{n}]({folder}/page-{n:06d}.md)" for n in linked_pages(last))
            top += [f"{_PAGES_LINE}{links}.", ""]
        return _assemble(top, table, signoffs)
    lo, hi = page_seqs(page)
    before = f" The rows before these: [page {page - 1}](page-{page - 1:06d}.md)." if page > 1 else ""
    top = [f"{RENDER_TITLE}: rows {lo}–{hi}", "", f"Rendered from `{shown}`; page {page}. "
           f"The head and the newest rows are in [{md.name}](../{md.name}).{before} Do not edit by hand.", ""]
    return _assemble(top, table, signoffs)


def join_pages(head_text: str, older: list[str]) -> str:
    """The full rendering (``render_markdown``) rebuilt from LEDGER.md's text and its older pages'
    texts, newest page first: LEDGER.md's header and head, then every page's table lines, then
    every page's sign-off lines. Raises ``ValueError`` for a text that is not a page."""
    def split(text: str) -> tuple[list[str], list[str], list[str]]:
        lines = text.rstrip("\n").split("\n")
        i = lines.index(_TABLE_HEADER)
        j = lines.index(_SIGNOFF_HEAD[1]) if _SIGNOFF_HEAD[1] in lines else len(lines)
        return lines[:i], lines[i + 2:j], lines[j + len(_SIGNOFF_HEAD) - 1:] if j < len(lines) else []
    top, table, signoffs = split(head_text)
    top = [ln for ln in top if not ln.startswith(_PAGES_LINE)]
    if top and top[-1] == "" and len(top) >= 2 and top[-2] == "":
        top = top[:-1]
    for text in older:
        _, t, so = split(text)
        table += t
        signoffs += so
    return _assemble(top, table, signoffs)


def rendered_head_seq(markdown_path: str | Path) -> int | None:
    """The head seq a rendering shows (0: ``Head: none``), from its first 4 KiB; None when the file
    is missing or shows no head."""
    try:
        with open(markdown_path, "rb") as f:
            head = f.read(4096).decode("utf-8", errors="replace")
    except OSError:
        return None
    m = _HEAD_RE.search(head)
    if m:
        return int(m.group(1))
    return 0 if _EMPTY_HEAD in head else None


def render_pages(ledger_path: str | Path, markdown_path: str | Path | None = None, *, full: bool = False,
                 cache: LedgerCache | None = None) -> list[Path]:
    """Bring the rendering up to the ledger (called by ``append_row`` under the ledger lock):
    write the pages that changed since the head the rendering shows (``rendered_head_seq``), and
    return their paths. Those are the head's page (LEDGER.md), pages that filled up since, and the
    page of each row a new supersede row withdraws; older pages first, LEDGER.md last, so a head
    in LEDGER.md means every page before it is written. ``full`` (or a rendering without a
    head) writes every page. Rows come from the query cache (``LedgerCache``), so the cost is the
    pages written, not the ledger. Raises ``OSError`` when a page cannot be written."""
    ledger_path = Path(ledger_path)
    md = Path(markdown_path) if markdown_path else default_markdown_path(ledger_path)
    own = cache is None
    cache = cache or LedgerCache.open(ledger_path, CACHE_COLUMNS, check=full)  # a full render is checked against the ledger
    try:
        last = cache.last_seq()
        head = cache.rows(last, last)[0] if last else None
        shown = rendered_head_seq(md)
        top = page_of(last) if last else 1
        if full or shown is None or shown > last:
            todo = set(range(1, top + 1))
        else:
            todo = set(range(page_of(max(shown, 1)), top + 1))
            todo |= {page_of(t) for t in cache.supersede_targets(shown + 1, last) if 1 <= t <= last}
        written = []
        for page in sorted(todo):
            lo, hi = page_seqs(page)
            text = render_page(page, cache.rows(lo, hi), cache.superseded(lo, hi), head, ledger_path, md)
            path = md if page == top else page_path(md, page)
            if path != md:
                path.parent.mkdir(parents=True, exist_ok=True)
            _write_text_atomic(path, text)
            written.append(path)
        return written
    finally:
        if own:
            cache.close()


def _signoff_line(r: Mapping[str, Any], superseded: Mapping[Any, Any]) -> str:
    """One line of LEDGER.md's sign-off section: release, each candidate's build (12 hex digits),
    cells signed of all, verdict (struck through when superseded) and the head it was signed at."""
    verdict = _cell(r.get("verdict") or "—")
    if r.get("seq") in superseded:
        verdict = f"~~{verdict}~~ (superseded by #{superseded[r.get('seq')]})"
    builds = ", ".join(f"{_cell(k)} `{str(v)[:12]}`" for k, v in sorted((r.get("builds") or {}).items())) or "—"
    cells = r.get("cells") or []
    ok = sum(1 for c in cells if c.get("status") == "ok")
    return (f"| {r.get('seq')} | {_cell(str(r.get('time') or '')[:10])} | {_cell(r.get('release_name'))} | {builds} | "
            f"{ok}/{len(cells)} ok | {verdict} | `{str(r.get('prev_hash'))[:12]}` |")


# ----------------------------------------------------------------------------- verify


def _line_row_hash(raw: bytes, row: Mapping[str, Any]) -> str | None:
    """sha256 of the ledger line ``raw`` with its ``"row_hash":"…"`` member cut out: the row's
    hash without serializing it again, since ``append_row`` writes each row as its canonical JSON
    (sorted keys; cutting one member leaves the canonical JSON of the rest). None when the line
    holds no such member."""
    h = row.get("row_hash")
    if not isinstance(h, str):
        return None
    member = b'"row_hash":"' + h.encode("utf-8", errors="replace") + b'"'
    i = raw.find(member)
    if i <= 0:
        return None
    j = i + len(member)
    body = raw.rstrip(b"\n")
    cut = body[:i - 1] + body[j:] if body[i - 1:i] == b"," else body[:i] + body[j + 1:]
    return hashlib.sha256(cut).hexdigest()


def _row_problems(row: dict[str, Any], line: int, prev: dict[str, Any] | None, first: bool, seqs_max: int,
                  raw: bytes | None = None) -> list[Problem]:
    """The problems of one well-formed JSON row at ``line``: schema (MALFORMED), content hash
    (EDITED; from the line's bytes ``raw`` when given, ``_line_row_hash``, and from the parsed
    row when those do not match, so a line in another JSON layout is judged by its content),
    ``seq`` and ``prev_hash`` against the previous line's row ``prev`` (SEQUENCE, CHAIN;
    unchecked after a malformed line, ``prev`` None), supersede target among the earlier seqs,
    1..``seqs_max`` (SUPERSEDE)."""
    problems = []
    seq = row.get("seq") if isinstance(row.get("seq"), int) else None
    schema_err = _validate_row(row)
    if schema_err:
        problems.append(Problem("MALFORMED", schema_err, seq, line))
    fast = _line_row_hash(raw, row) if raw is not None else None
    if (fast is None or fast != row.get("row_hash")) and row.get("row_hash") != row_hash(row):
        problems.append(Problem("EDITED", "row_hash does not match the row's content: the row was edited", seq, line))
    if first:
        expected_seq, expected_prev, before = 1, GENESIS, "the genesis hash"
    elif prev is not None:
        expected_seq = prev["seq"] + 1 if isinstance(prev.get("seq"), int) else None
        expected_prev, before = prev.get("row_hash"), f"row seq {prev.get('seq')} (line {line - 1})"
    else:
        expected_seq = expected_prev = None
    if seq is not None and expected_seq is not None and seq != expected_seq:
        problems.append(Problem("SEQUENCE", f"seq {seq} where {expected_seq} was expected: rows removed, inserted or reordered", seq, line))
    if expected_prev is not None and row.get("prev_hash") != expected_prev:
        problems.append(
            Problem("CHAIN", f"prev_hash does not match {before}: a row was removed, inserted or reordered before this one", seq, line)
        )
    target = row.get("supersedes")
    if row.get("kind") == "supersede" and not (isinstance(target, int) and 1 <= target <= seqs_max):
        problems.append(Problem("SUPERSEDE", f"supersedes seq {row.get('supersedes')}, which is not an earlier row", seq, line))
    return problems


@dataclass
class VerifyStats:
    """What a ``verify_ledger`` run covered: ``rows`` checked (all of them, or those after the
    checkpoint), ``receipts`` hashed, ``deep`` receipts loaded and matched to their rows,
    ``skipped`` rows the checkpoint vouched for, ``seconds`` and the last row's ``seq``,
    ``row_hash`` and byte ``offset`` (what a checkpoint records)."""

    rows: int = 0
    receipts: int = 0
    deep: int = 0
    skipped: int = 0
    seconds: float = 0.0
    seq: int = 0
    row_hash: str = GENESIS
    offset: int = 0
    prefix_sha256: str = ""
    mode: str = "full"

    @property
    def rows_per_s(self) -> float:
        """Rows checked per second (0 when nothing was checked)."""
        return self.rows / self.seconds if self.seconds > 0 else 0.0


CHECKPOINT_MAX_BYTES = 64 << 10
"""A checkpoint is a few hundred bytes; a larger file is refused unread (``Checkpoint.load``)."""


@dataclass(frozen=True)
class Checkpoint:
    """The last row a verification found sound: its ``seq``, ``row_hash``, the ledger's byte
    count through that row (``offset``) and the sha256 of those bytes (``prefix_sha256``).

    Threat model: the checkpoint is what vouches for the rows before it, so it must not be
    writable by whoever can write the evidence. ``harness ledger verify`` keeps it outside the
    evidence folder (``default_checkpoint_path``: the user's state folder) and prints it, so CI
    can keep it in its log or cache and pass it back. An incremental run re-hashes the whole
    prefix (sha256 of its bytes, no parsing) and refuses the checkpoint (problem CHECKPOINT, exit
    1) when the bytes differ, the file is shorter, or the row at its end is not the row it
    names: an edited prefix is never reported OK. Receipts of rows before the checkpoint are not
    re-hashed by an incremental run (a full run does)."""

    ledger: str
    seq: int
    row_hash: str
    offset: int
    prefix_sha256: str

    def to_json(self) -> dict[str, Any]:
        """The checkpoint as written to its file."""
        return {"schema": "harness-verify-checkpoint/v1", "ledger": self.ledger, "seq": self.seq, "row_hash": self.row_hash,
                "offset": self.offset, "prefix_sha256": self.prefix_sha256}

    @classmethod
    def load(cls, path: str | Path) -> "Checkpoint | None":
        """The checkpoint in ``path`` (None when there is none). Raises ``InvalidInput`` for a file
        that is not a checkpoint."""
        if not Path(path).exists():
            return None
        raw = read_limited(path, "verify checkpoint", CHECKPOINT_MAX_BYTES)
        try:
            d = json.loads(raw.decode("utf-8"), object_pairs_hook=unique_keys)
        except (ValueError, RecursionError) as e:
            why = "nested too deeply" if isinstance(e, RecursionError) else str(e)[:200]
            raise InvalidInput(f"{path}: not a verify checkpoint: {why}") from None
        if not isinstance(d, dict) or d.get("schema") != "harness-verify-checkpoint/v1":
            raise InvalidInput(f"{path}: not a verify checkpoint (field 'schema')")
        for key, kind in (("ledger", str), ("seq", int), ("row_hash", str), ("offset", int), ("prefix_sha256", str)):
            if type(d.get(key)) is not kind or (kind is int and d[key] < 0):
                raise InvalidInput(f"{path}: not a verify checkpoint (field {key!r} must be a {'non-negative integer' if kind is int else 'string'})")
        return cls(d["ledger"], d["seq"], d["row_hash"], d["offset"], d["prefix_sha256"])

    def save(self, path: str | Path) -> Path:
        """Write the checkpoint to ``path`` (atomically; folders created)."""
        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        _write_text_atomic(p, json.dumps(self.to_json(), indent=1) + "\n")
        return p


def default_checkpoint_path(ledger_path: str | Path) -> Path:
    """Where ``harness ledger verify`` keeps a ledger's checkpoint: outside the evidence folder, in
    ``$HARNESS_VERIFY_STATE`` or ``$XDG_STATE_HOME/harness/verify`` (default
    ``~/.local/state/harness/verify``), named by the sha256 of the ledger's absolute path."""
    base = os.environ.get("HARNESS_VERIFY_STATE") or os.path.join(
        os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state"), "harness", "verify")
    key = hashlib.sha256(os.path.abspath(ledger_path).encode()).hexdigest()[:24]
    return Path(base) / f"{key}.json"


def _prefix_hasher(f, offset: int) -> "hashlib._Hash":
    """sha256 of the first ``offset`` bytes of ``f``, read in 1 MiB steps."""
    f.seek(0)
    h = hashlib.sha256()
    left = offset
    while left > 0:
        chunk = f.read(min(left, 1 << 20))
        if not chunk:
            break
        h.update(chunk)
        left -= len(chunk)
    return h


def verify_ledger(
    ledger_path: str | Path,
    receipts_dir: str | Path | None = None,
    markdown_path: str | Path | None = None,
    *,
    deep: bool = True,
    checkpoint: Checkpoint | None = None,
    incremental: bool = False,
    progress: Any = None,
    stats: VerifyStats | None = None,
) -> list[Problem]:
    """Check a ledger, streaming it line by line; return its problems in line order (empty: the
    ledger verifies).

    Per row: JSON and schema (MALFORMED), ``row_hash`` against the content (EDITED), ``seq``
    consecutive from 1 (SEQUENCE), ``prev_hash`` equal to the previous line's ``row_hash``
    (CHAIN: a row removed, inserted or reordered before it), supersede targets (SUPERSEDE). The
    rendering's head must be the last row (HEAD: e.g. the last row removed) and each page the
    rendering of its rows (MARKDOWN; ``render_page``). With ``receipts_dir``, every row's receipt
    ``.json`` (either layout, ``receipt_file``) must exist (RECEIPT-MISSING) and hash to
    ``receipt_sha256`` (RECEIPT-HASH); every receipt a sign-off relies on must exist, hash as it
    says and have a row before it (``_check_signoff``).

    ``deep`` also loads every receipt (schema, content id, arrays; RECEIPT-INVALID) and matches it
    to its row (RECEIPT-MISMATCH: a forged or altered row); that costs milliseconds a receipt. With
    a ``checkpoint`` (``Checkpoint``), rows up to it are deep-checked already: they are re-hashed,
    not re-loaded, unless the checkpoint does not match the ledger (problem CHECKPOINT, and
    every row is deep-checked). ``incremental`` checks only the rows after the checkpoint (its
    prefix is re-hashed as bytes: ``Checkpoint``) and LEDGER.md; older pages are left to a full
    run. ``progress(rows, bytes_done, bytes_total)`` is called about every 0.5 s; ``stats``
    (a ``VerifyStats``) is filled in.

    Cost: the ledger is read once (older pages are compared as the stream passes them,
    ``_PageCheck``), each row's hash is taken over its line's bytes (``_line_row_hash``) and
    each receipt's JSON is hashed on a few threads as the pass goes on (``_ReceiptHasher``), so a
    full run without ``deep`` costs about the bytes of the ledger and its receipts' JSON
    (docs/benchmarks.md, "Evidence at scale"). Without ``deep`` no array sidecar is read: an
    edited ``.npz`` is found only where ``deep`` applies (decoding one costs milliseconds).

    Raises ``InvalidInput`` when the ledger file cannot be read.
    Long because it is one streaming pass whose steps share the pass's running state (the chain, the page being checked, the checkpoint, the progress).
    """
    ledger_path = Path(ledger_path)
    md_path = Path(markdown_path) if markdown_path else default_markdown_path(ledger_path)
    st = stats if stats is not None else VerifyStats()
    st.mode = "incremental" if incremental else "deep" if deep and checkpoint is None else "full"
    t0 = time.perf_counter()
    if not ledger_path.exists():
        raise InvalidInput(f"{ledger_path}: no such ledger")
    problems: list[Problem] = []
    receipts = Path(receipts_dir) if receipts_dir is not None else None
    try:
        f = open(ledger_path, "rb")
    except OSError as e:
        raise InvalidInput(f"{ledger_path}: cannot read ledger: {e.strerror or e}") from e
    with f:
        total = f.seek(0, os.SEEK_END)
        start, line, prev, first, trusted_until = 0, 0, None, True, 0
        prefill: list[dict[str, Any]] = []
        prefix = hashlib.sha256()
        if checkpoint is not None:
            bad = _checkpoint_problem(f, total, checkpoint)
            if bad:
                problems.append(bad)
                if incremental:
                    st.seconds = time.perf_counter() - t0
                    return problems
            else:
                trusted_until = checkpoint.seq
                if incremental:
                    before = _lines_before(f, checkpoint.offset, checkpoint.seq - page_seqs(page_of(checkpoint.seq))[0] + 1)
                    prev = before[-1]
                    start, line, first, st.skipped = checkpoint.offset, checkpoint.seq, False, checkpoint.seq
                    prefill = [r for r in before if page_of(r["seq"]) == page_of(checkpoint.seq)]
        elif incremental:
            st.mode = "full"  # no checkpoint yet: everything is checked
        f.seek(start)
        seqs_max = prev["seq"] if prev else 0
        supersedes: list[tuple[int, int, int]] = []  # (seq, target, line)
        earlier: dict[str, str | None] = {}
        tail: list[dict[str, Any]] = prefill  # the rows of the newest page (the rendering's head page)
        offset, last_report = start, t0
        pages = None if incremental else _PageCheck(ledger_path, md_path)
        hasher = _ReceiptHasher(receipts, earlier, st) if receipts is not None else None  # receipts hashed in batches, on threads
        if start:
            prefix = _prefix_hasher(f, start)
            f.seek(start)
        for raw in f:
            line += 1
            offset += len(raw)
            prefix.update(raw)
            if not raw.endswith(b"\n"):
                problems.append(Problem("MALFORMED", "the file ends in a partial row (no final newline)", None, line))
                break
            try:
                row = json.loads(raw)
                err = None if isinstance(row, dict) else "not a JSON object"
            except (UnicodeDecodeError, json.JSONDecodeError) as e:
                row, err = None, f"not a JSON row: {e}"
            if err:
                m = re.search(rb'"seq":\s*(\d+)', raw)
                problems.append(Problem("MALFORMED", err, int(m.group(1)) if m else None, line))
                prev, first = None, False
                continue
            row_problems = _row_problems(row, line, prev, first, seqs_max, raw)
            problems += row_problems
            seq = row.get("seq") if isinstance(row.get("seq"), int) else None
            if seq is not None:
                seqs_max = max(seqs_max, seq)
            if row.get("kind") == "supersede" and isinstance(row.get("supersedes"), int):
                supersedes.append((seq or 0, row["supersedes"], line))
            if receipts is not None:
                row_deep = deep and (seq or 0) > trusted_until
                if not row_deep and row.get("kind") != "signoff" and isinstance(row.get("receipt_id"), str):
                    earlier.setdefault(row["receipt_id"], row.get("receipt_sha256"))  # before a later sign-off is checked
                    problems += hasher.add(row, line)
                else:
                    problems += _check_row_receipt(receipts, row, line, earlier, row_deep, st)
            if seq is not None:
                if tail and page_of(seq) != page_of(tail[-1]["seq"]):
                    if pages is not None:
                        pages.done(tail, offset - len(raw), supersedes)
                    tail = []
                if not tail and pages is not None:
                    pages.start = offset - len(raw)
                tail.append(row)
            st.rows += 1
            st.seq, st.row_hash, st.offset = seq or 0, row.get("row_hash") or "", offset
            prev, first = row, False
            if progress is not None and time.perf_counter() - last_report > 0.5:
                last_report = time.perf_counter()
                progress(st.rows, offset, total)
        if hasher is not None:
            problems += hasher.finish()
        st.prefix_sha256 = prefix.hexdigest() if st.offset == offset else ""
        problems += _check_rendering(f, ledger_path, md_path, prev, tail, supersedes, incremental, pages)
    if progress is not None:
        progress(st.rows, offset, total)
    st.seconds = time.perf_counter() - t0
    return sorted(problems, key=lambda p: (p.line or 0))


def _lines_before(f, offset: int, n: int) -> list[dict[str, Any]]:
    """The last ``n`` rows (parsed) of the lines that end at byte ``offset`` of ``f``, oldest
    first, read backwards in 64 KiB steps (fewer when the file starts sooner)."""
    pos, buf = offset, b""
    while pos > 0 and buf.count(b"\n") <= n:
        step = min(1 << 16, pos)
        pos -= step
        f.seek(pos)
        buf = f.read(step) + buf
    lines = buf.split(b"\n")[:-1]
    if pos > 0:
        lines = lines[1:]  # the first is cut
    out = []
    for raw in lines[-n:]:
        try:
            row = json.loads(raw)
        except ValueError:
            continue
        if isinstance(row, dict) and isinstance(row.get("seq"), int):
            out.append(row)
    return out


def _last_line_len(f, offset: int) -> int:
    """The length of the line that ends at byte ``offset`` of ``f`` (with its newline)."""
    back = min(offset, 1 << 16)
    f.seek(offset - back)
    buf = f.read(back)
    cut = buf.rfind(b"\n", 0, len(buf) - 1)
    return len(buf) - (cut + 1)


def _checkpoint_problem(f, total: int, cp: Checkpoint) -> Problem | None:
    """CHECKPOINT when the ledger's first ``cp.offset`` bytes do not hash to ``cp.prefix_sha256``
    or the row ending there is not ``cp.seq`` / ``cp.row_hash`` (``Checkpoint``)."""
    where = f"checkpoint seq {cp.seq} · row_hash {cp.row_hash[:12]}"
    if cp.offset <= 0 or total < cp.offset:
        return Problem("CHECKPOINT", f"the ledger is shorter than at {where} ({total} < {cp.offset} bytes): rows removed; refused")
    if _prefix_hasher(f, cp.offset).hexdigest() != cp.prefix_sha256:
        return Problem("CHECKPOINT", f"the ledger's rows up to {where} are not the bytes that were verified (edited?); refused: "
                       "run a full verification")
    n = _last_line_len(f, cp.offset)
    f.seek(cp.offset - n)
    try:
        row = json.loads(f.read(n))
    except ValueError:
        row = {}
    if not isinstance(row, dict) or row.get("seq") != cp.seq or row.get("row_hash") != cp.row_hash or row_hash(row) != cp.row_hash:
        return Problem("CHECKPOINT", f"the row at the end of the verified bytes is not {where} (checkpoint edited?); refused")
    return None


def _check_row_receipt(receipts: Path, r: dict[str, Any], line: int, earlier: dict[str, str | None], deep: bool,
                       st: VerifyStats, hashed: tuple[str, str | None] | None = None) -> list[Problem]:
    """The receipt checks of one row (``verify_ledger``): hashed always (``hashed``: what
    ``_hash_receipt`` gave, when it ran already), loaded and matched when ``deep``."""
    seq, rid = r.get("seq"), r.get("receipt_id")
    if r.get("kind") == "signoff":
        return _check_signoff(receipts, {**r, "_line": line}, earlier)
    if rid is None:
        if r.get("kind") in ("parity", "self-consistency"):
            return [Problem("RECEIPT-MISSING", "a parity row without a receipt_id", seq, line)]
        return []
    earlier.setdefault(rid, r.get("receipt_sha256"))
    path, digest = hashed or _hash_receipt(receipts, rid)
    if digest is None:
        return [Problem("RECEIPT-MISSING", f"receipt {path} does not exist (forged row?)", seq, line)]
    if digest.startswith("!"):
        return [Problem("RECEIPT-MISSING", f"{path}: cannot read: {digest[1:]}", seq, line)]
    st.receipts += 1
    if digest != r.get("receipt_sha256"):
        return [Problem("RECEIPT-HASH", f"{Path(path).name} does not hash to the row's receipt_sha256 (receipt or row altered)", seq, line)]
    if not deep:
        return []
    st.deep += 1
    try:
        receipt = load_receipt(path).receipt
    except InvalidInput as e:
        return [Problem("RECEIPT-INVALID", str(e), seq, line)]
    want = row_from_receipt(receipt)
    diff = [k for k, v in want.items() if r.get(k) != v]
    if diff:
        shown = ", ".join(f"{k}: row {r.get(k)!r} vs receipt {want[k]!r}" for k in diff)
        return [Problem("RECEIPT-MISMATCH", f"row disagrees with its receipt ({shown}): forged or altered row", seq, line)]
    return []


class _ReceiptHasher:
    """The receipt hashing of a ``verify_ledger`` pass, on a few threads while the pass goes on:
    rows are queued (``add``) and their receipts hashed in batches of ``BATCH`` (one task each:
    reads and sha256 release the GIL, so they overlap with the pass and with each other); up to
    two batches per thread are in flight before the oldest is collected and its rows checked
    (``_check_row_receipt``); ``finish`` collects the rest and stops the threads. Every queued
    row's receipt is hashed exactly once, from its own file."""

    BATCH = 128
    WORKERS = 4
    """Threads, whatever the core count: a read that misses the page cache waits on the disk, not
    the CPU, so more reads in flight than cores keep it busy."""

    def __init__(self, receipts: Path, earlier: dict[str, str | None], st: VerifyStats):
        self.receipts, self.earlier, self.st = receipts, earlier, st
        self.workers = self.WORKERS
        self.pool = ThreadPoolExecutor(max_workers=self.workers)
        self.rows: list[tuple[dict[str, Any], int]] = []
        self.inflight: deque = deque()

    def add(self, row: dict[str, Any], line: int) -> list[Problem]:
        """Queue ``row`` (at ``line``); the problems of a batch collected meanwhile."""
        self.rows.append((row, line))
        if len(self.rows) < self.BATCH:
            return []
        self._submit()
        return self._collect() if len(self.inflight) > 2 * self.workers else []

    def finish(self) -> list[Problem]:
        """Hash what is queued, collect every batch, stop the threads."""
        if self.rows:
            self._submit()
        problems = []
        while self.inflight:
            problems += self._collect()
        self.pool.shutdown()
        return problems

    def _submit(self) -> None:
        rids = [r["receipt_id"] for r, _ in self.rows]
        self.inflight.append((self.rows, self.pool.submit(lambda: [_hash_receipt(self.receipts, rid) for rid in rids])))
        self.rows = []

    def _collect(self) -> list[Problem]:
        rows, future = self.inflight.popleft()
        problems = []
        for (row, line), hashed in zip(rows, future.result()):
            problems += _check_row_receipt(self.receipts, row, line, self.earlier, False, self.st, hashed)
        return problems


_READ = threading.local()


def _sha256_of(path: str) -> str:
    """sha256 (hex) of the file at ``path``, read into this thread's 1 MiB buffer: no allocation
    a file (reading into a fresh ``bytes`` of the largest size costs a receipt more than its
    hashing). Raises ``OSError`` as ``open`` does."""
    view = getattr(_READ, "view", None)
    if view is None:
        view = _READ.view = memoryview(bytearray(1 << 20))
    h = hashlib.sha256()
    with open(path, "rb", buffering=0) as fh:
        while n := fh.readinto(view):
            h.update(view[:n])
    return h.hexdigest()


def _hash_receipt(receipts: Path, rid: Any) -> tuple[str, str | None]:
    """``(path, sha256 of its bytes)`` of receipt ``rid``'s ``.json`` in its shard, else in the
    flat layout (``receipt_file``'s order), read unbuffered into a reused buffer (``_sha256_of``)
    with no ``stat`` in the usual case; the digest is None when neither file exists and
    ``"!" + reason`` when the file cannot be read."""
    if not isinstance(rid, str) or not rid or "/" in rid or rid.startswith("."):
        return str(receipts / f"{rid}.json"), None
    base = str(receipts)
    for path in (os.path.join(base, rid[:SHARD_CHARS], rid + ".json"), os.path.join(base, rid + ".json")):
        try:
            return path, _sha256_of(path)
        except FileNotFoundError:
            continue
        except OSError as e:
            return path, "!" + str(e.strerror or e)
    return str(receipt_file(receipts, rid)), None


class _PageCheck:
    """The older pages of a rendering checked while ``verify_ledger`` streams the ledger, so a
    full verification reads the ledger once: when a page's rows are complete (``done``) it is
    rendered with the supersede rows seen so far and compared with its file; only a page that
    differs, or that a later supersede row withdraws a row of, is checked again at the end from
    its byte span (``recheck``)."""

    def __init__(self, ledger_path: Path, md_path: Path):
        self.ledger_path, self.md_path = ledger_path, md_path
        shown = rendered_head_seq(md_path)
        self.head = {"seq": shown} if shown else None
        self.older = page_of(shown) - 1 if shown else 0  # pages that are files in <stem>-pages/
        self.start = 0
        self.spans: dict[int, tuple[int, int]] = {}  # page -> byte span of its rows in the ledger
        self.used: dict[int, dict[int, int]] = {}  # page -> the supersede map it matched with
        self.twice: set[int] = set()  # pages whose rows are not in one run of lines (a broken ledger)

    def done(self, rows: list[dict[str, Any]], end: int, supersedes: list[tuple[int, int, int]]) -> None:
        """Page ``rows`` (one page's rows, complete; they end at byte ``end``) seen: compare it
        with its file under the supersede rows so far."""
        page = page_of(rows[0]["seq"])
        if page > self.older or self.head is None:
            return
        if page in self.spans:
            self.twice.add(page)
            return
        self.spans[page] = (self.start, end)
        sup = _within({t: s for s, t, _ in supersedes if s <= self.head["seq"]}, page)
        want = render_page(page, rows, sup, self.head, self.ledger_path, self.md_path)
        try:
            got = page_path(self.md_path, page).read_text(encoding="utf-8", errors="replace")
        except OSError:
            return
        if got == want:
            self.used[page] = sup

    def recheck(self, f, sup: Mapping[int, int], head: Mapping[str, Any], last_page: int) -> list[tuple[int, list[dict[str, Any]]]]:
        """``(page, rows)`` of pages 1..``last_page`` still to compare: those that did not match,
        or matched with another supersede map than ``sup`` (the final one), read again from their
        byte spans; every page, read from the start (``_pages``), when the ledger's pages are
        not in order, a page has no rows, or ``head`` is not the one the pages were checked for."""
        if (self.twice or self.head is None or head.get("seq") != self.head["seq"]
                or any(p not in self.spans for p in range(1, last_page + 1))):
            return list(_pages(f, last_page))
        out = []
        for page in range(1, last_page + 1):
            if self.used.get(page) == _within(sup, page):
                continue
            lo, hi = self.spans[page]
            f.seek(lo)
            rows = []
            for raw in f.read(hi - lo).splitlines():
                try:
                    row = json.loads(raw)
                except ValueError:
                    continue
                if isinstance(row, dict) and isinstance(row.get("seq"), int):
                    rows.append(row)
            out.append((page, rows))
        return out


def _check_rendering(f, ledger_path: Path, md_path: Path, last: dict[str, Any] | None, tail: list[dict[str, Any]],
                     supersedes: list[tuple[int, int, int]], incremental: bool, pages: _PageCheck | None = None) -> list[Problem]:
    """HEAD and MARKDOWN problems of the rendering (``verify_ledger``): LEDGER.md's head against
    the last row, LEDGER.md against ``render_page`` of the newest page's rows (``tail``), and,
    unless ``incremental``, every older page against its rows (checked as the ledger streamed
    past them, ``_PageCheck``; else the ledger ``f`` read again, one page at a time). A rendering
    that stops at an earlier head, exactly as a run killed between its append and its render
    leaves it, is not a problem: the next append re-renders."""
    if not md_path.exists():
        if last is None:
            return []
        return [Problem("HEAD", f"{md_path} is missing, so removal of the last row cannot be ruled out", last.get("seq"), None)]
    text = md_path.read_text(encoding="utf-8", errors="replace")
    m = _HEAD_RE.search(text)
    if m is None:
        if _EMPTY_HEAD in text and last is None:
            return []
        if _EMPTY_HEAD in text:
            return [Problem("MARKDOWN", f"{md_path} shows an empty ledger but the ledger has rows (not re-rendered?)")]
        return [Problem("HEAD", f"{md_path} has no head line ('Head: seq N · row_hash `…`')")]
    md_seq, md_hash = int(m.group(1)), m.group(2)
    if last is None:
        return [Problem("HEAD", f"the ledger is empty but {md_path.name} shows head seq {md_seq}: every row was removed", md_seq)]
    last_seq = last.get("seq")
    if not isinstance(last_seq, int):
        return []
    if md_seq > last_seq:
        return [Problem("HEAD", f"{md_path.name} shows head seq {md_seq} but the ledger ends at seq {last_seq}: "
                        f"{md_seq - last_seq} row(s) removed from the end", md_seq)]
    if md_seq == last_seq and md_hash != last.get("row_hash"):
        return [Problem("HEAD", f"{md_path.name} head row_hash differs from the ledger's last row: the last row was replaced", md_seq)]
    upto = md_seq  # the rendering stands for the rows up to its head
    sup = {t: s for s, t, _ in supersedes if s <= upto}
    if md_seq != last_seq:
        rows = [r for r in _rows_of_page(f, page_of(md_seq), tail, md_seq) if r.get("seq", 0) <= md_seq]
        head = next((r for r in rows if r.get("seq") == md_seq), None)
        if head is None or head.get("row_hash") != md_hash or text != render_page(page_of(md_seq), rows, _within(sup, page_of(md_seq)), head, ledger_path, md_path):
            return [Problem("MARKDOWN", f"{md_path.name} shows head seq {md_seq} but the ledger ends at seq {last_seq} (not re-rendered?)", last_seq)]
    elif text != render_page(page_of(last_seq), tail, _within(sup, page_of(last_seq)), last, ledger_path, md_path):
        return [Problem("MARKDOWN", f"{md_path.name} is not the rendering of the ledger's newest rows (edited by hand?)")]
    if incremental:
        return []
    head = last if md_seq == last_seq else {"seq": md_seq, "row_hash": md_hash}
    problems = []
    todo = pages.recheck(f, sup, head, page_of(md_seq) - 1) if pages is not None else _pages(f, page_of(md_seq) - 1)
    for page, rows in todo:
        path = page_path(md_path, page)
        want = render_page(page, rows, _within(sup, page), head, ledger_path, md_path)
        try:
            got = path.read_text(encoding="utf-8", errors="replace")
        except OSError:
            problems.append(Problem("MARKDOWN", f"{path} (rows {page_seqs(page)[0]}–{page_seqs(page)[1]}) is missing"))
            continue
        if got != want:
            problems.append(Problem("MARKDOWN", f"{path.name} is not the rendering of rows {page_seqs(page)[0]}–{page_seqs(page)[1]} (edited by hand?)"))
    return problems


def _within(superseded: Mapping[int, int], page: int) -> dict[int, int]:
    lo, hi = page_seqs(page)
    return {t: s for t, s in superseded.items() if isinstance(t, int) and lo <= t <= hi}


def _rows_of_page(f, page: int, tail: list[dict[str, Any]], upto: int) -> list[dict[str, Any]]:
    """The rows of ``page`` (from ``tail`` when it is that page, else read from ``f``)."""
    if tail and page_of(tail[0]["seq"]) == page:
        return tail
    return next((rows for p, rows in _pages(f, page) if p == page), [])


def _pages(f, last_page: int):
    """``(page, rows)`` for pages 1..``last_page`` of the ledger file ``f``, reading it once
    from the start (lines that are not rows are passed over: they are reported already)."""
    if last_page < 1:
        return
    f.seek(0)
    page, rows = 1, []
    for raw in f:
        try:
            row = json.loads(raw)
        except ValueError:
            continue
        if not isinstance(row, dict) or not isinstance(row.get("seq"), int):
            continue
        p = page_of(row["seq"])
        if p != page:
            yield page, rows
            if page >= last_page:
                return
            page, rows = p, []
        rows.append(row)
    if page <= last_page:
        yield page, rows


def _check_signoff(receipts_dir: Path, row: dict[str, Any], earlier: Mapping[str, str | None]) -> list[Problem]:
    """A sign-off row's receipts: each must exist (RECEIPT-MISSING), hash to the sha256 it names
    (RECEIPT-HASH) and have a row earlier in the chain with that id and hash (SIGNOFF-ORDER);
    ``earlier`` maps the receipt ids of the rows before it to their ``receipt_sha256``."""
    problems = []
    seq, line = row.get("seq"), row.get("_line")
    for ref in row.get("relied_on") or []:
        rid, sha = ref.get("id"), ref.get("sha256")
        path = receipt_file(receipts_dir, rid) if isinstance(rid, str) else receipts_dir / f"{rid}.json"
        if not path.exists():
            problems.append(Problem("RECEIPT-MISSING", f"sign-off relies on receipt {path}, which does not exist", seq, line))
        elif sha256_file(path) != sha:
            problems.append(Problem("RECEIPT-HASH", f"sign-off relies on {path.name}, which does not hash to the sha256 it names", seq, line))
        if rid not in earlier:
            problems.append(Problem("SIGNOFF-ORDER", f"sign-off relies on receipt {str(rid)[:12]}, which has no row before it in the chain", seq, line))
        elif earlier[rid] != sha:
            problems.append(Problem("SIGNOFF-ORDER", f"sign-off names receipt {str(rid)[:12]} with a sha256 other than its row's", seq, line))
    return problems


# ----------------------------------------------------------------------------- summaries


def ledger_frame(ledger_path: str | Path) -> pd.DataFrame:
    """All rows as a DataFrame (one row per ledger row, columns ``ROW_FIELDS`` + optional ones),
    with ``time`` parsed to UTC timestamps and ``superseded_by`` (seq or NA). Read from the query
    cache (``LedgerCache``: columns through ``pandas.read_sql_query``) after the cache is compared
    with the ledger and rebuilt where it disagrees (``LedgerCache.open(check=True)``;
    ``df.attrs["cache_rebuilt"]`` says why, else None), so the verdicts shown are the ledger's.
    Raises ``InvalidInput`` naming a line that is not a row."""
    cols = list(CACHE_COLUMNS)
    with LedgerCache.open(ledger_path, CACHE_COLUMNS, check=True) as cache:
        if cache.bad_line is not None:
            read_rows(ledger_path)  # names the bad line (InvalidInput)
        df = pd.read_sql_query(cache.frame_query(cols), cache.con)
        by = cache.superseded()
        df.attrs["cache_rebuilt"] = cache.rebuilt
    for c in ("builds", "cells", "relied_on", "blocked"):  # JSON text in the cache
        df[c] = df[c].map(lambda v: json.loads(v) if isinstance(v, str) else v)
    df["time"] = pd.to_datetime(df["time"], utc=True)
    df["superseded_by"] = pd.array([by.get(s) for s in df["seq"]], dtype="Int64")
    return df


def _effective(df: pd.DataFrame) -> pd.DataFrame:
    """Measurement rows that stand: no supersede or sign-off rows, nothing superseded."""
    return df[~df["kind"].isin(["supersede", "signoff"]) & df["superseded_by"].isna()]


def summarize_ledger(ledger_path: str | Path) -> pd.DataFrame:
    """The ``harness ledger show`` table: one line per (model, quant, candidate, reference, kind)
    over rows that stand (no supersede rows, nothing superseded), with run counts by verdict,
    the latest run (seq, ISO time, verdict), the worst and latest min cosine, mean argmax
    agreement and mean KLD, and the candidate's speed across the rows (``_speed_summary``). Raises ``InvalidInput`` on a malformed ledger line."""
    eff = _effective(ledger_frame(ledger_path))
    keys = ["model", "quant", "candidate", "reference", "kind"]
    cols = keys + ["runs", "pass", "fail", "other", "last_seq", "last_time", "last_verdict", "min_cosine_last",
                   "min_cosine_worst", "argmax_agreement_mean", "kld_mean_mean", "basis_kind_last",
                   "candidate_tokens_per_s_last", "candidate_tokens_per_s_median", "candidate_speed_vs_median",
                   "candidate_wall_s_last"]
    if eff.empty:
        return pd.DataFrame(columns=cols)
    out = []
    for key, g in eff.sort_values("seq").groupby(keys, dropna=False, sort=True):
        last = g.iloc[-1]
        out.append(
            dict(
                zip(keys, key),
                runs=len(g),
                **{"pass": int((g["verdict"] == "PASS").sum()), "fail": int((g["verdict"] == "FAIL").sum())},
                other=int((~g["verdict"].isin(["PASS", "FAIL"])).sum()),
                last_seq=int(last["seq"]),
                last_time=last["time"].isoformat() if pd.notna(last["time"]) else None,
                last_verdict=last["verdict"],
                min_cosine_last=last["min_cosine"],
                min_cosine_worst=pd.to_numeric(g["min_cosine"]).min(),
                argmax_agreement_mean=pd.to_numeric(g["argmax_agreement"]).mean(),
                kld_mean_mean=pd.to_numeric(g["kld_mean"]).mean(),
                basis_kind_last=last["basis_kind"],
                **_speed_summary(g),
            )
        )
    return pd.DataFrame(out, columns=cols)


def _speed_summary(g: pd.DataFrame) -> dict[str, Any]:
    """The candidate's speed across one group's rows (oldest first): the last prefill tokens/s,
    the median over the rows that recorded one, the last as a fraction of that median (below 1:
    slower than usual) and the last wall seconds; None where no row recorded timings."""
    tps = pd.to_numeric(g["candidate_tokens_per_s"], errors="coerce")
    last = g.iloc[-1]
    last_tps = pd.to_numeric(pd.Series([last["candidate_tokens_per_s"]]), errors="coerce").iloc[0]
    med = tps.median() if tps.notna().any() else None
    return {
        "candidate_tokens_per_s_last": None if pd.isna(last_tps) else float(last_tps),
        "candidate_tokens_per_s_median": None if med is None or pd.isna(med) else float(med),
        "candidate_speed_vs_median": None if med is None or pd.isna(last_tps) or not med else float(last_tps / med),
        "candidate_wall_s_last": None if pd.isna(pd.to_numeric(pd.Series([last["candidate_wall_s"]]), errors="coerce").iloc[0]) else float(last["candidate_wall_s"]),
    }


_REPORT_ONLY = {
    # field: (direction, how to read the proposal)
    "argmax_agreement": ("at least", "the lowest argmax agreement among known-good runs"),
    "kld_mean": ("at most", "the highest mean KLD among known-good runs"),
    "hard_flip_rate": ("at most", "the highest hard-flip rate (hard flips / positions) among known-good runs"),
}


def proposed_report_only_thresholds(df: pd.DataFrame, min_records: int = REPORT_ONLY_MIN_RECORDS) -> dict[str, dict[str, Any] | None]:
    """Proposals for the report-only fields (never applied; a reviewer copies one into
    thresholds.yaml with a measured basis if they accept it).

    ``df`` is ``ledger_frame(...)``. Records are the standing PASS rows of kind ``parity``
    holding the field. A field gets None until it has ``min_records`` (20) records; then
    ``{value, direction, n, seqs, quantiles, basis}`` where ``value`` is the worst known-good
    value (a floor for agreement, a ceiling for KLD and hard flips) and ``basis`` says how it
    was measured.
    """
    good = _effective(df)
    good = good[(good["kind"] == "parity") & (good["verdict"] == "PASS")].copy()
    good["hard_flip_rate"] = pd.to_numeric(good["hard_flips"]) / pd.to_numeric(good["positions"]).where(lambda s: s > 0)
    out: dict[str, dict[str, Any] | None] = {}
    for field, (direction, what) in _REPORT_ONLY.items():
        vals = pd.to_numeric(good[field], errors="coerce")
        ok = vals.notna()
        n = int(ok.sum())
        if n < min_records:
            out[field] = None
            continue
        v = vals[ok].to_numpy(dtype=np.float64)
        seqs = good.loc[ok, "seq"].astype(int).tolist()
        value = float(v.min() if direction == "at least" else v.max())
        q = {f"p{p}": float(np.quantile(v, p / 100)) for p in (5, 50, 95)}
        out[field] = {
            "value": value,
            "direction": direction,
            "n": n,
            "seqs": [min(seqs), max(seqs)],
            "quantiles": q,
            "basis": (
                f"proposed from the ledger: {what} over {n} standing PASS parity rows (seq {min(seqs)}–{max(seqs)}; "
                f"p5 {q['p5']:.6g}, median {q['p50']:.6g}, p95 {q['p95']:.6g}); no known-bad values yet. "
                "Not applied: report-only fields gate only once a reviewer adds them to thresholds.yaml with a measured basis."
            ),
        }
    return out


# ----------------------------------------------------------------------------- ledger show


def engine_name(label: Any) -> str | None:
    """The engine name of a row's ``candidate``/``reference`` label (``"NAME VERSION"``)."""
    if label is None or (isinstance(label, float) and np.isnan(label)):
        return None
    return str(label).split(" ", 1)[0]


def filter_frame(
    df: pd.DataFrame,
    *,
    candidate: str | None = None,
    model: str | None = None,
    kind: str | None = None,
    since: str | None = None,
    verdict: str | None = None,
) -> pd.DataFrame:
    """Rows of ``ledger_frame`` matching every filter given: ``candidate`` and ``model`` are
    substrings of the row's label (``"mutant:"`` selects every mutant), ``kind`` and ``verdict``
    exact (verdict case-insensitive), ``since`` an ISO date or time (UTC unless it names a zone)
    the row's time is at or after. Raises ``InvalidInput`` for a ``since`` that is not a date."""
    out = df
    if candidate:
        out = out[out["candidate"].fillna("").str.contains(candidate, regex=False)]
    if model:
        out = out[(out["model"].fillna("") + " " + out["quant"].fillna("")).str.contains(model, regex=False)]
    if kind:
        out = out[out["kind"] == kind]
    if verdict:
        out = out[out["verdict"].fillna("").str.upper() == verdict.upper()]
    if since:
        try:
            t = pd.Timestamp(since)
        except (ValueError, TypeError):
            raise InvalidInput(f"--since {since!r}: not a date (YYYY-MM-DD or an ISO 8601 time)") from None
        t = t.tz_localize("UTC") if t.tzinfo is None else t.tz_convert("UTC")
        out = out[out["time"] >= t]
    return out


def candidate_trends(df: pd.DataFrame) -> pd.DataFrame:
    """Trends per candidate: one line per (candidate engine name, model, quant, kind) over the
    standing measurement rows of ``df`` (``ledger_frame``, filtered or not), newest group first.

    Columns: ``candidate``, ``model``, ``quant``, ``kind``, ``runs``, ``pass``, ``fail``,
    ``other`` (UNMEASURED and the rest), ``last_seq``, ``last_time`` (ISO), ``last_verdict``,
    ``last_min_cosine``, ``worst_min_cosine`` (lowest over the runs), ``last_kld_mean``,
    ``worst_kld_mean`` (highest), ``versions`` (distinct candidate labels) and the candidate's
    speed (``_speed_summary``: last and median prefill tokens/s, last / median, last wall s).
    """
    eff = _effective(df).copy()
    cols = ["candidate", "model", "quant", "kind", "runs", "pass", "fail", "other", "last_seq", "last_time", "last_verdict",
            "last_min_cosine", "worst_min_cosine", "last_kld_mean", "worst_kld_mean", "versions", "candidate_tokens_per_s_last",
            "candidate_tokens_per_s_median", "candidate_speed_vs_median", "candidate_wall_s_last"]
    if eff.empty:
        return pd.DataFrame(columns=cols)
    eff["engine"] = eff["candidate"].map(engine_name)
    out = []
    for (eng, model, quant, kind), g in eff.sort_values("seq").groupby(["engine", "model", "quant", "kind"], dropna=False, sort=False):
        last = g.iloc[-1]
        cos, kld = pd.to_numeric(g["min_cosine"]), pd.to_numeric(g["kld_mean"])
        out.append({
            "candidate": eng, "model": model, "quant": quant, "kind": kind, "runs": len(g),
            "pass": int((g["verdict"] == "PASS").sum()), "fail": int((g["verdict"] == "FAIL").sum()),
            "other": int((~g["verdict"].isin(["PASS", "FAIL"])).sum()), "last_seq": int(last["seq"]),
            "last_time": last["time"].isoformat() if pd.notna(last["time"]) else None, "last_verdict": last["verdict"],
            "last_min_cosine": _num(last["min_cosine"]), "worst_min_cosine": _num(cos.min()),
            "last_kld_mean": _num(last["kld_mean"]), "worst_kld_mean": _num(kld.max()),
            "versions": sorted({str(c) for c in g["candidate"].dropna()}),
            **_speed_summary(g),
        })
    return pd.DataFrame(out, columns=cols).sort_values("last_seq", ascending=False, ignore_index=True)


def _num(v: Any) -> float | None:
    """A float, or None for null/NaN (JSON and CSV get no NaN)."""
    try:
        f = float(v)
    except (TypeError, ValueError):
        return None
    return None if np.isnan(f) else f
