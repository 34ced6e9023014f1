"""``harness ledger merge DIR...``: bring receipts made on other hosts into this ledger.

Each DIR is another host's evidence folder (``DIR/parity/ledger.jsonl`` with ``receipts/`` beside
it), or a ledger's folder (``DIR/ledger.jsonl``), or a ledger file. Merging is all or nothing:

1. every source ledger is verified (``verify_ledger``: chain, and every receipt a row names
   hashed, loaded and checked by ``load_receipt`` (schema, content id, arrays) and matched to its
   row; the rendering is checked when it travelled with the folder); a ledger or receipt that
   fails is refused, naming its path, and nothing is written;
2. receipts are deduplicated by id: a receipt id already in this ledger, or already in this
   receipts folder, or in two sources, must be byte for byte the same file, else the merge is
   refused naming both paths;
3. the new ones are copied (sidecar first, never replacing a file) and their rows appended in a
   deterministic order: by the source row's time, then receipt id, whatever the order of the
   folders on the command line, each through the evidence door (``record.record_row``). Each row
   is re-derived from its receipt (``row_from_receipt``)
   and keeps the source row's time and timings.

Merging the same folders again adds nothing. Supersede and sign-off rows are not carried over:
a supersede row names a seq of its own ledger, and a sign-off is a statement about the ledger it
was made in (sign off again after merging).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from harness.errors import InvalidInput
from harness.evidence.pages import default_markdown_path
from harness.evidence.rows import TIMING_FIELDS, read_rows, row_from_receipt
from harness.evidence.verify import verify_ledger
from harness.evidence.receipts import load_receipt, receipt_file, shard_dir, write_new
from harness.evidence.record import preflight_evidence, record_row

RECEIPT_KINDS = ("parity", "self-consistency", "probe", "calibration", "tokenizer", "chat-parsers")


@dataclass
class MergeResult:
    """What a merge did: the rows appended (in order), how many receipts were already here, and the
    source ledgers read."""

    appended: list[dict[str, Any]] = field(default_factory=list)
    already: int = 0
    sources: list[Path] = field(default_factory=list)


def source_ledger(folder: str | Path) -> Path:
    """The ledger a merge source names (module docstring). Raises ``InvalidInput`` when there is none."""
    p = Path(folder)
    for cand in (p / "parity" / "ledger.jsonl", p / "ledger.jsonl"):
        if cand.is_file():
            return cand
    if p.is_file() and p.suffix == ".jsonl":
        return p
    raise InvalidInput(f"{p}: no ledger to merge (looked for {p / 'parity' / 'ledger.jsonl'} and {p / 'ledger.jsonl'})")


def _checked_source(ledger: Path) -> list[tuple[dict[str, Any], Path]]:
    """The receipt rows of a verified source ledger with their receipt paths (module docstring, 1)."""
    receipts = ledger.parent / "receipts"
    md = default_markdown_path(ledger)
    problems = [p for p in verify_ledger(ledger, receipts, md) if md.exists() or p.code not in ("HEAD", "MARKDOWN")]
    if problems:
        raise InvalidInput(f"{ledger}: refused, the ledger does not verify ({len(problems)} problem(s); first: {problems[0]}); "
                           f"run harness ledger verify --ledger {ledger}")
    out = []
    for row in read_rows(ledger):
        if row.get("kind") not in RECEIPT_KINDS or not row.get("receipt_id"):
            continue
        out.append((row, receipt_file(receipts, row["receipt_id"])))  # verify_ledger has hashed and loaded it
    return out


def merge_ledgers(target: str | Path | None, folders: list[str | Path]) -> MergeResult:
    """Merge the ledgers of ``folders`` into ``target`` (None: the project's ledger), as the module
    docstring says. Raises ``InvalidInput`` (nothing written) for a source that does not verify,
    a receipt id that names different bytes in two places, or a target that cannot be written."""
    paths = preflight_evidence(target)
    result = MergeResult()
    here_rows = {r["receipt_id"]: r for r in read_rows(paths.ledger) if r.get("receipt_id")}
    incoming: dict[str, tuple[dict[str, Any], Path]] = {}
    for folder in folders:
        ledger = source_ledger(folder)
        if ledger.resolve() == paths.ledger.resolve():
            raise InvalidInput(f"{ledger}: is the ledger being merged into")
        result.sources.append(ledger)
        for row, path in _checked_source(ledger):
            rid = row["receipt_id"]
            if rid in incoming and incoming[rid][1].read_bytes() != path.read_bytes():
                raise InvalidInput(f"{path}: refused, receipt {rid[:12]} differs from {incoming[rid][1]} byte for byte")
            incoming.setdefault(rid, (row, path))
    new = []
    for rid, (row, path) in incoming.items():
        mine = receipt_file(paths.receipts, rid)
        if mine.exists() and mine.read_bytes() != path.read_bytes():
            raise InvalidInput(f"{path}: refused, receipt {rid[:12]} exists here ({mine}) with other bytes")
        if rid in here_rows:
            result.already += 1
            continue
        new.append((row, path))
    new.sort(key=lambda rp: (str(rp[0].get("time")), rp[0]["receipt_id"]))
    paths.receipts.mkdir(parents=True, exist_ok=True)
    for row, path in new:
        dest = shard_dir(paths.receipts, row["receipt_id"])
        dest.mkdir(parents=True, exist_ok=True)
        for src in (path.with_suffix(".npz"), path):  # the sidecar first: a visible receipt always has its arrays
            if src.exists():
                data = src.read_bytes()
                write_new(dest, src.name, lambda f, data=data: f.write(data))
        receipt = load_receipt(dest / path.name).receipt
        fields = {**row_from_receipt(receipt), "time": row.get("time"), **{k: row[k] for k in TIMING_FIELDS if k in row}}
        result.appended.append(record_row(paths.ledger, fields, dest / path.name, paths.markdown))
    return result
