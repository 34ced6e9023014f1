"""Cost of real traffic: every shipped serving scenario served by llama-server (built by `make
llama-server`) at 1, 2 and 4 slots on fixture:trained-qwen35, without the judgement: wall time,
requests per second, and the harness's own share (its process CPU time over the wall time).

    PYTHONPATH=. .venv/bin/python benchmarks/llama_server_traffic.py [REPEATS]
"""

from __future__ import annotations

import sys

import numpy as np

from harness.engines.http_traffic import drive_scenario
from harness.engines.llama_server import LlamaServer, built_binary
from harness.measure.prompts import PromptTokens
from harness.measure.scenarios import load_scenarios
from harness.paths import SOURCE_ROOT

MODEL = SOURCE_ROOT / "harness" / "data" / "fixtures" / "trained-qwen35.gguf"
V = 515


def main(repeats: int = 3) -> None:
    if built_binary() is None:
        sys.exit("llama-server is not built: run `make llama-server`")
    rng = np.random.default_rng(7)
    prompts = [PromptTokens(f"p{i}", [int(t) for t in rng.integers(0, V, 310 + 17 * i)], "ids") for i in range(6)]
    scenarios = [s.resolve(prompts) for s in load_scenarios()]
    print("| slots | requests | wall s | req/s | harness CPU s | harness share |")
    print("|---|---|---|---|---|---|")
    for slots in (1, 2, 4):
        wall = cpu = n = 0.0
        for _ in range(repeats):
            for sc in scenarios:
                with LlamaServer(MODEL, parallel=slots) as srv:
                    tr = drive_scenario(srv.url, sc, V, k=20)
                wall, cpu, n = wall + tr.wall_s, cpu + tr.client_cpu_s, n + len(tr.replies)
        print(f"| {slots} | {int(n)} | {wall:.2f} | {n / wall:.1f} | {cpu:.2f} | {cpu / wall:.0%} |")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 3)
