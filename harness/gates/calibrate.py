"""Calibration: thresholds from measurement, and which gate catches which known-bad engine.

Known-good pairs (candidate vs llama.cpp at default settings, on the trained fixtures and the
quantized ladder of ``trained-qwen35-256``): the oracle, transformers (when the ``hf`` extra is
installed), and llama.cpp itself at other ``n_ubatch`` and thread counts. Known-bad pairs: every
mutant (``harness.engines.mutants``) against llama.cpp. n ≥ 5 prompts per pair (the shipped set).

Each gated number gets its threshold from the known-good floor with a margin, using a bootstrap
confidence interval taken **by prompt** (positions inside a prompt are correlated;
``scipy.stats.bootstrap`` resampling prompt indices):

- ``min_cosine`` = 1 − 2·(1 − lower CI of the good pairs' minimum per-position cosine);
- ``max_kld_mean`` / ``max_kld_p99`` = 2 × upper CI of the good pairs' KLD mean / p99;
- probe tolerances from llama.cpp's own self-consistency floor; localization bounds from
  llama.cpp-vs-oracle per-tensor NMSE/cosine on the F32 fixture.

Every threshold is written to thresholds.yaml with a ``measured`` basis (command, n, known-good
floor, known-bad values, model, date). Calibration refuses (``CalibrationRefused``, exit 1) when a
known-good pair spreads past its proposed threshold or when some mutant passes every gate, naming
the pairs. The printed matrix of known-bad pairs × gates shows which gate catches which.
"""

from __future__ import annotations

import datetime
import math
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import yaml
from scipy import stats

from harness.compare import metrics
from harness.compare.localize import localize_activations
from harness.compare.probes import (
    ProbeTolerance,
    probe_decode,
    probe_determinism,
    probe_split,
)
from harness.compare.prompts import load_prompt_set, tokenize_prompts
from harness.engines.base import gather
from harness.engines.llamacpp import LlamaCppEngine, LlamaCppSettings
from harness.engines.mutants import MUTANTS
from harness.engines.registry import resolve_engine
from harness.errors import HarnessError, Verdict
from harness.fixtures.resolve import resolve_model
from harness.gates.thresholds import load_thresholds
from harness.model.gguf_model import GGUFModel

MARGIN = 2.0
GATES = ("cosine", "kld_mean", "kld_p99", "probe_split", "probe_decode", "probe_determinism", "localize")


class CalibrationRefused(HarnessError):
    """Known-good pairs spread past a proposed threshold, or a mutant passes every gate (exit 1)."""

    verdict = Verdict.FAIL


@dataclass
class PairStats:
    """One pair's numbers over the prompt set: per-prompt arrays for the bootstrap and the
    whole-set statistics."""

    label: str
    good: bool
    model: str
    min_cosine: float
    kld_mean: float
    kld_p99: float
    per_prompt_min_cos: np.ndarray
    per_prompt_kld: list[np.ndarray]
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"label": self.label, "good": self.good, "model": self.model, "min_cosine": self.min_cosine,
                "kld_mean": self.kld_mean, "kld_p99": self.kld_p99, **self.extra}


class CachedReference:
    """llama.cpp logits per token sequence, computed once (every pair on a model shares them)."""

    def __init__(self, engine):
        self.engine = engine
        self.cache: dict[tuple[int, ...], np.ndarray] = {}

    def get(self, tokens: Sequence[int]) -> np.ndarray:
        key = tuple(tokens)
        if key not in self.cache:
            self.cache[key] = gather(self.engine.logits(tokens), len(tokens))
        return self.cache[key]


def measure_pair(label: str, good: bool, model: str, ref: CachedReference, cand, prompts: list[list[int]]) -> PairStats:
    """Per-position metrics of ``cand`` vs the cached reference over ``prompts``."""
    mins, klds = [], []
    for toks in prompts:
        r = ref.get(toks)
        c = gather(cand.logits(toks), len(toks))
        pm = metrics.position_metrics(r, c)
        cos = np.where(pm["finite"], pm["cosine"], -1.0)
        mins.append(float(np.min(cos)))
        klds.append(np.where(pm["finite"], pm["kld"], np.inf))
    allk = np.concatenate(klds)
    return PairStats(label, good, model, float(min(mins)), float(np.mean(allk)), float(np.quantile(allk, 0.99)),
                     np.array(mins), klds)


