#!/usr/bin/env python3
"""Parity against llama.cpp's own ``llama-perplexity`` on the same KLD job, side by side (issue 58).

    python benchmarks/bench_perplexity.py [--repeats 2]
    python benchmarks/run_all.py --only perplexity      # rewrites this section of docs/benchmarks.md alone

The job: ``fixture:tiny-qwen35-v248k`` (V = 248,320), a text of this repository's own Python
source cut to 3 windows of 512 tokens (1,536 positions), as ``llama-perplexity -c 512 --chunks 3``
cuts it. Legs, each a fresh process tree, in one run and interleaved (``--repeats`` rounds; the
fastest of each leg is kept, since the machine may be shared), after one untimed warm-up leg, with
the harness's Python bytecode cached (``leg_env``):

- ``llama-perplexity --kl-divergence-base`` then ``--kl-divergence`` (built from the installed
  llama-cpp-python's llama.cpp, ``make llama-tools``), 2 threads: the anchor, two engine passes;
- ``harness parity --candidate command:example --text T --ctx 512 --no-evidence
  --greedy-tokens 0 --no-reference-cache``: llama.cpp (the reference) against llama.cpp through
  the example engine (protocol 2, the logits ring);
- the same with ``--score-second-half``: only each window's positions from 256 on (768), the rows
  llama-perplexity asks llama.cpp for, computed (the reference's worker and the example engine set
  ``batch.logits`` for them alone), moved and judged: the ratio on the same positions;
- the same with ``--candidate llama.cpp`` (the built-in reference against itself);
- the harness with the reference cache warm (the second of two runs on one fresh cache folder)
  beside the ``--kl-divergence`` pass alone, whose base logits were saved by the first;
- the example-engine leg again on a text of ``2 × CHUNKS`` windows (3,072 positions): its peak
  memory must not grow with the positions.

For each leg: wall seconds, CPU seconds (user + system of the whole process tree), and peak RSS,
both the largest single process's (``VmHWM``, what ``/usr/bin/time`` reports for one process) and
the most the tree held at once (every process's VmRSS added, read every 10 ms: the harness, the
reference's worker and the engine together). Prints one JSON object and the section.

``--smoke`` runs the plain and the ``--score-second-half`` example legs once each on
``fixture:tiny-qwen35`` (V = 515, 3 windows of 64) and prints their JSON: a check that the legs
run, not a measurement.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _rss import ChildPeakRSS  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
MODEL = "fixture:tiny-qwen35-v248k"
PPL_BATCH = "512"
"""llama-perplexity's ``-b`` for the anchor: one 512-token window a batch. Its default (2048) decodes
up to 4 windows as parallel sequences (``n_seq``); on this 2-core CPU that was 0.3–0.5 s a pass
slower (the ubatch is 512 tokens either way), so the anchor is its faster setting; the default's
legs are measured beside it."""
N_CTX, CHUNKS = 512, 3


def make_text(model: Path, out: Path, windows: int = CHUNKS, n_ctx: int = N_CTX) -> int:
    """Write the first characters of the harness's own sources that tokenize to just over
    ``windows`` windows of ``n_ctx`` tokens (by the model's llama.cpp vocabulary) to ``out``;
    returns the token count."""
    from llama_cpp import Llama

    vocab = Llama(str(model), vocab_only=True, verbose=False)
    src = "".join(p.read_text() for p in sorted((ROOT / "harness").rglob("*.py")))
    want = windows * n_ctx + 24
    lo, hi = 0, len(src)
    while lo < hi:  # the shortest prefix with at least ``want`` tokens
        mid = (lo + hi) // 2
        if len(vocab.tokenize(src[:mid].encode(), add_bos=False)) < want:
            lo = mid + 1
        else:
            hi = mid
    out.write_text(src[:lo])
    return len(vocab.tokenize(src[:lo].encode(), add_bos=False))


def leg_env() -> dict[str, str]:
    """This environment without ``PYTHONDONTWRITEBYTECODE``: the harness's modules run from their
    cached bytecode, as an installed package's do (compiling about 100 modules from source costs a
    harness process about 0.3 s a start; llama-perplexity is a compiled binary). The untimed
    warm-up leg of ``measure`` writes that cache."""
    return {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}


def leg(argv: list[str], env: dict[str, str] | None = None) -> dict[str, Any]:
    """Run ``argv`` to completion: wall and CPU seconds of its process tree, the largest and the
    summed peak RSS (MB) of its processes, its exit code and last output line."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    with ChildPeakRSS(interval=0.01) as peak, tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        t = time.perf_counter()
        p = subprocess.Popen(argv, stdout=out, stderr=err, text=True, cwd=ROOT, env={**leg_env(), **(env or {})})
        rc = p.wait(timeout=3600)
        wall = time.perf_counter() - t
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read(), err.read()
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    tail = (stdout.strip().splitlines() or [""])[-1]
    if rc:
        raise RuntimeError(f"{argv[0]} ... exit {rc}: {stderr[-600:]}")
    return {"wall_s": round(wall, 2), "cpu_s": round(cpu, 2), "cpu_by_role": cpu_by_role(peak), "peak_mb": round(peak.peak_mb, 1),
            "main_peak_mb": round(peak.last_kb.get(p.pid, 0) / 1024, 1),
            "sum_peak_mb": round(peak.peak_sum_mb, 1), "last_line": tail[-200:]}


