#!/usr/bin/env python3
"""The KV-type matrix: llama.cpp (the reference family) with each KV-cache type against the oracle.

For each fixture and each row of ``ROWS`` (``type_k``, ``type_v``, ``flash_attn``), llama.cpp runs the
shipped prompt set and every position is compared with the float64 oracle on the same token ids
(``harness.measure.metrics.position_metrics``: KL(P_oracle || P_llama.cpp) in nats, cosine of the
raw logits). Each row also records whether llama.cpp's log said flash attention ran
(``LlamaCppEngine.flash_attn_ran``). f16/f16 with flash attention on is the baseline; each row's
KLD mean is also given as a multiple of it. Non-finite rows are counted, never dropped: a KV type
that gives NaN is a finding, not a row to loosen.

Nothing is judged here and thresholds.yaml is not read: the numbers are for docs/gates-matrix.md
("KV-cache types"). The oracle's logits are gathered per prompt and held (the tiny fixtures'
vocabulary is 515 rows wide, so a prompt is at most ~2 MB); this is no long-context tool.

    python benchmarks/bench_kv_types.py [--model fixture:tiny-qwen35 ...] [--markdown] [--json]

About 1-2 minutes on 2 CPU cores for the two default fixtures.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from typing import Any

import numpy as np

ROWS = (
    ("f32", "f32", "off"),
    ("f32", "f32", "on"),
    ("f16", "f16", "off"),
    ("f16", "f16", "on"),
    ("bf16", "bf16", "on"),
    ("q8_0", "f16", "off"),
    ("q8_0", "q8_0", "on"),
    ("q4_0", "f16", "off"),
    ("q4_0", "q4_0", "on"),
)
"""The matrix's rows: (type_k, type_v, flash_attn). A quantized V cache needs flash attention in
llama.cpp, so q8_0 and q4_0 V rows run with it; a quantized K alone runs without, to separate the
two. ``("f16", "f16", "on")`` is the baseline."""

BASELINE = ("f16", "f16", "on")

DEFAULT_MODELS = ("fixture:tiny-qwen35", "fixture:tiny-qwen35moe")


def oracle_logits(path, prompts) -> list[np.ndarray]:
    """The oracle's float32 ``[T, V]`` logits of each prompt (``prompts``: ``PromptTokens``)."""
    from harness.engines.base import gather
    from harness.engines.registry import resolve_engine

    oracle = resolve_engine("oracle", path)
    return [gather(oracle.logits(p.tokens), len(p.tokens)) for p in prompts]


def measure_row(path, prompts, ref: list[np.ndarray], type_k: str, type_v: str, flash_attn: str) -> dict[str, Any]:
    """One matrix cell: llama.cpp with these KV settings against the oracle's logits ``ref``.

    Returns positions, non-finite positions, KLD mean / p99 / max (nats), min cosine, argmax
    agreement with the oracle, whether flash attention ran (llama.cpp's log), and seconds."""
    from harness.engines.base import gather
    from harness.engines.llamacpp import LlamaCppEngine, LlamaCppSettings
    from harness.measure import metrics

    eng = LlamaCppEngine(path, settings=LlamaCppSettings(type_k=type_k, type_v=type_v, flash_attn=flash_attn))
    t = time.perf_counter()
    parts = [metrics.position_metrics(r, gather(eng.logits(p.tokens), len(p.tokens))) for p, r in zip(prompts, ref)]
    seconds = time.perf_counter() - t
    pm = metrics.concat_metrics(parts)
    finite = np.asarray(pm["finite"], bool)
    kld = np.asarray(pm["kld"], float)[finite]
    cos = np.asarray(pm["cosine"], float)[finite]
    agree = np.asarray(pm["argmax_agree"], bool)
    nan = float("nan")
    return {"type_k": type_k, "type_v": type_v, "flash_attn": flash_attn, "flash_attn_ran": eng.flash_attn_ran,
            "positions": int(finite.size), "nonfinite": int((~finite).sum()),
            "kld_mean": float(kld.mean()) if kld.size else nan, "kld_p99": float(np.percentile(kld, 99)) if kld.size else nan,
            "kld_max": float(kld.max()) if kld.size else nan, "min_cosine": float(cos.min()) if cos.size else nan,
            "argmax_agreement": float(agree.mean()) if agree.size else nan, "seconds": round(seconds, 2)}


