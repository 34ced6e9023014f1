"""Grow a ledger fast, for the evidence-at-scale bench and the scale tests.

``grow(ledger_path, n, template, arrays_path)`` appends ``n`` chained parity rows, each with its
own *thin* receipt: the JSON of ``template`` (a receipt as ``write_receipt`` wrote it) made
distinct by ``host.hostname`` (``ci-<seq>``), with its content id recomputed, written as its own
file in its shard; its array sidecar is a hard link to ``arrays_path`` (one shared array file:
every copy holds the same arrays, so ``arrays.sha256`` still matches and ``--deep`` passes). So
the receipts are full JSON receipts, but their arrays take the disk space of one.

Rows and receipts are byte for byte what ``record_evidence`` would write for those receipts
(``harness ledger verify --deep`` passes on them); only the per-row locking, rendering and fsync
are skipped, and the JSON is produced by substituting the host name (and the id) into the
template's two serializations instead of serializing each copy, so 100,000 rows take about a
minute, not hours. The renderings (LEDGER.md pages, the reports index) are written once at the
end; the index's receipt summaries are seeded into the query cache (every copy has the
template's candidate), so the first index refresh reads no receipt.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any

from harness.evidence import ledger as L
from harness.evidence.receipts import HASH_EXCLUDED, shard_dir

_HOST = "GROW-HOST-0000000000000000"
_ID = "f" * 64


def _canonical(obj: Any) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode("utf-8")


def _pretty(obj: Any) -> bytes:
    """The serialization ``write_receipt`` writes."""
    return (json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False, allow_nan=False) + "\n").encode("utf-8")


def grow(ledger_path: str | Path, n: int, template: dict[str, Any], arrays_path: str | Path, *, render: bool = True) -> int:
    """Append ``n`` rows (module docstring) to ``ledger_path``; return the last seq. ``render``:
    write every LEDGER.md page and the reports index at the end."""
    ledger_path = Path(ledger_path)
    receipts = ledger_path.parent / "receipts"
    head = L.check_ledger_head(ledger_path)
    seq, prev = (head["seq"], head["row_hash"]) if head else (0, L.GENESIS)
    t = json.loads(json.dumps(template))
    t["host"]["hostname"] = _HOST
    t["id"] = _ID
    content = _canonical({k: v for k, v in t.items() if k not in HASH_EXCLUDED})
    pretty = _pretty(t)
    host_q, id_q = json.dumps(_HOST).encode(), json.dumps(_ID).encode()
    assert content.count(host_q) == 1 and pretty.count(host_q) == 1 and pretty.count(id_q) == 1, "template holds the placeholders"
    base = L._complete(L.row_from_receipt(t))
    created = t["created"]
    ledger_path.parent.mkdir(parents=True, exist_ok=True)
    made: set[Path] = set()
    source = Path(arrays_path)
    with open(ledger_path, "ab") as out:
        lines = []
        for _ in range(n):
            seq += 1
            host = json.dumps(f"ci-{seq}").encode()
            rid = hashlib.sha256(content.replace(host_q, host)).hexdigest()
            data = pretty.replace(host_q, host).replace(id_q, json.dumps(rid).encode())
            d = shard_dir(receipts, rid)
            if d not in made:
                d.mkdir(parents=True, exist_ok=True)
                made.add(d)
            with open(d / f"{rid}.json", "wb") as f:
                f.write(data)
            npz = d / f"{rid}.npz"
            if not npz.exists():
                try:
                    os.link(source, npz)
                except OSError as e:  # a file system's link limit (ext4: 65,000): copy once, link to the copy
                    if e.errno != errno.EMLINK:
                        raise
                    shutil.copyfile(source, npz)
                    source = npz
            row = dict(base, receipt_id=rid, seq=seq, time=created, prev_hash=prev, receipt_sha256=hashlib.sha256(data).hexdigest(),
                       row_hash=L.GENESIS)
            row["row_hash"] = prev = L.row_hash(row)
            lines.append(_canonical(row) + b"\n")
            if len(lines) >= 4096:
                out.write(b"".join(lines))
                lines.clear()
        out.write(b"".join(lines))
    if render:
        from harness.evidence.index import refresh_index
        from harness.evidence.ledger_cache import LedgerCache

        cand = template.get("engines", {}).get("candidate", {})
        summary = (cand.get("name"), (cand.get("build") or {}).get("bug_class"))
        with LedgerCache.open(ledger_path, L.CACHE_COLUMNS) as cache:
            ids = [r for (r,) in cache.con.execute("SELECT receipt_id FROM rows WHERE seq > ? AND receipt_id IS NOT NULL",
                                                    (seq - n,))]
            cache.con.execute("BEGIN")
            cache.add_summaries(dict.fromkeys(ids, summary))
            cache.con.execute("COMMIT")
            L.render_pages(ledger_path, L.default_markdown_path(ledger_path), full=True, cache=cache)
        refresh_index(ledger_path, full=True)
    return seq