ROLES = (("_llamacpp_worker", "llama.cpp workers (the reference: tokenization, then the logits)"), ("llamacpp_engine.py", "example engine (candidate)"),
         ("_reaper", "engine supervisor"), ("-m harness", "harness process"), ("llama-perplexity", "llama-perplexity"))


def cpu_by_role(peak: Any) -> dict[str, float]:
    """User + system seconds of a leg's processes summed by what they are (``ROLES``, by command
    line), as ``ChildPeakRSS`` last read them: where a leg's CPU seconds went."""
    out: dict[str, float] = {}
    for pid, secs in peak.cpu_s.items():
        role = next((name for key, name in ROLES if key in peak.argv.get(pid, "")), "other")
        out[role] = round(out.get(role, 0.0) + secs, 2)
    return out


def _fastest(runs: list[dict[str, Any]]) -> dict[str, Any]:
    best = min(runs, key=lambda r: r["wall_s"])
    return {**best, "walls": [r["wall_s"] for r in runs]}


def measure(repeats: int = 2, log=print) -> dict[str, Any]:
    """The legs of the module docstring, ``repeats`` interleaved rounds each; the ratios of their fastest runs."""
    from harness.fixtures.resolve import resolve_model
    from harness.paths import llama_tool

    ppl = llama_tool("llama-perplexity")
    if ppl is None:
        raise SystemExit("llama-perplexity is not built: run `make llama-tools`")
    model = resolve_model(MODEL)
    work = Path(tempfile.mkdtemp(prefix="bench-ppl-"))
    text = work / "text.txt"
    n_text = make_text(model, text)
    text2 = work / "text-double.txt"
    make_text(model, text2, 2 * CHUNKS)
    base = work / "base.bin"
    common = ["-m", str(model), "-c", str(N_CTX), "--chunks", str(CHUNKS), "-t", "2"]
    harness = [sys.executable, "-m", "harness", "parity", "--model", MODEL, "--text", str(text), "--ctx", str(N_CTX),
               "--no-evidence", "--greedy-tokens", "0"]
    runs: dict[str, list] = {k: [] for k in ("ppl_base", "ppl_kld", "ppl_base_b2048", "ppl_kld_b2048", "example", "scored", "builtin", "warm",
                                             "double")}
    leg([*harness, "--candidate", "command:example", "--no-reference-cache"])  # warm-up, untimed: bytecode written
    out: dict[str, Any] = {"load_start": [round(x, 1) for x in os.getloadavg()], "text_tokens": n_text, "llama_perplexity": str(ppl)}
    for r in range(repeats):
        for sfx, b in (("", PPL_BATCH), ("_b2048", "2048")):  # its best batch here, and its default
            runs[f"ppl_base{sfx}"].append(leg([str(ppl), *common, "-b", b, "-f", str(text), "--kl-divergence-base", str(base)]))
            runs[f"ppl_kld{sfx}"].append(leg([str(ppl), *common, "-b", b, "--kl-divergence-base", str(base), "--kl-divergence"]))
        runs["example"].append(leg([*harness, "--candidate", "command:example", "--no-reference-cache"]))
        runs["scored"].append(leg([*harness, "--candidate", "command:example", "--no-reference-cache", "--score-second-half"]))
        runs["builtin"].append(leg([*harness, "--candidate", "llama.cpp", "--no-reference-cache"]))
        cache = work / f"cache-{r}"
        leg([*harness, "--candidate", "command:example"], {"HARNESS_REFERENCE_CACHE": str(cache)})  # fills the cache
        runs["warm"].append(leg([*harness, "--candidate", "command:example"], {"HARNESS_REFERENCE_CACHE": str(cache)}))
        doubled = [a if a != str(text) else str(text2) for a in harness]
        runs["double"].append(leg([*doubled, "--candidate", "command:example", "--no-reference-cache"]))
        log(json.dumps({k: v[-1]["wall_s"] for k, v in runs.items()}))
    best = {k: _fastest(v) for k, v in runs.items()}
    two = best["ppl_base"]["wall_s"] + best["ppl_kld"]["wall_s"]
    two_cpu = best["ppl_base"]["cpu_s"] + best["ppl_kld"]["cpu_s"]
    ppl_peak = max(best["ppl_base"]["peak_mb"], best["ppl_kld"]["peak_mb"])
    out.update(legs=best, two_passes_s=round(two, 2), two_passes_cpu_s=round(two_cpu, 2), ppl_peak_mb=ppl_peak,
               ratio={k: round(best[k]["wall_s"] / two, 2) for k in ("example", "scored", "builtin")},
               cpu_ratio={k: round(best[k]["cpu_s"] / two_cpu, 2) for k in ("example", "scored", "builtin")},
               warm_ratio=round(best["warm"]["wall_s"] / best["ppl_kld"]["wall_s"], 2),
               load_end=[round(x, 1) for x in os.getloadavg()])
    return out


