#!/usr/bin/env python3
"""Oracle vs llama.cpp: wall time and peak RSS on one prompt (issue 3's performance targets).

Each engine runs in its own child process so peak RSS (``ru_maxrss`` of that child) is its own.
Prints a table and a JSON line; targets: oracle ≤ 20× llama.cpp's wall time, oracle peak RSS ≤
3 × GGUF file size + 200 MB.

    python benchmarks/bench_oracle.py [--model fixture:small-qwen35] [--tokens 512]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

CHILD = r"""
import json, sys, time
sys.path.insert(0, sys.argv[4])
from _rss import ChildPeakRSS, self_peak_mb
from harness.engines.registry import resolve_engine
from harness.engines.base import gather
engine, path, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
eng = resolve_engine(engine, path)
tokens = [(7 * i + 3) % eng.n_vocab for i in range(n)]
t = time.perf_counter()
with ChildPeakRSS() as worker:
    logits = gather(eng.logits(tokens), n)
wall = time.perf_counter() - t
print(json.dumps({"wall_s": wall, "maxrss_mb": self_peak_mb(),
                  "worker_peak_rss_mb": worker.peak_mb}))
"""


def run(engine: str, path: str, n: int) -> dict:
    """Wall time and peak RSS of ``engine`` on ``n`` tokens, in a child process. ``maxrss_mb`` is
    the child's own (the oracle runs in it); ``worker_peak_rss_mb`` is the llama.cpp worker's (a
    grandchild), polled from /proc (``benchmarks/_rss.py``); the child holds the gathered
    [n, V] logits in both cases."""
    here = str(Path(__file__).resolve().parent)
    out = subprocess.run([sys.executable, "-c", CHILD, engine, path, str(n), here], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="fixture:small-qwen35")
    ap.add_argument("--tokens", type=int, default=512)
    a = ap.parse_args()
    from harness.fixtures.resolve import resolve_model

    path = resolve_model(a.model)
    size_mb = path.stat().st_size / 1e6
    llama = run("llama.cpp", str(path), a.tokens)
    oracle = run("oracle", str(path), a.tokens)
    ratio = oracle["wall_s"] / llama["wall_s"]
    budget = 3 * size_mb + 200
    print(f"model {a.model} ({size_mb:.1f} MB), {a.tokens} tokens")
    print(f"  llama.cpp: {llama['wall_s']:.3f} s wall (incl. worker start), worker peak RSS {llama['worker_peak_rss_mb']:.0f} MB")
    print(f"  oracle:    {oracle['wall_s']:.3f} s wall, peak RSS {oracle['maxrss_mb']:.0f} MB")
    print(f"  ratio oracle/llama.cpp: {ratio:.2f}x (target <= 20x)  RSS budget {budget:.0f} MB: {'ok' if oracle['maxrss_mb'] <= budget else 'OVER'}")
    print(json.dumps({"model": a.model, "tokens": a.tokens, "file_mb": size_mb, "llama_wall_s": llama["wall_s"],
                      "oracle_wall_s": oracle["wall_s"], "ratio": ratio, "oracle_maxrss_mb": oracle["maxrss_mb"], "rss_budget_mb": budget}))


if __name__ == "__main__":
    main()
