"""What the serving probe costs as concurrency grows (1 → 7) and as history grows (1K → 4K → 16K).

    python benchmarks/bench_serving.py [--histories 1024 4096 16384] [--model fixture:tiny-qwen35]

On the oracle (``fixture:tiny-qwen35`` by default): the shipped ``concurrency-N`` scenarios
(``harness/data/scenarios/serving.yaml``, N = 1, 2, 3, 5, 7 requests of 32 to 86 prompt tokens,
8 tokens each) and, per history H, a two-turn conversation reaching H positions (turn 1: H/2
prompt tokens, 16 generated; turn 2 continues it through the prefix cache to H). Each is judged
whole by ``harness.runs.serving.probe_serving`` (the served scenario, every request's solo run:
``generate`` and ``logits``, and the teacher-forced re-serve after a near-tie), timed in seconds;
memory is the peak of the numpy and Python allocations during that scenario (``tracemalloc``), in
MB, and the process's peak RSS at the end. No reference comparison (parity's cost, section 2).
Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import tracemalloc
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _rss import self_peak_mb  # noqa: E402

CONCURRENCY = (1, 2, 3, 5, 7)
HISTORIES = (1024, 4096, 16384)


def _two_turns(h: int, tmp: Path) -> Path:
    first = h // 2
    text = ("schema: harness-serving-scenarios/v1\nscenarios:\n"
            f"  - name: history-{h}\n    why: a two-turn conversation reaching {h} positions\n    requests:\n"
            f"      - {{id: t1, prompt: [{{prompt: 0, tokens: {first}}}], n_tokens: 16}}\n"
            f"      - {{id: t2, continues: t1, prompt: [{{prompt: 1, tokens: {h - first - 31}}}], n_tokens: 16, "
            "arrival: {after: t1, tokens: 16}}\n"
            "    expect: {cache_hit: [t2]}\n")
    path = tmp / f"history-{h}.yaml"
    path.write_text(text)
    return path


def measure(histories: tuple[int, ...] = HISTORIES, model: str = "fixture:tiny-qwen35") -> dict[str, Any]:
    """``{"concurrency": {N: row}, "history": {H: row}}``, each row ``{"seconds", "peak_mb",
    "verdict", "served_steps"}``, with the load average before and after."""
    import tempfile

    import numpy as np

    from harness.engines.oracle import load_oracle
    from harness.fixtures.resolve import resolve_model
    from harness.measure.prompts import PromptTokens
    from harness.measure.scenarios import load_scenarios
    from harness.runs.probe_types import ProbeTolerance
    from harness.runs.serving import probe_serving

    engine = load_oracle(resolve_model(model))
    rng = np.random.default_rng(7)
    prompts = [PromptTokens(f"p{i}", [int(t) for t in rng.integers(0, engine.n_vocab, 400 + 17 * i)], "ids") for i in range(6)]
    tol = ProbeTolerance(min_cosine=1 - 1e-8, max_kld=1e-9)
    out: dict[str, Any] = {"model": model, "load_start": [round(x, 1) for x in os.getloadavg()], "concurrency": {}, "history": {}}

    def run(sc: Any) -> dict[str, Any]:
        tracemalloc.start()
        t = time.perf_counter()
        r = probe_serving(engine, prompts, tol, [sc])
        s = time.perf_counter() - t
        peak = tracemalloc.get_traced_memory()[1] / 2**20
        tracemalloc.stop()
        row = r.details["scenarios"][0]
        got = {"seconds": round(s, 2), "peak_mb": round(peak, 1), "verdict": r.verdict.value,
               "served_steps": len(row.get("log", {}).get("steps", []))}
        print(f"{sc.name}: {got}", file=sys.stderr, flush=True)
        return got

    shipped = {s.name: s for s in load_scenarios()}
    for n in CONCURRENCY:
        out["concurrency"][n] = run(shipped[f"concurrency-{n}"])
    with tempfile.TemporaryDirectory() as d:
        for h in histories:
            out["history"][h] = run(load_scenarios(_two_turns(h, Path(d)))[0])
    out["load_end"] = [round(x, 1) for x in os.getloadavg()]
    out["process_peak_rss_mb"] = round(self_peak_mb(), 1)
    return out


def section(r: dict[str, Any]) -> list[str]:
    """The benchmark page's section for ``measure``'s result."""
    c, h = r["concurrency"], r["history"]
    lines = ["## 11. The serving probe's cost: concurrency and history", "",
             f"`benchmarks/bench_serving.py`: the oracle on `{r['model']}`, each scenario judged whole by the serving probe "
             "(served once, every request run alone with `generate` and `logits`), no reference comparison. Memory: the peak of "
             f"numpy and Python allocations during the scenario (tracemalloc). Load average {r['load_start']} at the start, "
             f"{r['load_end']} at the end" + (f"; process peak RSS {r['process_peak_rss_mb']:.0f} MB." if r.get("process_peak_rss_mb") else "."), "",
             "| requests in flight | seconds | peak MB | steps served | verdict |", "|---:|---:|---:|---:|---|"]
    lines += [f"| {n} | {v['seconds']:.2f} | {v['peak_mb']:.1f} | {v['served_steps']} | {v['verdict']} |" for n, v in c.items()]
    lines += ["", "| history (positions) | seconds | peak MB | steps served | verdict |", "|---:|---:|---:|---:|---|"]
    lines += [f"| {n:,} | {v['seconds']:.2f} | {v['peak_mb']:.1f} | {v['served_steps']} | {v['verdict']} |" for n, v in h.items()]
    return lines


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--histories", nargs="+", type=int, default=list(HISTORIES))
    ap.add_argument("--model", default="fixture:tiny-qwen35")
    a = ap.parse_args()
    print(json.dumps(measure(tuple(a.histories), a.model), indent=1))
