"""Fitting rows: the bootstrap by prompt, ``propose`` (the rule of ``harness.runs.calibrate``), the
probe tolerances, which gate catches which known-bad pair, and the consistency checks that make
calibration refuse. Pure functions of measured ``PairStats``."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from harness.runs.calibrate.plan import CLASS_MEMBERS, MARGIN, MIN_STEP, NEEDS_REAL_ENGINE, PROBE_MIN_STEP, RELEASE


# ------------------------------------------------------------------------------- measuring
@dataclass
class PairStats:
    """One pair's numbers over the prompt set: per-prompt arrays for the bootstrap and the
    whole-set statistics. ``compute_class`` is the candidate's class; ``weights`` the model's
    ``weights_key``."""

    label: str
    good: bool
    model: str
    min_cosine: float
    kld_mean: float
    kld_p99: float
    per_prompt_min_cos: np.ndarray
    per_prompt_kld: list[np.ndarray]
    extra: dict[str, Any] = field(default_factory=dict)
    compute_class: str = "f64"
    weights: str = ""

    @property
    def n(self) -> int:
        return int(sum(k.size for k in self.per_prompt_kld))

    def to_dict(self) -> dict[str, Any]:
        return {"label": self.label, "good": self.good, "model": self.model, "class": self.compute_class,
                "weights": self.weights, "min_cosine": self.min_cosine, "kld_mean": self.kld_mean,
                "kld_p99": self.kld_p99, **{k: v for k, v in self.extra.items() if k != "dims"}}


def bootstrap_by_prompt(pair: PairStats, stat: str, n_resamples: int = 999, seed: int = 0) -> tuple[float, float]:
    """95% percentile-bootstrap CI of ``stat`` (min_cosine | kld_mean | kld_p99), prompts resampled."""
    idx = np.arange(len(pair.per_prompt_min_cos))

    def f(sample):
        sample = np.asarray(sample, dtype=int)
        if stat == "min_cosine":
            return float(np.min(pair.per_prompt_min_cos[sample]))
        k = np.concatenate([pair.per_prompt_kld[i] for i in sample])
        return float(np.mean(k)) if stat == "kld_mean" else float(np.quantile(k, 0.99))

    from scipy import stats  # here, not at import: a parity run imports this module (gates.subject) but rarely calibrates

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


def propose(goods: list[PairStats], floor_cosine: float = RELEASE["min_cosine"]["value"]) -> dict[str, dict[str, Any]]:
    """Proposed gates from known-good pairs (module docstring); ``min_cosine`` never below
    ``floor_cosine`` (the release gate: a row may tighten it, never loosen it)."""
    cos_lo = min(bootstrap_by_prompt(g, "min_cosine")[0] for g in goods)
    kmean_hi = max(bootstrap_by_prompt(g, "kld_mean")[1] for g in goods)
    kp99_hi = max(bootstrap_by_prompt(g, "kld_p99")[1] for g in goods)
    cos = max(round(1 - _round_up(max(MARGIN * (1 - cos_lo), MIN_STEP["min_cosine"])), 8), floor_cosine)
    return {
        "min_cosine": {"value": cos, "floor": min(g.min_cosine for g in goods), "ci": cos_lo},
        "max_kld_mean": {"value": _round_up(max(MARGIN * kmean_hi, MIN_STEP["max_kld_mean"])), "floor": max(g.kld_mean for g in goods),
                         "ci": kmean_hi},
        "max_kld_p99": {"value": _round_up(max(MARGIN * kp99_hi, MIN_STEP["max_kld_p99"])), "floor": max(g.kld_p99 for g in goods),
                        "ci": kp99_hi},
    }


def propose_probes(floor_cos: float, floor_kld: float, cls: str | None = None,
                   min_step: dict[str, tuple[float, float]] | None = None) -> dict[str, dict[str, Any]]:
    """Probe tolerances from an engine class's own self-consistency floor (20× in 1−cosine,
    50× in KLD, with the smallest steps ``min_step`` (default ``PROBE_MIN_STEP``) so an exact
    engine is not held to zero)."""
    step_cos, step_kld = (PROBE_MIN_STEP if min_step is None else min_step).get(cls or "", (1e-6, 1e-6))
    return {
        "min_cosine": {"value": round(1 - _round_up(max(20 * (1 - floor_cos), step_cos)), 10), "floor": floor_cos},
        "max_kld": {"value": _round_up(max(50 * floor_kld, step_kld)), "floor": floor_kld},
    }


def caught(pair: PairStats, gates: dict[str, dict[str, Any]], probes: dict[str, dict[str, Any]] | None = None) -> dict[str, bool]:
    """Which gates the pair violates (True = caught). With ``probes`` (a class's probe
    tolerances), the split/decode probes are judged by them from the pair's worst recorded
    comparison (``extra["probe_split_worst"]`` = (min cosine, max KLD)); else by the recorded
    verdicts."""
    out = {
        "cosine": pair.min_cosine < gates["min_cosine"]["value"],
        "kld_mean": pair.kld_mean > gates["max_kld_mean"]["value"],
        "kld_p99": pair.kld_p99 > gates["max_kld_p99"]["value"],
    }
    for name in ("probe_split", "probe_decode", "probe_determinism", "localize"):
        worst = pair.extra.get(f"{name}_worst")
        if probes is not None and worst is not None:
            out[name] = worst[0] < probes["min_cosine"]["value"] or worst[1] > probes["max_kld"]["value"]
        else:
            out[name] = bool(pair.extra.get(name, False))
    return out


def rows_from_goods(goods: list[PairStats], classes: Sequence[str], use_torch: bool) -> tuple[list[dict[str, Any]], list[str]]:
    """One row per (weights key × class × architecture) of ``classes`` from the pairs measured on
    files with that key and ``general.architecture`` (an MoE file's known-good floor is its own:
    ``tiers.Row.misfit``); a bf16/f16 row needs a real engine of the class, not only the emulation."""
    rows, skipped = [], []
    for weights, arch in dict.fromkeys((g.weights, g.extra["dims"]["arch"]) for g in goods):
        for cls in classes:
            members = [g for g in goods if g.weights == weights and g.extra["dims"]["arch"] == arch
                       and g.compute_class in CLASS_MEMBERS[cls]]
            if not members:
                continue
            if any(c in NEEDS_REAL_ENGINE for c in CLASS_MEMBERS[cls]) and not use_torch:
                skipped.append(f"class {cls} on weights {weights} ({arch}): no real engine of the class (pip install -e .[hf]); "
                               "the emulation alone does not make a row")
                continue
            low = [g for g in members if not g.min_cosine >= RELEASE["min_cosine"]["value"]]
            if low:  # a row its own known-good pair fails is never written (issue 59)
                g = min(low, key=lambda x: x.min_cosine if np.isfinite(x.min_cosine) else -np.inf)
                skipped.append(f"class {cls} on weights {weights} ({arch}): known-good pair {g.label} measures cosine "
                               f"{g.min_cosine:.5f}, below the release floor {RELEASE['min_cosine']['value']:g}; no row written "
                               "(a row its own known-good pair fails; where the reference is off the exact oracle, the release "
                               "gate judges those positions against the oracle, docs/gates.md)")
                continue
            rows.append({"weights": weights, "class": cls, "arch": arch, "goods": members, "gates": propose(members),
                         "file_types": sorted({g.extra["file_type"] for g in members}),
                         "basis_models": list({g.extra["dims"]["name"]: g.extra["dims"] for g in members}.values())})
    return rows, skipped


def class_detection(bads: list[PairStats], rows: list[dict[str, Any]], probes: dict[str, dict[str, Any]]) -> dict[str, dict[str, str]]:
    """Per class, each mutant ``caught`` (by the class's row on F32 weights for the architecture
    it ran on, or by a probe with that class's tolerances, or by localization) or ``below the
    class floor`` (its logits are within what a correct engine of that class produces), with its
    numbers."""
    out: dict[str, dict[str, str]] = {}
    for cls in dict.fromkeys(r["class"] for r in rows if r["weights"] == "F32"):
        col = {}
        for b in bads:
            r = _f32_row(rows, cls, b)
            if r is None:
                continue
            c = caught(b, r["gates"], probes.get(r["class"]))
            by = [g for g, hit in c.items() if hit]
            nums = f"min cos {b.min_cosine:.6f}, KLD mean {b.kld_mean:.3g}"
            col[b.label] = (f"caught by {', '.join(by)}" if by else "below the class floor") + f" ({nums})"
        out[cls] = col
    return out


def _f32_row(rows: list[dict[str, Any]], cls: str, bad: PairStats) -> dict[str, Any] | None:
    """The class's F32 row for the architecture ``bad`` ran on (any F32 row of the class when the
    pair does not say)."""
    f32 = [r for r in rows if r["weights"] == "F32" and r["class"] == cls]
    return next((r for r in f32 if r.get("arch") == bad.extra.get("arch")), f32[0] if f32 else None)


def consistency_problems(goods: list[PairStats], bads: list[PairStats], rows: list[dict[str, Any]],
                         probes: dict[str, dict[str, Any]]) -> list[str]:
    """Known-good pairs past their own row, and mutants no gate catches at f64/f32 on F32."""
    problems = []
    for r in rows:
        g = r["gates"]
        for p in r["goods"]:
            if p.min_cosine < g["min_cosine"]["value"] or p.kld_mean > g["max_kld_mean"]["value"] or p.kld_p99 > g["max_kld_p99"]["value"]:
                problems.append(f"known-good {p.label} on {p.model} spreads past the row {r['weights']} × {r['class']} "
                                f"(min cosine {p.min_cosine:.8f}, KLD mean {p.kld_mean:.3g}, p99 {p.kld_p99:.3g})")
    for cls in ("f64", "f32"):
        for b in bads:
            r = _f32_row(rows, cls, b)
            if r is not None and not any(caught(b, r["gates"], probes.get(cls)).values()):
                problems.append(f"{b.label} passes every gate of the {cls} row (min cosine {b.min_cosine:.6f}, KLD mean {b.kld_mean:.3g})")
    return problems