def run(models, rows=ROWS, log=lambda m: None) -> list[dict[str, Any]]:
    """Every (model, row) cell of the matrix, oracle run once per model; each dict also names
    ``model`` and ``vs_baseline`` (KLD mean over the baseline row's, None where either is 0 or NaN)."""
    from harness.engines.llamacpp import LlamaCppEngine
    from harness.fixtures.resolve import resolve_model
    from harness.measure.prompts import load_prompt_set, tokenize_prompts

    out = []
    for spec in models:
        path = resolve_model(spec)
        prompts = tokenize_prompts(load_prompt_set(None), LlamaCppEngine(path, tokenizer_only=True))
        t = time.perf_counter()
        ref = oracle_logits(path, prompts)
        log(f"{spec}: oracle {time.perf_counter() - t:.1f} s over {sum(len(p.tokens) for p in prompts)} positions")
        cells = []
        for row in rows:
            c = {"model": spec, **measure_row(path, prompts, ref, *row)}
            log(f"{spec} {row}: KLD mean {c['kld_mean']:.3g}, non-finite {c['nonfinite']}, flash attention {c['flash_attn_ran']}")
            cells.append(c)
        base = next((c["kld_mean"] for c in cells if (c["type_k"], c["type_v"], c["flash_attn"]) == BASELINE), nan_())
        for c in cells:
            ok = base > 0 and math.isfinite(base) and math.isfinite(c["kld_mean"])
            c["vs_baseline"] = c["kld_mean"] / base if ok else None
        out += cells
    return out


def nan_() -> float:
    """NaN (the baseline's KLD when the baseline row is not in ``rows``)."""
    return float("nan")


def markdown(cells: list[dict[str, Any]]) -> str:
    """The matrix as a Markdown table, one line per cell (docs/gates-matrix.md)."""
    head = ("| fixture | type_k | type_v | flash attention (asked → ran) | positions | non-finite | KLD mean | KLD p99 | KLD max "
            "| × baseline | min cosine | argmax agr |\n|---|---|---|---|---|---|---|---|---|---|---|---|")
    g = lambda v, spec: "—" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, spec)
    lines = [head]
    for c in cells:
        base = " **(baseline)**" if (c["type_k"], c["type_v"], c["flash_attn"]) == BASELINE else ""
        lines.append(f"| `{c['model']}` | {c['type_k']} | {c['type_v']} | {c['flash_attn']} → {c['flash_attn_ran']}{base} "
                     f"| {c['positions']} | {c['nonfinite']} | {g(c['kld_mean'], '.3g')} | {g(c['kld_p99'], '.3g')} "
                     f"| {g(c['kld_max'], '.3g')} | {g(c['vs_baseline'], '.3g')} | {g(c['min_cosine'], '.6f')} "
                     f"| {g(c['argmax_agreement'], '.4f')} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", action="append", help="fixture:NAME or a GGUF path (repeat); default: tiny-qwen35, tiny-qwen35moe")
    ap.add_argument("--markdown", action="store_true", help="print the Markdown table")
    ap.add_argument("--json", action="store_true", help="print the cells as one JSON line")
    a = ap.parse_args()
    cells = run(a.model or DEFAULT_MODELS, log=lambda m: print(m, file=sys.stderr, flush=True))
    if a.markdown:
        print(markdown(cells))
    if a.json or not a.markdown:
        print(json.dumps(cells))


if __name__ == "__main__":
    main()