def bootstrap_by_prompt(pair: PairStats, stat: str, n_resamples: int = 999, seed: int = 0) -> tuple[float, float]:
    """95% percentile-bootstrap CI of ``stat`` (min_cosine | kld_mean | kld_p99), prompts resampled."""
    idx = np.arange(len(pair.per_prompt_min_cos))

    def f(sample):
        sample = np.asarray(sample, dtype=int)
        if stat == "min_cosine":
            return float(np.min(pair.per_prompt_min_cos[sample]))
        k = np.concatenate([pair.per_prompt_kld[i] for i in sample])
        return float(np.mean(k)) if stat == "kld_mean" else float(np.quantile(k, 0.99))

    res = stats.bootstrap((idx,), f, n_resamples=n_resamples, vectorized=False, method="percentile",
                          random_state=np.random.default_rng(seed), confidence_level=0.95)
    lo, hi = float(res.confidence_interval.low), float(res.confidence_interval.high)
    point = f(idx)
    # a degenerate resample distribution gives NaN bounds: fall back to the point value
    return (point if math.isnan(lo) else lo, point if math.isnan(hi) else hi)


def _round_up(x: float, digits: int = 2) -> float:
    if x <= 0:
        return x
    e = math.floor(math.log10(x)) - digits + 1
    q = x / 10**e
    return float(f"{math.ceil(q - 1e-9 * q) * 10**e:.{digits}g}")  # 1e-9: float noise is not a digit


def propose(goods: list[PairStats]) -> dict[str, dict[str, Any]]:
    """Proposed parity gates from known-good pairs (see module docstring)."""
    cos_lo = min(bootstrap_by_prompt(g, "min_cosine")[0] for g in goods)
    kmean_hi = max(bootstrap_by_prompt(g, "kld_mean")[1] for g in goods)
    kp99_hi = max(bootstrap_by_prompt(g, "kld_p99")[1] for g in goods)
    floor = min(g.min_cosine for g in goods)
    return {
        "min_cosine": {"value": round(1 - _round_up(max(MARGIN * (1 - cos_lo), 1e-6)), 8), "floor": floor, "ci": cos_lo},
        "max_kld_mean": {"value": _round_up(max(MARGIN * kmean_hi, 1e-7)), "floor": max(g.kld_mean for g in goods), "ci": kmean_hi},
        "max_kld_p99": {"value": _round_up(max(MARGIN * kp99_hi, 1e-7)), "floor": max(g.kld_p99 for g in goods), "ci": kp99_hi},
    }


def caught(pair: PairStats, gates: dict[str, dict[str, Any]], probe_tol: dict[str, float] | None = None) -> dict[str, bool]:
    """Which gates the pair violates (True = caught)."""
    out = {
        "cosine": pair.min_cosine < gates["min_cosine"]["value"],
        "kld_mean": pair.kld_mean > gates["max_kld_mean"]["value"],
        "kld_p99": pair.kld_p99 > gates["max_kld_p99"]["value"],
    }
    for name in ("probe_split", "probe_decode", "probe_determinism", "localize"):
        out[name] = bool(pair.extra.get(name, False))
    return out


@dataclass
class CalibrationPlan:
    """What to measure: models for the parity gates, the quantized ladder, engines."""

    base_model: str = "fixture:trained-qwen35"
    moe_model: str = "fixture:trained-qwen35moe"
    ladder: tuple[str, ...] = ("fixture:trained-qwen35-256", "fixture:trained-qwen35-256-Q8_0", "fixture:trained-qwen35-256-Q6_K", "fixture:trained-qwen35-256-Q4_K_M")
    mutants: tuple[str, ...] | None = None  # None: all
    include_transformers: bool = True