def section(r: dict[str, Any]) -> list[str]:
    """The benchmark page's section for ``measure``'s result."""
    L = r["legs"]
    ok = r["ratio"]["example"] <= 1.5
    mem_ok = L["example"]["peak_mb"] <= r["ppl_peak_mb"]
    lines = ["## 14. Parity against llama-perplexity on the same KLD job", "",
             f"`benchmarks/bench_perplexity.py` (`benchmarks/run_all.py --only perplexity`): `{MODEL}` (V = 248,320), a text of "
             f"the harness's own source ({r['text_tokens']:,} tokens) in {CHUNKS} windows of {N_CTX} "
             f"({CHUNKS * N_CTX:,} positions), 2 threads. Each leg a fresh process tree; the fastest of "
             f"{len(L['example']['walls'])} interleaved rounds after an untimed warm-up (all rounds' walls in brackets), the "
             f"harness's Python bytecode cached as an installed package's is. CPU: user + system seconds of "
             f"the tree. Peak: the largest single process's VmHWM; Σ peak: the most the process tree held at once (every "
             f"process's VmRSS added, read every 10 ms: the harness, the reference's worker and the engine). Load average {r['load_start']} at the start, {r['load_end']} at the end "
             "(2 cores shared).", "",
             "| leg | wall s | CPU s | peak RSS MB (largest process) | the command's own process MB | Σ peak MB |",
             "|---|---:|---:|---:|---:|---:|"]
    names = {"ppl_base": f"llama-perplexity `--kl-divergence-base` (`-b {PPL_BATCH}`)",
             "ppl_kld": f"llama-perplexity `--kl-divergence` (`-b {PPL_BATCH}`)",
             "ppl_base_b2048": "llama-perplexity `--kl-divergence-base` (its default `-b 2048`: 3 windows as parallel sequences)",
             "ppl_kld_b2048": "llama-perplexity `--kl-divergence` (`-b 2048`)",
             "example": "`harness parity --candidate command:example` (reference computed)",
             "scored": f"the same with `--score-second-half` (llama-perplexity's {CHUNKS * N_CTX // 2:,} positions judged)",
             "builtin": "`harness parity --candidate llama.cpp` (reference computed)",
             "warm": "`harness parity --candidate command:example`, reference cache warm",
             "double": f"the same as the example leg on {2 * CHUNKS} windows ({2 * CHUNKS * N_CTX:,} positions)"}
    for k, name in names.items():
        if k not in L:  # a result from before the leg existed
            continue
        g = L[k]
        lines.append(f"| {name} | {g['wall_s']:.2f} {g['walls']} | {g['cpu_s']:.2f} | {g['peak_mb']:,.0f} | {g['main_peak_mb']:,.0f} | "
                     f"{g['sum_peak_mb']:,.0f} |")
    lines += ["",
              f"- llama-perplexity's two passes at `-b {PPL_BATCH}`: {r['two_passes_s']:.2f} s ({r['two_passes_cpu_s']:.2f} CPU s; at its "
              f"default `-b 2048`: {L['ppl_base_b2048']['wall_s'] + L['ppl_kld_b2048']['wall_s']:.2f} s). "
              f"`harness parity` through the example engine: **{r['ratio']['example']:.2f}×** their wall time "
              f"(target ≤ 1.5×: {'met' if ok else '**not met**'}), {r['cpu_ratio']['example']:.2f}× their CPU time; "
              f"the built-in reference against itself: {r['ratio']['builtin']:.2f}× ({r['cpu_ratio']['builtin']:.2f}× CPU).",
              f"- Against llama-perplexity as the issue ran it (its default `-b 2048`): "
              f"{L['example']['wall_s'] / (L['ppl_base_b2048']['wall_s'] + L['ppl_kld_b2048']['wall_s']):.2f}× "
              f"(peak {max(L['ppl_base_b2048']['peak_mb'], L['ppl_kld_b2048']['peak_mb']):,.0f} MB).",
              f"- Not the same positions: llama-perplexity asks llama.cpp for logits only where it scores them, the second "
              f"half of each window ({CHUNKS * N_CTX // 2:,} of {CHUNKS * N_CTX:,} positions: `need_logits = pos >= first` "
              f"in tools/perplexity/perplexity.cpp), so its output projection (at this vocabulary most of the model's work), "
              f"its output buffer and its KLD cover half the rows. The harness judges every position, each engine computing, "
              f"moving and being compared on all {CHUNKS * N_CTX:,} rows. With `--score-second-half` the harness judges "
              f"llama-perplexity's positions alone, and the reference's worker and the example engine (capability "
              f"`first_row`) compute only those rows: "
              + (f"**{r['ratio']['scored']:.2f}×** the two passes' wall time (target ≤ 1.5×: "
                 f"{'met' if r['ratio']['scored'] <= 1.5 else '**not met**'}), {r['cpu_ratio']['scored']:.2f}× their CPU time."
                 if "scored" in r["ratio"] else "not measured in this run."),
              f"- With the reference's logits in the cache (as `--kl-divergence` reads its base file): "
              f"{r['warm_ratio']:.2f}× the `--kl-divergence` pass alone.",
              f"- Peak memory: the harness's largest process {L['example']['peak_mb']:,.0f} MB (the harness's own "
              f"{L['example']['main_peak_mb']:,.0f} MB) against llama-perplexity's "
              f"{r['ppl_peak_mb']:,.0f} MB ({'at or below' if mem_ok else '**above**'}); its processes together at most: "
              f"{L['example']['sum_peak_mb']:,.0f} MB. On twice the positions: {L['double']['peak_mb']:,.0f} MB and "
              f"{L['double']['sum_peak_mb']:,.0f} MB together (memory set by blocks and llama.cpp's one ubatch, not by the positions).",
              "- Where the CPU seconds of the example leg went, by process: "
              + "; ".join(f"{k} {v:.2f} s" for k, v in sorted(L["example"]["cpu_by_role"].items(), key=lambda kv: -kv[1]))
              + f"; against llama-perplexity's {r['two_passes_cpu_s']:.2f} s for both passes."]
    return lines


def smoke() -> dict[str, Any]:
    """The example leg and its ``--score-second-half`` twin once each on ``fixture:tiny-qwen35``
    (3 windows of 64): that they run and judge the positions they say, in seconds, not a measurement."""
    from harness.fixtures.resolve import resolve_model

    work = Path(tempfile.mkdtemp(prefix="bench-ppl-smoke-"))
    text = work / "text.txt"
    make_text(resolve_model("fixture:tiny-qwen35"), text, CHUNKS, 64)
    harness = [sys.executable, "-m", "harness", "parity", "--model", "fixture:tiny-qwen35", "--text", str(text), "--ctx", "64",
               "--no-evidence", "--greedy-tokens", "0", "--candidate", "command:example", "--no-reference-cache"]
    return {"example": leg(harness), "scored": leg([*harness, "--score-second-half"])}


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--smoke", action="store_true", help="the example legs once on fixture:tiny-qwen35 (module docstring)")
    a = ap.parse_args()
    if a.smoke:
        print(json.dumps(smoke()))
        raise SystemExit(0)
    res = measure(a.repeats, log=lambda m: print(m, file=sys.stderr, flush=True))
    print(json.dumps(res))
    print("\n".join(section(res)))
