"""Cost of real traffic (section 12 of docs/benchmarks.md): every shipped serving scenario served by
llama-server (built by `make llama-server`) at 1, 2 and 4 slots on fixture:trained-qwen35, without
the judgement: wall time, requests per second, the harness's own share (its process CPU time over
the wall time), and its peak RSS after each slot count (the clients hold only the replies of the
requests in flight and done, top-20 rows each). Requests carry the scenario's message delimiters,
as the serving probe sends them (``harness.engines.llama_server.message_delimiters``).

    .venv/bin/python benchmarks/run_all.py --only llama-server      # rewrites section 12
    PYTHONPATH=. .venv/bin/python benchmarks/llama_server_traffic.py [REPEATS]   # prints the numbers
"""

from __future__ import annotations

import json
import os
import resource
import sys
from typing import Any

import numpy as np

from harness.engines.http_traffic import drive_scenario
from harness.engines.llama_server import LlamaServer, built_binary, message_delimiters
from harness.measure.prompts import PromptTokens
from harness.measure.scenarios import load_scenarios
from harness.paths import SOURCE_ROOT

MODEL = SOURCE_ROOT / "harness" / "data" / "fixtures" / "trained-qwen35.gguf"
V = 515
SLOTS = (1, 2, 4)


def measure(repeats: int = 1) -> dict[str, Any]:
    """``{slots: {requests, wall_s, requests_per_s, harness_cpu_s, harness_share, peak_rss_mb}}``
    over ``repeats`` passes of every shipped scenario, each on a fresh server; with the load
    average before and after. Exits naming ``make llama-server`` when the binary is missing."""
    if built_binary() is None:
        sys.exit("llama-server is not built: run `make llama-server`")
    rng = np.random.default_rng(7)
    prompts = [PromptTokens(f"p{i}", [int(t) for t in rng.integers(0, V, 310 + 17 * i)], "ids") for i in range(6)]
    scenarios = [s.resolve(prompts) for s in load_scenarios()]
    out: dict[str, Any] = {"model": "fixture:trained-qwen35", "repeats": repeats, "scenarios": len(scenarios),
                           "load_start": list(os.getloadavg()), "slots": {}}
    for slots in SLOTS:
        wall = cpu = n = 0.0
        for _ in range(repeats):
            for sc in scenarios:
                with LlamaServer(MODEL, parallel=slots) as srv:
                    delims = message_delimiters(srv.url, [r.tokens for r in sc.requests if r.continues is None])
                    tr = drive_scenario(srv.url, sc, V, k=20, extra={"message_delimiters": delims} if delims else {})
                wall, cpu, n = wall + tr.wall_s, cpu + tr.client_cpu_s, n + len(tr.replies)
        out["slots"][slots] = {"requests": int(n), "wall_s": wall, "requests_per_s": n / wall, "harness_cpu_s": cpu,
                               "harness_share": cpu / wall, "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
    out["load_end"] = list(os.getloadavg())
    return out


def section(r: dict[str, Any]) -> list[str]:
    """The benchmark page's section for ``measure``'s result."""
    lines = ["## 12. llama-server under concurrent clients", "",
             f"`benchmarks/llama_server_traffic.py` (`benchmarks/run_all.py --only llama-server`): the {r['scenarios']} shipped serving "
             f"scenarios served by llama-server (built from the reference's llama.cpp) on `{r['model']}`, each on a fresh server, "
             f"{r['repeats']} pass(es), the clients streaming as the serving probe does (message delimiters included), without the "
             "judgement's solo runs. The harness's share is its own process CPU time over the wall time; its peak RSS is the "
             f"process's after each slot count. Load average {_load(r['load_start'])} at the start, {_load(r['load_end'])} at the end "
             "(2 cores shared: at a load above 2 the wall times are the machine's, not the server's).", "",
             "| slots | requests | wall s | requests/s | harness CPU s | harness share | harness peak RSS MB |",
             "|---:|---:|---:|---:|---:|---:|---:|"]
    for slots, v in r["slots"].items():
        lines.append(f"| {slots} | {v['requests']} | {v['wall_s']:.2f} | {v['requests_per_s']:.1f} | {v['harness_cpu_s']:.2f} | "
                     f"{v['harness_share']:.0%} | {v['peak_rss_mb']:.0f} |")
    lines += ["", "The harness's own share stays near 1 % and its memory flat as slots grow: the clients hold the replies, "
              "not the logits, and the server's time is the run's."]
    return lines


def _load(v: list[float]) -> str:
    return "[" + ", ".join(f"{x:.1f}" for x in v) + "]"


if __name__ == "__main__":
    print(json.dumps(measure(int(sys.argv[1]) if len(sys.argv) > 1 else 1), indent=1))