@dataclass
class CalibrationResult:
    """Measured pairs, proposed thresholds per model group, the known-bad × gates matrix."""

    goods: list[PairStats]
    bads: list[PairStats]
    gates: dict[str, dict[str, Any]]
    per_model: dict[str, dict[str, dict[str, Any]]]
    probes: dict[str, dict[str, Any]]
    localization: dict[str, dict[str, Any]]
    matrix: dict[str, dict[str, bool]]
    skipped: list[str]
    problems: list[str]


def _prompts(model_path, n_max_tokens: int = 256) -> list[list[int]]:

    ps = tokenize_prompts(load_prompt_set(None), LlamaCppEngine(model_path))
    return [p.tokens[:n_max_tokens] for p in ps]


@dataclass
class _ModelRun:
    """One model calibration measures on: its spec, file, token ids and cached llama.cpp logits."""

    model: str
    path: Path
    prompts: list[list[int]]
    ref: CachedReference


def _good_pairs(plan: CalibrationPlan, model: str, log: Callable[[str], None], skipped: list[str]) -> tuple[list[PairStats], _ModelRun]:
    """Phase 1, per F32 model: the known-good pairs (oracle, llama.cpp at n_ubatch 7 and at one
    thread, transformers when torch is installed) against llama.cpp at default settings."""
    path = resolve_model(model)
    run = _ModelRun(model, path, _prompts(path), CachedReference(LlamaCppEngine(path)))
    cands: list[tuple[str, Callable[[], Any]]] = [
        ("oracle", lambda: resolve_engine("oracle", path)),
        ("llama.cpp n_ubatch=7", lambda: LlamaCppEngine(path, settings=LlamaCppSettings(n_ubatch=7))),
        ("llama.cpp n_threads=1", lambda: LlamaCppEngine(path, settings=LlamaCppSettings(n_threads=1))),
    ]
    if plan.include_transformers:
        try:
            import torch  # noqa: F401

            cands.append(("transformers", lambda: resolve_engine("transformers", path)))
        except ImportError:
            skipped.append(f"transformers vs llama.cpp on {model}: the hf extra (torch) is not installed")
    out = []
    for label, make in cands:
        log(f"  good: {label} vs llama.cpp on {model}")
        out.append(measure_pair(f"{label} vs llama.cpp", True, model, run.ref, make(), run.prompts))
    return out, run


def _f32_gates(plan: CalibrationPlan, log: Callable[[str], None], skipped: list[str]) -> tuple[list[PairStats], dict[str, dict[str, Any]], _ModelRun, _ModelRun | None]:
    """Phase 1: the default parity gates, proposed from the known-good pairs on the F32 trained
    models (the MoE one skipped, with a reason, when it cannot be resolved)."""
    goods, base = _good_pairs(plan, plan.base_model, log, skipped)
    moe = None
    if plan.moe_model:
        try:
            resolve_model(plan.moe_model)
        except HarnessError as e:
            skipped.append(f"{plan.moe_model}: {e}")
        else:
            moe_goods, moe = _good_pairs(plan, plan.moe_model, log, skipped)
            goods += moe_goods
    return goods, propose(goods), base, moe


def _quant_rows(plan: CalibrationPlan, log: Callable[[str], None], skipped: list[str]) -> tuple[list[PairStats], dict[str, dict[str, dict[str, Any]]]]:
    """Phase 2: a per-quant row of gates from oracle vs llama.cpp on each model of the ladder
    (each good pair tagged with its ``quant_key``)."""
    goods: list[PairStats] = []
    per_model: dict[str, dict[str, dict[str, Any]]] = {}
    for model in plan.ladder:
        try:
            path = resolve_model(model)
        except HarnessError as e:
            skipped.append(f"{model}: {e}")
            continue
        prompts = _prompts(path)
        ref = CachedReference(LlamaCppEngine(path))
        log(f"  good: oracle vs llama.cpp on {model}")
        g = measure_pair("oracle vs llama.cpp", True, model, ref, resolve_engine("oracle", path), prompts)
        goods.append(g)
        per_model[f"quant:{GGUFModel(path).file_type}"] = propose([g])
        g.extra["quant_key"] = f"quant:{GGUFModel(path).file_type}"
    return goods, per_model


