"""Seconds the reference cache saves (issue 47): the same parity cell twice with one fresh cache
folder, the first run computing llama.cpp's logits and storing them, the second reading them.

Used by ``benchmarks/run_all.py`` (section 10; ``--only reference-cache`` runs it alone). A sweep
or sign-off over N candidates on one model pays the cold run once and the warm one N − 1 times.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable


def measure(parity_probe: Callable[..., dict], common: list[str], work: Path, candidates: int = 4) -> dict[str, Any]:
    """``{"cold": run, "warm": run, "saved_per_candidate_s", "saved_sweep_s", "candidates",
    "entry_mb"}``: ``run`` is ``parity_probe``'s JSON (``main_s``, ``engine_s`` …) of a run with
    an empty cache folder and of the same run after it."""
    cache = work / "reference-cache"
    old = os.environ.get("HARNESS_REFERENCE_CACHE")
    os.environ["HARNESS_REFERENCE_CACHE"] = str(cache)
    try:
        cold = parity_probe(common + ["--ledger", str(work / "ev-cache-cold" / "ledger.jsonl")])
        warm = parity_probe(common + ["--ledger", str(work / "ev-cache-warm" / "ledger.jsonl")])
    finally:
        if old is None:
            os.environ.pop("HARNESS_REFERENCE_CACHE", None)
        else:
            os.environ["HARNESS_REFERENCE_CACHE"] = old
    saved = cold["main_s"] - warm["main_s"]
    return {"cold": cold, "warm": warm, "saved_per_candidate_s": saved, "saved_sweep_s": saved * (candidates - 1),
            "candidates": candidates, "entry_mb": sum(p.stat().st_size for p in cache.glob("*.f32")) / 2**20}


def section(r: dict[str, Any]) -> list[str]:
    """The Markdown lines of section 10."""
    c, w = r["cold"], r["warm"]
    return [
        "## 10. The reference cache: llama.cpp's logits computed once",
        "",
        "The section 2 cell (`fixture:tiny-qwen35-v248k`, oracle against llama.cpp) twice with one fresh cache folder "
        "(`$HARNESS_REFERENCE_CACHE`, `harness/runs/reference_cache.py`): the first run computes and stores the reference's rows, "
        "the second reads them (sha256 checked) instead of starting llama.cpp's logits worker. "
        "`benchmarks/bench_reference_cache.py` (`benchmarks/run_all.py --only reference-cache` runs this section alone).",
        "",
        "| | whole run s | llama.cpp s |",
        "|---|---:|---:|",
        f"| cold (computed, stored) | {c['main_s']:.1f} | {c['engine_s'].get('llama.cpp', 0):.1f} |",
        f"| warm (read from the cache) | {w['main_s']:.1f} | {w['engine_s'].get('llama.cpp', 0):.1f} |",
        "",
        f"Saved per candidate after the first: **{r['saved_per_candidate_s']:.1f} s**; a sweep of {r['candidates']} candidates on this cell "
        f"saves **{r['saved_sweep_s']:.1f} s**. Entries stored: {r['entry_mb']:.0f} MB (float32 rows).",
    ]
