#!/usr/bin/env python3
"""Evidence at scale: the cost of the evidence step, of verify and of the views against ledger size.

    .venv/bin/python benchmarks/bench_evidence.py [--sizes 10,10000,100000] [--receipt R.json] [--out FILE.json]
    make bench-evidence      # the same section through run_all.py, written into docs/benchmarks.md

For each size a ledger is grown (``_grow_ledger.grow``) with *thin* receipts: every row's receipt
is its own JSON file, a copy of one parity receipt (default: the committed parity receipt with
the most positions, the 1,479-position cell of evidence/parity/receipts; else the 64-position
receipt of tests/test_receipts.py) made distinct by its host name, and all of them share one
hard-linked array sidecar. Then, at that size, side by side:

- the evidence step of one parity run (``record_evidence``: receipt, row, LEDGER.md page, index
  page; the verdict page is a per-receipt constant and not included), median of 7, and its ratio
  to the smallest size (target ≤ 1.2). Every ledger is grown (and flushed to disk, ``os.sync``)
  first; then the steps are taken in turns, one at each size per round, so the machine's load
  falls on every size alike;
- ``harness ledger verify`` full mode as the command runs it (every row and every receipt's JSON
  file re-hashed, every page compared; no receipt parsed, no array sidecar read, so the shared
  sidecar does not flatter it) in rows/s, wall and per CPU second (target ≥ 5,000 rows/s), then
  ``--incremental`` after one append (target < 1 s); on ledgers of at most 1,000 rows also
  ``--deep`` (every receipt loaded: JSON parsed and checked, arrays decoded and hashed), in
  milliseconds a receipt;
- ``harness ledger show`` (target ≤ 5 s);
- a sign-off's lookup of the standing receipts (``signoff.ledger_receipts``): first on a cache
  that has not seen them (each receipt read once for its keys, as on a fresh clone), then again;
- the verify and show operations are timed in this process, and each command once more in a
  fresh process (``*_cli_s``), beside the start of a bare ``harness --help``
  (``cli_start_s``: interpreter start and imports, which every command pays);
- the query cache rebuilt from the ledger (what the first command on a fresh clone pays: the cache
  is git-ignored), at the end;
- bytes per cell: the newest receipt's JSON and its deflated sidecar, and the disk the receipts
  take.

Returns (and prints) one JSON document.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(REPO / "tests"))

from _grow_ledger import grow  # noqa: E402

from harness.evidence import ledger as L  # noqa: E402
from rich.console import Console  # noqa: E402

from harness.evidence.ledger_cache import LedgerCache, cache_path  # noqa: E402
from harness.evidence.ledger_view import LedgerView  # noqa: E402
from harness.evidence.receipts import iter_receipt_files, load_receipt, receipt_file, write_receipt  # noqa: E402
from harness.evidence.record import evidence_paths, record_evidence  # noqa: E402
from harness.release.signoff import ledger_receipts  # noqa: E402

HARNESS = str(Path(sys.executable).with_name("harness"))


def default_receipt() -> Path | None:
    """The committed parity receipt with the most positions, or None."""
    best = None
    for p in iter_receipt_files(REPO / "evidence" / "parity" / "receipts"):
        try:
            rec = json.loads(p.read_text())
        except (OSError, ValueError):
            continue
        n = (rec.get("gated") or {}).get("positions") if rec.get("schema") == "harness-parity-receipt/v1" else None
        if n and (best is None or n > best[0]):
            best = (n, p)
    return best[1] if best else None


def template(receipt_path: str | Path | None, work: Path):
    """``(template receipt as written, its sidecar, receipt, arrays, positions)``."""
    if receipt_path:
        loaded = load_receipt(receipt_path)
        rec, arrays = loaded.receipt, loaded.arrays
    else:
        from test_receipts import make_receipt
        rec, arrays = make_receipt(seed=99)
    jp, npz = write_receipt(rec, arrays, work / "template")
    t = json.loads(jp.read_text())
    return t, npz, rec, arrays, t["gated"]["positions"]


def _cli(args: list[str], env: dict) -> tuple[float, subprocess.CompletedProcess]:
    t = time.perf_counter()
    p = subprocess.run([HARNESS, *args], capture_output=True, text=True, env=env)
    return time.perf_counter() - t, p


def _disk_bytes(folder: Path) -> int:
    """Bytes the folder's files take on disk, each inode once (hard links count once)."""
    seen, total = set(), 0
    for root, _, files in os.walk(folder):
        for name in files:
            st = os.lstat(os.path.join(root, name))
            if st.st_ino not in seen:
                seen.add(st.st_ino)
                total += st.st_blocks * 512
    return total


