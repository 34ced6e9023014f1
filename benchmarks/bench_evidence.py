#!/usr/bin/env python3
"""Evidence at scale: the cost of the evidence step, of verify and of the views against ledger size.

    .venv/bin/python benchmarks/bench_evidence.py [--sizes 10,10000,100000] [--out FILE.json]

For each size a ledger is grown (``_grow_ledger.grow``) with thin receipts: every row's receipt
is a copy of one parity receipt (``fixture:tiny-qwen35``-sized when ``--receipt`` names one, else
the 64-position receipt of tests/test_receipts.py) made distinct by its host name, all sharing
one hard-linked array sidecar. Then, at that size, side by side:

- the evidence step of one parity run (``record_evidence``: receipt, row, LEDGER.md page, index
  page), median of 5, and its ratio to the smallest size (target ≤ 1.2);
- ``verify_ledger`` full (every row and receipt re-hashed; rows behind the checkpoint not
  re-loaded) in rows/s (target ≥ 5,000) and incremental after one append in s (target < 1);
- ``ledger show`` (``LedgerView.load`` + trends) in s (target ≤ 5);
- bytes per cell: receipt JSON, its sidecar (deflated), and the report folder when one is written.

Prints one JSON document (and writes it to ``--out``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests"))

from _grow_ledger import grow  # noqa: E402

from harness.evidence import ledger as L  # noqa: E402
from harness.evidence.ledger_view import LedgerView  # noqa: E402
from harness.evidence.receipts import write_receipt  # noqa: E402
from harness.evidence.record import record_evidence  # noqa: E402


def _template(receipt_path: str | None, work: Path):
    if receipt_path:
        from harness.evidence.receipts import load_receipt
        rec, arrays = load_receipt(receipt_path)[:2]
    else:
        from test_receipts import make_receipt
        rec, arrays = make_receipt(seed=99)
    jp, npz = write_receipt(rec, arrays, work / "template")
    return json.loads(jp.read_text()), npz, rec, arrays


def measure(size: int, template, npz, rec, arrays, work: Path) -> dict:
    d = work / f"n{size}"
    lp = d / "evidence" / "parity" / "ledger.jsonl"
    t0 = time.perf_counter()
    grow(lp, size, template, npz)
    out = {"rows": size, "grow_s": time.perf_counter() - t0}
    steps = []
    for i in range(5):
        r = dict(rec, host={**rec["host"], "hostname": f"bench-{i}"})
        t = time.perf_counter()
        record_evidence(r, arrays, lp)
        steps.append(time.perf_counter() - t)
    out["evidence_step_s"] = statistics.median(steps)
    st = L.VerifyStats()
    L.verify_ledger(lp, lp.parent / "receipts", deep=False, stats=st)
    out["verify_full_rows_per_s"] = st.rows_per_s
    cp = L.Checkpoint(str(lp), st.seq, st.row_hash, st.offset, st.prefix_sha256)
    record_evidence(dict(rec, host={**rec["host"], "hostname": "bench-last"}), arrays, lp)
    t = time.perf_counter()
    problems = L.verify_ledger(lp, lp.parent / "receipts", checkpoint=cp, incremental=True)
    out["verify_incremental_s"] = time.perf_counter() - t
    out["verify_incremental_ok"] = problems == []
    t = time.perf_counter()
    view = LedgerView.load(lp)
    out["show_s"] = time.perf_counter() - t
    out["show_groups"] = len(view.trends)
    newest = L.read_rows(lp)[-1]["receipt_id"] if size <= 10 else None
    if newest:
        from harness.evidence.receipts import receipt_file
        jp = receipt_file(lp.parent / "receipts", newest)
        out["bytes_json"], out["bytes_npz"] = jp.stat().st_size, jp.with_suffix(".npz").stat().st_size
    du = sum(p.stat().st_size for p in (lp.parent / "receipts").rglob("*") if p.is_file())
    out["receipts_bytes_apparent"] = du
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="10,10000,100000")
    ap.add_argument("--receipt", default=None, help="a receipt .json to copy (default: a 64-position test receipt)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        template, npz, rec, arrays = _template(a.receipt, work)
        res = [measure(int(n), template, npz, rec, arrays, work) for n in a.sizes.split(",")]
    base = res[0]["evidence_step_s"]
    for r in res:
        r["evidence_step_ratio"] = r["evidence_step_s"] / base
    doc = {"load_avg": os.getloadavg(), "cpus": os.cpu_count(), "results": res}
    text = json.dumps(doc, indent=1)
    print(text)
    if a.out:
        Path(a.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
