"""What the speculative probe's given-draft cases cost at a 1,024-token history, draft depths 1 to 8.

    python benchmarks/bench_speculative.py [--engines oracle command:example]

For each engine on ``fixture:tiny-qwen35-mtp`` and each draft_max d in 1 … 8: one given-draft case
(``harness.runs.spec_given.run_given``) on a 1,020-token prompt (two fixed id ramps cycled,
``harness.runs.probes.long_tokens``), 16 tokens, the drafts the plain continuation with the draft
after the first full step planted wrong, so the first verification batch of d + 1 rows straddles
cell 1,024 when d ≥ 4: plain greedy, the plain path's rows, the speculative run and the three
comparisons, timed whole (seconds). Peak memory: the oracle's in this process (``VmHWM``), the
example engine's process (``ChildPeakRSS``), in MB. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _rss import ChildPeakRSS, self_peak_mb  # noqa: E402

DEPTHS = tuple(range(1, 9))
PROMPT_TOKENS = 1020


def measure(engines: tuple[str, ...] = ("oracle", "command:example")) -> dict[str, Any]:
    """``{engine: {"seconds": {d: s}, "peak_mb": MB, "ok": all comparisons passed}}`` and the load."""
    from harness.engines import persistent
    from harness.engines.registry import resolve_engine
    from harness.fixtures.resolve import resolve_model
    from harness.runs.probe_types import ProbeTolerance
    from harness.runs.probes import long_tokens
    from harness.runs.spec_given import GivenCase, run_given

    path = resolve_model("fixture:tiny-qwen35-mtp")
    out: dict[str, Any] = {"load_start": [round(x, 1) for x in os.getloadavg()], "prompt_tokens": PROMPT_TOKENS, "n_tokens": 16}
    for name in engines:
        engine = resolve_engine(name, path)
        history = long_tokens([list(range(3, 500, 7)), list(range(11, 500, 13))], PROMPT_TOKENS)[:PROMPT_TOKENS]
        tol = ProbeTolerance(min_cosine=1 - 1e-8, max_kld=1e-9) if name == "oracle" else ProbeTolerance(min_cosine=1 - 1.3e-5, max_kld=1.6e-3)
        plain = lambda p, n: [int(t) for t in engine.generate(list(p), n)]  # noqa: E731
        row: dict[str, Any] = {"seconds": {}, "ok": True}
        with ChildPeakRSS() as child:
            for d in DEPTHS:
                case = GivenCase(f"depth {d}", history, 16, (d + 2,), draft_max=d)
                t = time.perf_counter()
                comps, _ = run_given(engine, [case], plain, 1e-3, tol)
                row["seconds"][d] = round(time.perf_counter() - t, 2)
                row["ok"] = row["ok"] and all(c.ok for c in comps)
        row["peak_mb"] = round(self_peak_mb() if name == "oracle" else child.peak_mb, 1)
        persistent.close_all()
        out[name] = row
    return out


def section(r: dict[str, Any]) -> list[str]:
    """The benchmark page's section for ``measure``'s result."""
    engines = [k for k in r if isinstance(r[k], dict) and "seconds" in r[k]]
    lines = ["## 9. The speculative probe's given drafts at a 1,024-token history", "",
             f"`benchmarks/bench_speculative.py`: one given-draft case per draft depth on `fixture:tiny-qwen35-mtp`, a "
             f"{r['prompt_tokens']}-token prompt, {r['n_tokens']} tokens (plain greedy, the plain rows, the speculative run, "
             "the three comparisons), seconds per case; peak memory of the engine's process.", "",
             "| draft_max | " + " | ".join(engines) + " |", "|---:|" + "---:|" * len(engines)]
    for d in DEPTHS:
        lines.append(f"| {d} | " + " | ".join(f"{r[e]['seconds'][d]:.2f} s" for e in engines) + " |")
    lines.append("| peak memory | " + " | ".join(f"{r[e]['peak_mb']:.0f} MB" for e in engines) + " |")
    lines.append("| every comparison passed | " + " | ".join("yes" if r[e]["ok"] else "NO" for e in engines) + " |")
    return lines


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engines", nargs="+", default=["oracle", "command:example"])
    res = measure(tuple(ap.parse_args().engines))
    print(json.dumps(res))
    print("\n".join(section(json.loads(json.dumps(res), object_hook=lambda o: {int(k) if k.isdigit() else k: v for k, v in o.items()}))))