STEPS = 7
"""Evidence steps timed at each size (the median is reported)."""


def grow_size(size: int, tpl, npz, work: Path) -> tuple[dict, Path]:
    """Grow the ledger of ``size`` rows in its own folder, then flush the page cache's dirty data
    to disk (``os.sync``; its seconds as ``sync_s``), so the write-back of the grown receipts does
    not land inside a later timing. ``({rows, grow_s, sync_s}, ledger path)``."""
    lp = work / f"n{size}" / "evidence" / "parity" / "ledger.jsonl"
    t0 = time.perf_counter()
    grow(lp, size, tpl, npz)
    t1 = time.perf_counter()
    os.sync()
    return {"rows": size, "grow_s": t1 - t0, "sync_s": time.perf_counter() - t1}, lp


def evidence_steps(ledgers: list[Path], rec, arrays) -> list[list[float]]:
    """``STEPS`` evidence steps (``record_evidence``) at every ledger, taken in turns (one at each
    size, then the next round), so whatever load the machine has falls on every size alike and
    their ratio is measured in one run; the seconds of each, per ledger."""
    steps: list[list[float]] = [[] for _ in ledgers]
    for i in range(STEPS):
        for k, lp in enumerate(ledgers):
            r = dict(rec, host={**rec["host"], "hostname": f"bench-{k}-{i}"})
            t = time.perf_counter()
            record_evidence(r, arrays, lp)
            steps[k].append(time.perf_counter() - t)
    return steps


def measure(out: dict, lp: Path, rec, arrays) -> dict:
    """The verify, show and size figures at one grown ledger ``lp`` (module docstring), added to
    ``out``."""
    size = out["rows"]
    d = lp.parent.parent.parent
    os.sync()
    state = d / "verify-state"
    env = {**os.environ, "HARNESS_VERIFY_STATE": str(state)}
    c = time.process_time()
    st = L.VerifyStats()
    problems = L.verify_ledger(lp, lp.parent / "receipts", deep=False, stats=st)
    cpu = time.process_time() - c
    out.update(verify_rows=st.rows, verify_receipts=st.receipts, verify_full_s=st.seconds, verify_full_rows_per_s=st.rows_per_s,
               verify_full_rows_per_cpu_s=st.rows / cpu if cpu > 0 else 0.0, verify_full_ok=problems == [])
    if size <= 1000:  # --deep's cost is per receipt (each one's JSON parsed and checked, its arrays decoded): measured on a small ledger
        L.verify_ledger(lp, lp.parent / "receipts", deep=True)  # once to warm up (schemas compiled, imports), then timed
        c, dst = time.process_time(), L.VerifyStats()
        deep_ok = L.verify_ledger(lp, lp.parent / "receipts", deep=True, stats=dst) == []
        out.update(verify_deep_ms_per_receipt=dst.seconds / max(dst.deep, 1) * 1e3,
                   verify_deep_cpu_ms_per_receipt=(time.process_time() - c) / max(dst.deep, 1) * 1e3, verify_deep_ok=deep_ok and dst.deep == dst.rows)
    wall, p = _cli(["ledger", "verify", "--ledger", str(lp), "--quiet"], env)  # the command, saving its checkpoint
    out.update(verify_cli_full_s=wall, verify_cli_ok=p.returncode == 0, verify_cli_line=p.stdout.strip().splitlines()[0][-160:])
    record_evidence(dict(rec, host={**rec["host"], "hostname": f"bench-{size}-last"}), arrays, lp)
    old, os.environ["HARNESS_VERIFY_STATE"] = os.environ.get("HARNESS_VERIFY_STATE"), str(state)
    try:
        cp = L.Checkpoint.load(L.default_checkpoint_path(lp.resolve()))
    finally:
        if old is None:
            del os.environ["HARNESS_VERIFY_STATE"]
        else:
            os.environ["HARNESS_VERIFY_STATE"] = old
    t = time.perf_counter()  # what --incremental does, in this process: the prefix re-hashed, the new row checked deeply
    inc = L.verify_ledger(lp, lp.parent / "receipts", deep=True, checkpoint=cp, incremental=True)
    out.update(verify_incremental_s=time.perf_counter() - t, verify_incremental_ok=cp is not None and inc == [])
    wall, p = _cli(["ledger", "verify", "--ledger", str(lp), "--quiet", "--incremental"], env)
    out.update(verify_cli_incremental_s=wall, verify_cli_incremental_ok=p.returncode == 0 and "incremental" in p.stdout)
    t = time.perf_counter()  # what `ledger show` does, in this process: the cache read into pandas, trends, the tables
    view = LedgerView.load(lp)
    view.print(Console(file=io.StringIO(), width=200), rows=False)
    out.update(show_s=time.perf_counter() - t, show_groups=len(view.trends))
    wall, p = _cli(["ledger", "show", "--ledger", str(lp)], env)
    out.update(show_cli_s=wall, show_ok=p.returncode == 0)
    paths = evidence_paths(lp)  # a sign-off's lookup of the standing receipts: cold (each receipt read once for its keys), then warm
    t = time.perf_counter()
    n_found = len(ledger_receipts(paths).found)
    out.update(signoff_lookup_cold_s=time.perf_counter() - t, signoff_lookup_receipts=n_found)
    t = time.perf_counter()
    ledger_receipts(paths)
    out["signoff_lookup_s"] = time.perf_counter() - t
    out["cli_start_s"] = _cli(["--help"], env)[0]  # interpreter start and the CLI's imports: in every command's wall time
    newest = receipt_file(lp.parent / "receipts", L.check_ledger_head(lp)["receipt_id"])
    out["bytes_json"], out["bytes_npz"] = newest.stat().st_size, newest.with_suffix(".npz").stat().st_size
    out["receipts_disk_bytes"] = _disk_bytes(lp.parent / "receipts")
    out["ledger_bytes"] = lp.stat().st_size
    cache_path(lp).unlink()  # a fresh clone has no query cache (git-ignored): the first command rebuilds it from the ledger
    t = time.perf_counter()
    LedgerCache.open(lp, L.CACHE_COLUMNS).close()
    out["cache_rebuild_s"] = time.perf_counter() - t
    return out