def _probe_floor(base: _ModelRun) -> dict[str, dict[str, Any]]:
    """Phase 3a: probe tolerances from llama.cpp's own disagreement with itself (split points,
    decode, n_ubatch 7 against the default) on the longest prompt, with 20× (cosine) and 50× (KLD)
    margins."""
    floor = {"min_cosine": 1.0, "max_kld": 0.0}
    ll = LlamaCppEngine(base.path)
    main = max(base.prompts, key=len)[:160]
    for r in (probe_split(ll, main, ProbeTolerance(min_cosine=-1, max_kld=math.inf)),
              probe_decode(ll, main[:80], ProbeTolerance(min_cosine=-1, max_kld=math.inf))):
        for c in r.comparisons:
            floor["min_cosine"] = min(floor["min_cosine"], c.min_cosine)
            floor["max_kld"] = max(floor["max_kld"], c.max_kld)
    ub = LlamaCppEngine(base.path, settings=LlamaCppSettings(n_ubatch=7))
    a = gather(ll.logits(main), len(main))
    b = gather(ub.logits(main), len(main))
    pm = metrics.position_metrics(a, b)
    floor["min_cosine"] = min(floor["min_cosine"], float(np.min(pm["cosine"])))
    floor["max_kld"] = max(floor["max_kld"], float(np.max(pm["kld"])))
    return {
        "min_cosine": {"value": round(1 - _round_up(max(20 * (1 - floor["min_cosine"]), 1e-6)), 8), "floor": floor["min_cosine"]},
        "max_kld": {"value": _round_up(max(50 * floor["max_kld"], 1e-6)), "floor": floor["max_kld"]},
    }


def _localization_floor(base: _ModelRun) -> tuple[dict[str, dict[str, Any]], list[int], dict[str, np.ndarray]]:
    """Phase 3b: localization bounds from llama.cpp (F32) against the oracle, tensor by tensor, on
    the first prompt's first 96 tokens, with a 100× margin; also the oracle's activations and the
    tokens, which the mutants' localization reuses."""
    loc_tokens = base.prompts[0][:96]
    oracle_acts = resolve_engine("oracle", base.path).activations(loc_tokens)
    ll_acts = LlamaCppEngine(base.path).activations(loc_tokens)
    ok_rows = [r for r in metrics.compare_activations(oracle_acts, ll_acts) if r["status"] == "ok"]
    nm_floor = max(r["nmse"] for r in ok_rows)
    cos_floor = min(r["cosine"] for r in ok_rows)
    localization = {
        "localize_max_nmse": {"value": _round_up(max(100 * nm_floor, 1e-6)), "floor": nm_floor, "n": len(ok_rows)},
        "localize_min_cosine": {"value": round(1 - _round_up(max(100 * (1 - cos_floor), 1e-4)), 8), "floor": cos_floor, "n": len(ok_rows)},
    }
    return localization, loc_tokens, oracle_acts


