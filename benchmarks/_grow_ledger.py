"""Grow a ledger fast, for the evidence-at-scale bench and the scale tests.

``grow(ledger_path, n, template, arrays_path)`` appends ``n`` chained parity rows, each with its
own receipt: a copy of ``template`` (a receipt as ``write_receipt`` wrote it) made distinct by
``host.hostname`` (``ci-<i>``), with its content id recomputed and its sidecar a hard link to
``arrays_path`` (one shared array file: every copy holds the same arrays, so ``arrays.sha256``
still matches). Rows and receipts are exactly what ``record_evidence`` writes (``harness ledger
verify --deep`` passes on them); only the per-row locking, rendering and fsync are skipped, so
100,000 rows take minutes, not hours. The rendering is written once at the end.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
from pathlib import Path
from typing import Any

from harness.evidence import ledger as L
from harness.evidence.receipts import HASH_EXCLUDED, shard_dir


def _canonical(obj: Any) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode("utf-8")


def grow(ledger_path: str | Path, n: int, template: dict[str, Any], arrays_path: str | Path, *, render: bool = True) -> int:
    """Append ``n`` rows (module docstring) to ``ledger_path``; return the last seq."""
    ledger_path = Path(ledger_path)
    receipts = ledger_path.parent / "receipts"
    head = L.check_ledger_head(ledger_path)
    seq, prev = (head["seq"], head["row_hash"]) if head else (0, L.GENESIS)
    ledger_path.parent.mkdir(parents=True, exist_ok=True)
    with open(ledger_path, "ab") as out:
        for i in range(n):
            rec = copy.deepcopy(template)
            rec["host"]["hostname"] = f"ci-{seq + 1}-{i}"
            rec["id"] = hashlib.sha256(_canonical({k: v for k, v in rec.items() if k not in HASH_EXCLUDED})).hexdigest()
            d = shard_dir(receipts, rec["id"])
            d.mkdir(parents=True, exist_ok=True)
            jp = d / f"{rec['id']}.json"
            data = (json.dumps(rec, indent=2, sort_keys=True, ensure_ascii=False, allow_nan=False) + "\n").encode("utf-8")
            jp.write_bytes(data)
            if not (d / f"{rec['id']}.npz").exists():
                os.link(arrays_path, d / f"{rec['id']}.npz")
            row = L._complete(L.row_from_receipt(rec))
            seq += 1
            row.update(seq=seq, time=rec["created"], prev_hash=prev, receipt_sha256=hashlib.sha256(data).hexdigest(), row_hash=L.GENESIS)
            row["row_hash"] = L.row_hash(row)
            prev = row["row_hash"]
            out.write(_canonical(row) + b"\n")
    if render:
        L.render_pages(ledger_path, L.default_markdown_path(ledger_path), full=True)
    return seq