def run(sizes: list[int], receipt: str | Path | None = None) -> dict:
    """Grow every size in one temporary folder, time the evidence steps in turns across them
    (``evidence_steps``), then measure each size (``measure``); the document ``run_all.py``
    renders."""
    receipt = receipt or default_receipt()
    load_start = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="harness-bench-evidence-") as tmp:
        work = Path(tmp)
        tpl, npz, rec, arrays, positions = template(receipt, work)
        grown = []
        for n in sizes:
            print(f"   evidence at scale: growing {n:,} rows ...", flush=True)
            grown.append(grow_size(n, tpl, npz, work))
        print(f"   evidence at scale: {STEPS} evidence steps at each size, in turns ...", flush=True)
        steps = evidence_steps([lp for _, lp in grown], rec, arrays)
        load_steps = os.getloadavg()
        res = []
        for (out, lp), s in zip(grown, steps):
            print(f"   evidence at scale: verify and show at {out['rows']:,} rows ...", flush=True)
            out.update(evidence_step_s=statistics.median(s), evidence_steps_s=s)
            res.append(measure(out, lp, rec, arrays))
            res[-1]["load_after"] = os.getloadavg()
    base = res[0]["evidence_step_s"]
    for r in res:
        r["evidence_step_ratio"] = r["evidence_step_s"] / base
    return {"template": str(Path(receipt).relative_to(REPO)) if receipt and Path(receipt).is_relative_to(REPO) else str(receipt or "test receipt"),
            "positions": positions, "load_start": load_start, "load_steps": load_steps, "cpus": os.cpu_count(), "results": res}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="10,10000,100000")
    ap.add_argument("--receipt", default=None, help="a receipt .json to copy (default: the committed parity receipt with most positions)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    doc = run([int(n) for n in a.sizes.split(",")], a.receipt)
    text = json.dumps(doc, indent=1)
    print(text)
    if a.out:
        Path(a.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