def _bad_pairs(plan: CalibrationPlan, base: _ModelRun, moe: _ModelRun | None, probes: dict[str, dict[str, Any]],
               localization: dict[str, dict[str, Any]], loc_tokens: list[int], oracle_acts: dict[str, np.ndarray],
               log: Callable[[str], None], skipped: list[str]) -> list[PairStats]:
    """Phase 4: every mutant (or ``plan.mutants``) against llama.cpp on the model whose arch it
    affects: the parity numbers, and whether the split, decode and determinism probes and the
    localization (at the proposed tolerances) catch it."""
    ptol = ProbeTolerance(min_cosine=probes["min_cosine"]["value"], max_kld=probes["max_kld"]["value"])
    bads = []
    for name in plan.mutants or tuple(MUTANTS):
        m = MUTANTS[name]
        if "qwen35" not in m.archs and moe is None:
            skipped.append(f"mutant:{name}: needs a qwen35moe model ({plan.moe_model} unavailable)")
            continue
        run = moe if "qwen35" not in m.archs else base
        log(f"  bad: mutant:{name} vs llama.cpp on {run.model}")
        eng = resolve_engine(f"mutant:{name}", run.path)
        p = measure_pair(f"mutant:{name}", False, run.model, run.ref, eng, run.prompts)
        toks = max(run.prompts, key=len)[:160]
        p.extra["probe_split"] = probe_split(eng, toks, ptol).verdict is Verdict.FAIL
        p.extra["probe_decode"] = probe_decode(eng, toks[:48], ptol).verdict is Verdict.FAIL
        p.extra["probe_determinism"] = probe_determinism(eng, toks[:64]).verdict is Verdict.FAIL
        mhp = GGUFModel(run.path).hparams
        o_acts = oracle_acts if run.path == base.path else resolve_engine("oracle", run.path).activations(loc_tokens)
        loc = localize_activations(mhp, o_acts, eng.activations(loc_tokens), localization["localize_max_nmse"]["value"],
                                   localization["localize_min_cosine"]["value"])
        p.extra["localize"] = loc.first is not None
        p.extra["first_divergence"] = loc.first.name if loc.first else None
        bads.append(p)
    return bads


def _refusals(goods: list[PairStats], bads: list[PairStats], gates: dict[str, dict[str, Any]],
              per_model: dict[str, dict[str, dict[str, Any]]]) -> tuple[dict[str, dict[str, bool]], list[str]]:
    """Phase 5: the known-bad × gates matrix, and the reasons to refuse: a mutant no gate catches,
    a known-good pair past the thresholds proposed for it (its quant row, else the default)."""
    problems = []
    matrix = {b.label: caught(b, gates) for b in bads}
    for b in bads:
        if not any(matrix[b.label].values()):
            problems.append(f"{b.label} passes every gate (min cosine {b.min_cosine:.6f}, KLD mean {b.kld_mean:.3g})")
    for g in goods:
        th = per_model.get(g.extra.get("quant_key", ""), gates)
        if g.min_cosine < th["min_cosine"]["value"] or g.kld_mean > th["max_kld_mean"]["value"] or g.kld_p99 > th["max_kld_p99"]["value"]:
            problems.append(f"known-good {g.label} on {g.model} spreads past the proposed thresholds "
                            f"(min cosine {g.min_cosine:.8f}, KLD mean {g.kld_mean:.3g}, p99 {g.kld_p99:.3g})")
    return matrix, problems


def calibrate(plan: CalibrationPlan, log: Callable[[str], None] = print) -> CalibrationResult:
    """Run every pair of ``plan`` and propose thresholds (does not write them), in five phases:
    F32 known-good pairs → default gates (``_f32_gates``); the quantized ladder → per-quant rows
    (``_quant_rows``); llama.cpp's own probe and localization floors (``_probe_floor``,
    ``_localization_floor``); every mutant as a known-bad pair (``_bad_pairs``); the catch matrix
    and the refusals (``_refusals``). See the module docstring for the arithmetic."""
    skipped: list[str] = []
    goods, gates, base, moe = _f32_gates(plan, log, skipped)
    ladder_goods, per_model = _quant_rows(plan, log, skipped)
    goods += ladder_goods
    probes = _probe_floor(base)
    localization, loc_tokens, oracle_acts = _localization_floor(base)
    bads = _bad_pairs(plan, base, moe, probes, localization, loc_tokens, oracle_acts, log, skipped)
    matrix, problems = _refusals(goods, bads, gates, per_model)
    return CalibrationResult(goods, bads, gates, per_model, probes, localization, matrix, skipped, problems)


