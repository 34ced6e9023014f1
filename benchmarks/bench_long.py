#!/usr/bin/env python3
"""The long probe's cost and peak memory as positions grow: 1,024, 4,096 and 8,192 (32,768 on request).

    python benchmarks/bench_long.py [--positions 1024 4096 8192] [--wide 1024 4096]
    python benchmarks/run_all.py --only long      # rewrites this section of docs/benchmarks.md alone

Each point runs ``harness.runs.probes.probe_long`` (llama.cpp as the candidate, the float64
oracle as the reference, the parity gate's cosine 0.98) on ``fixture:tiny-qwen35-32k``
(context_length 32,768, vocabulary 515) in a fresh process, and reports its wall seconds, the
verdict and min cosine, the harness process's peak RSS (``VmHWM``, the oracle included) and the
llama.cpp worker's (``ChildPeakRSS``), in MB, beside what one ``[T, V]`` float32 array of logits
would take. ``--wide`` (default 1,024 and 4,096) adds points on ``fixture:tiny-qwen35-v248k`` (V = 248,320,
context 4,096), where ``[T, V]`` is 1 MB a position: the harness's peak is set by one block per engine
at that width (the oracle's and the llama.cpp stream's, 1 MB a row, and the metrics' float64 temporaries), so it must stay
flat while ``[T, V]`` grows fourfold, since the probe compares the two engines' blocks as they stream. The llama.cpp worker's peak is llama.cpp's own
(it keeps ``n_outputs × V`` logits in its output buffer), not the harness's.

At 32,768 positions the oracle alone should take 10 to 15 minutes on 2 cores (extrapolated; its attention is
quadratic); the default points took about 6 minutes at a load of 6 (the V = 248,320 point at 4,096
positions nearly 3 of them). Prints one JSON object and the section.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
POSITIONS = (1024, 4096, 8192)
WIDE = (1024, 4096)
"""Positions on ``WIDE_MODEL`` (V = 248,320; its context is 4,096): ``[T, V]`` grows from 1 to 4 GB
between the two, the harness's peak must not."""
MODEL = "fixture:tiny-qwen35-32k"
WIDE_MODEL = "fixture:tiny-qwen35-v248k"

_POINT = r"""
import json, sys, time
sys.path.insert(0, sys.argv[3])
from _rss import ChildPeakRSS, self_peak_mb
from harness.engines import persistent
from harness.engines.registry import resolve_engine
from harness.fixtures.resolve import resolve_model
from harness.runs.probes import long_tokens, probe_long

path, n = resolve_model(sys.argv[1]), int(sys.argv[2])
toks = long_tokens([[(37 * i + 11) % 500 for i in range(997)], [(13 * i + 5) % 500 for i in range(613)]], n)[:n]
before = self_peak_mb()
with ChildPeakRSS() as child:
    ref, cand = resolve_engine("oracle", path), resolve_engine("llama.cpp", path)
    t = time.perf_counter()
    r = probe_long(cand, ref, toks, 0.98)
    s = time.perf_counter() - t
persistent.close_all()
c = r.comparisons[0] if r.comparisons else None
print(json.dumps({"seconds": round(s, 2), "verdict": r.verdict.value, "min_cosine": c.min_cosine if c else None,
                  "n_vocab": ref.n_vocab, "harness_peak_mb": round(self_peak_mb(), 1), "before_mb": round(before, 1),
                  "worker_peak_mb": round(child.peak_mb, 1)}))
"""


def point(model: str, n: int) -> dict[str, Any]:
    """One long-probe run of ``n`` positions on ``model`` in a fresh process (see the module docstring)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    p = subprocess.run([sys.executable, "-c", _POINT, model, str(n), str(Path(__file__).resolve().parent)], capture_output=True,
                       text=True, env=env, cwd=ROOT, timeout=3600)
    if p.returncode:
        raise RuntimeError(f"{model} at {n} positions: exit {p.returncode}: {p.stderr[-500:]}")
    row = json.loads(p.stdout.strip().splitlines()[-1])
    row["tv_mb"] = round(n * row["n_vocab"] * 4 / 2**20, 1)  # one [T, V] float32 array
    return {"model": model, "positions": n, **row}


def measure(positions: tuple[int, ...] = POSITIONS, wide: tuple[int, ...] = WIDE, log=print) -> dict[str, Any]:
    """``{"points": [point(...)...], "load_start": [...], "load_end": [...]}``."""
    out: dict[str, Any] = {"load_start": [round(x, 1) for x in os.getloadavg()], "points": []}
    for model, ns in ((MODEL, positions), (WIDE_MODEL, wide)):
        for n in ns:
            out["points"].append(point(model, n))
            log(json.dumps(out["points"][-1]))
    out["load_end"] = [round(x, 1) for x in os.getloadavg()]
    return out


def section(r: dict[str, Any]) -> list[str]:
    """The benchmark page's section for ``measure``'s result."""
    lines = ["## 13. The long probe's cost and memory by positions", "",
             "`benchmarks/bench_long.py` (`benchmarks/run_all.py --only long`): `harness probe --only long`'s comparison "
             "(`probe_long`: llama.cpp against the float64 oracle, both engines' logit blocks compared as they stream) in a fresh "
             "process per point. Peak RSS of the harness process (the oracle included) and of the llama.cpp worker; `[T, V]` is "
             "what one float32 array of all positions' logits would take, which the probe never holds: at V = 248,320 the peak is "
             "set by one block per engine (1 MB a row) and the metrics' float64 temporaries, the same at 1,024 and 4,096 "
             "positions. 32,768 positions on request "
             "(`--positions 32768`: an extrapolated 10 to 15 minutes of oracle on 2 cores). "
             f"Load average {r['load_start']} at the start, {r['load_end']} at the end (2 cores shared).", "",
             "| model | positions | V | seconds | verdict | min cosine | harness peak RSS | llama.cpp worker peak RSS | [T, V] float32 |",
             "|---|---:|---:|---:|---|---:|---:|---:|---:|"]
    for p in r["points"]:
        cos = "—" if p["min_cosine"] is None else f"{p['min_cosine']:.6f}"
        lines.append(f"| `{p['model']}` | {p['positions']:,} | {p['n_vocab']:,} | {p['seconds']:.1f} | {p['verdict']} | {cos} | "
                     f"{p['harness_peak_mb']:.0f} MB | {p['worker_peak_mb']:.0f} MB | {p['tv_mb']:,.0f} MB |")
    return lines


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--positions", nargs="+", type=int, default=list(POSITIONS))
    ap.add_argument("--wide", nargs="*", type=int, default=list(WIDE), help=f"positions on {WIDE_MODEL} (V = 248,320)")
    a = ap.parse_args()
    res = measure(tuple(a.positions), tuple(a.wide), log=lambda m: print(m, file=sys.stderr, flush=True))
    print(json.dumps(res))
    print("\n".join(section(res)))