def _basis(command: str, n: int, model: str, floor: float, bads: list[tuple[float, str]], note: str,
           threshold: float | None = None, lower_is_bad: bool = True) -> dict[str, Any]:
    """A measured basis. ``known_bad`` lists the known-bad values this gate separates (beyond
    ``threshold``), closest first; the ones it misses are named in the note."""
    vals = [(float(v), w) for v, w in bads if v is not None and math.isfinite(v)]
    if threshold is not None:
        sep = [(v, w) for v, w in vals if (v < threshold if lower_is_bad else v > threshold)]
        missed = [w for v, w in vals if (v, w) not in sep]
        if missed:
            note += f" Missed by this gate alone (caught by another): {', '.join(missed)}."
        vals = sep
    known_bad = [{"value": v, "what": w} for v, w in vals][:12]
    if not known_bad:
        known_bad = [{"value": float(floor), "what": "no known-bad value separated by this gate alone (see note)"}]
    return {"kind": "measured", "command": command, "n": int(n), "model": model, "date": datetime.date.today().isoformat(),
            "known_good_floor": float(floor), "known_bad": known_bad, "note": note}


def thresholds_document(res: CalibrationResult, command: str, commit: str | None, near_tie_margin: float = 0.25) -> dict[str, Any]:
    """The thresholds.yaml content with measured bases for every gate calibration measured."""
    base = res.goods[0].model
    n_pos = sum(int(sum(k.size for k in g.per_prompt_kld)) for g in res.goods if g.model == base)
    goods_txt = "; ".join(f"{g.label} on {g.model}: min cos {g.min_cosine:.8f}, KLD mean {g.kld_mean:.3g}, p99 {g.kld_p99:.3g}" for g in res.goods)
    commit_txt = f" harness commit {commit}." if commit else ""
    g = res.gates
    bad_cos = [(b.min_cosine, b.label) for b in sorted(res.bads, key=lambda b: -b.min_cosine)]
    bad_km = [(b.kld_mean, b.label) for b in sorted(res.bads, key=lambda b: b.kld_mean)]
    bad_kp = [(b.kld_p99, b.label) for b in sorted(res.bads, key=lambda b: b.kld_p99)]
    doc: dict[str, Any] = {
        "schema": "harness-thresholds/v1",
        "report_only": {"near_tie_margin": near_tie_margin},
        "gates": {
            "min_positions": {"value": 64, "basis": {"kind": "declared", "who": "harness maintainers (issue 5)",
                                                      "why": "Fewest positions over the whole prompt set for a cosine minimum to mean anything; below it the cell is UNMEASURED, not PASS.",
                                                      "date": "2026-11-29"}},
            "min_cosine": {"value": g["min_cosine"]["value"], "basis": _basis(command, n_pos, base, g["min_cosine"]["floor"], bad_cos,
                           f"1 - {MARGIN}x(1 - lower 95% bootstrap CI by prompt {g['min_cosine']['ci']:.8f}) of the known-good floor over F32 trained models. Known-good: {goods_txt}.{commit_txt}",
                           g["min_cosine"]["value"], True)},
            "max_kld_mean": {"value": g["max_kld_mean"]["value"], "basis": _basis(command, n_pos, base, g["max_kld_mean"]["floor"], bad_km,
                             f"{MARGIN}x upper 95% bootstrap CI by prompt ({g['max_kld_mean']['ci']:.3g}) of the known-good KLD mean; catches scale errors cosine cannot see.{commit_txt}",
                             g["max_kld_mean"]["value"], False)},
            "max_kld_p99": {"value": g["max_kld_p99"]["value"], "basis": _basis(command, n_pos, base, g["max_kld_p99"]["floor"], bad_kp,
                            f"{MARGIN}x upper 95% bootstrap CI by prompt ({g['max_kld_p99']['ci']:.3g}) of the known-good KLD p99 (tail).{commit_txt}",
                            g["max_kld_p99"]["value"], False)},
        },
        "probes": {
            "min_cosine": {"value": res.probes["min_cosine"]["value"], "basis": _basis(command, 1, base, res.probes["min_cosine"]["floor"],
                           [(0.0, b.label) for b in res.bads if b.extra.get("probe_split")],
                           "llama.cpp's own floor across split points, decode and n_ubatch 7 (20x margin in 1-cosine); known-bad: mutants the split probe fails." + commit_txt)},
            "max_kld": {"value": res.probes["max_kld"]["value"], "basis": _basis(command, 1, base, res.probes["max_kld"]["floor"],
                        [(1.0, b.label) for b in res.bads if b.extra.get("probe_split")],
                        "50x llama.cpp's own max KLD across split points, decode and n_ubatch 7." + commit_txt)},
            "localize_max_nmse": {"value": res.localization["localize_max_nmse"]["value"], "basis": _basis(command, res.localization["localize_max_nmse"]["n"], base,
                                  res.localization["localize_max_nmse"]["floor"], [(1.0, f"{b.label} (first divergence {b.extra.get('first_divergence')})") for b in res.bads if b.extra.get("localize")],
                                  "100x the largest per-tensor NMSE of llama.cpp (F32) against the oracle." + commit_txt)},
            "localize_min_cosine": {"value": res.localization["localize_min_cosine"]["value"], "basis": _basis(command, res.localization["localize_min_cosine"]["n"], base,
                                    res.localization["localize_min_cosine"]["floor"], [(0.0, b.label) for b in res.bads if b.extra.get("localize")],
                                    "1 - 100x(1 - smallest per-tensor cosine of llama.cpp (F32) against the oracle), at most 0.9999." + commit_txt)},
        },
        "models": {},
    }
    for key, gm in res.per_model.items():
        good = next(x for x in res.goods if x.extra.get("quant_key") == key)
        model = good.model
        n = int(sum(k.size for k in good.per_prompt_kld))
        doc["models"][key] = {"gates": {
            "min_cosine": {"value": gm["min_cosine"]["value"], "basis": _basis(command, n, model, gm["min_cosine"]["floor"], bad_cos,
                           f"per-quant row for every {key.split(':')[1]} model, measured on {model}: oracle (exact dequantized weights) vs llama.cpp, which quantizes activations; 1 - {MARGIN}x(1 - lower CI {gm['min_cosine']['ci']:.8f}). Known-bad values are the mutants' on {base} (F32).{commit_txt}",
                           gm["min_cosine"]["value"], True)},
            "max_kld_mean": {"value": gm["max_kld_mean"]["value"], "basis": _basis(command, n, model, gm["max_kld_mean"]["floor"], bad_km,
                             f"per-quant row, {MARGIN}x upper CI {gm['max_kld_mean']['ci']:.3g}.{commit_txt}", gm["max_kld_mean"]["value"], False)},
            "max_kld_p99": {"value": gm["max_kld_p99"]["value"], "basis": _basis(command, n, model, gm["max_kld_p99"]["floor"], bad_kp,
                            f"per-quant row, {MARGIN}x upper CI {gm['max_kld_p99']['ci']:.3g}.{commit_txt}", gm["max_kld_p99"]["value"], False)},
        }}
    return doc


def write_thresholds(doc: dict[str, Any], path: str | Path) -> Path:
    """Write ``doc`` as thresholds.yaml (header comment + YAML) atomically, then validate it by
    loading it back (``InvalidInput`` if it does not validate)."""
    path = Path(path)
    header = (
        "# Every number that gates a verdict, each with its basis (docs/design.md, \"Thresholds\").\n"
        "# Written by `harness calibrate` (harness/gates/calibrate.py): measured bases name the command, n, the\n"
        "# known-good floor and the known-bad values each threshold separates. Schema:\n"
        "# harness/schemas/thresholds.schema.json. Edit by re-running calibration, or replace a value with a\n"
        "# declared basis (who, why) — a number without a basis refuses to gate (exit 2).\n"
    )
    text = header + yaml.safe_dump(doc, sort_keys=False, width=100, allow_unicode=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".thresholds.", suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        f.write(text)
    try:
        load_thresholds(tmp)
    except Exception:
        os.unlink(tmp)
        raise
    os.replace(tmp, path)
    return path
