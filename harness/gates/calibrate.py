"""Calibration: the calibrated tier's rows from measurement, and which gate catches which
known-bad engine.

Known-good pairs are candidate vs llama.cpp (the reference, default settings), one set of real
engines per compute class (``KNOWN_GOOD``):

- ``f64``: the exact oracle;
- ``f32``: llama.cpp itself at another ``n_ubatch`` and thread count, and transformers in float32
  (which, unlike llama.cpp, does not quantize activations on quantized files: without it an f32
  row would hold every other correct f32 engine to llama.cpp's own rounding);
- ``bf16`` / ``f16``: the oracle's low-precision emulation (``oracle-bf16`` / ``oracle-f16``) and
  transformers in bfloat16 / float16 — a class's floor is the maximum over both, never the
  emulation alone, so calibration refuses to write a bf16/f16 row without transformers;
- ``mixed``: every engine of the bf16, f16 and f32 classes (the loosest of them).

They run on the F32 trained fixtures and on every shipped file type of the 256-wide trained bases
(``fixtures.synthetic.TRAINED_LADDER``, dense and MoE); each (weights key × class) gets one row,
its gates proposed by ``propose`` from the pairs measured on files with that key. Known-bad
pairs: every mutant (``harness.engines.mutants``) on the F32 trained fixtures.

Rule (``propose``), with bootstrap confidence intervals taken **by prompt** (positions inside a
prompt are correlated; ``scipy.stats.bootstrap`` resampling prompt indices):
``min_cosine`` = 1 − MARGIN·(1 − lower CI of the good pairs' minimum per-position cosine), never
below the release floor; ``max_kld_mean`` / ``max_kld_p99`` = MARGIN × upper CI of the good pairs'
KLD mean / p99; none tighter than ``MIN_STEP`` (float32 noise differs between models). Probe
tolerances per class from the class engines' own self-consistency floor
(split and decode vs whole). Localization bounds from llama.cpp-vs-oracle per-tensor NMSE/cosine.

``calibrate_subject`` measures one row on the subject itself (``harness calibrate --model``):
the same rule over a bounded number of positions, used where no committed row fits.

Calibration refuses (``CalibrationRefused``, exit 1) when a known-good pair spreads past its
row, or when a mutant passes every gate at f32/f64, naming them.
"""

from __future__ import annotations

import datetime
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import yaml

from harness.compare import metrics
from harness.engines.base import COMPUTE_CLASSES, gather
from harness.errors import HarnessError, InvalidInput, Verdict
from harness.gates.tiers import Row

MARGIN = 2.0
MIN_STEP = {"min_cosine": 1e-5, "max_kld_mean": 1e-6, "max_kld_p99": 1e-5}
"""The smallest distance from a perfect match a calibrated gate may demand (in 1 − cosine, and in
KLD nats), whatever the known-good pairs measured. At float32 the known-good spread is rounding
noise, and that noise differs from model to model by more than ``MARGIN``: on
``trained-qwen35-heldout`` (a model no row was measured on) llama.cpp at n_ubatch 7 against
llama.cpp reached 1 − 3.1e-6 cosine, KLD mean 3.9e-7 and p99 4.2e-6, where the rows' basis models
gave at most 1 − 5e-7 and 8.6e-8 (docs/gates.md, "The rule"). The steps sit about 3× above that
and still 100× or more below the nearest known-bad value at F32 (cosine 0.998, KLD mean 9.9e-4)."""
GATES = ("cosine", "kld_mean", "kld_p99", "probe_split", "probe_decode", "probe_determinism", "localize")
MOE_TIE_WHY = (
    "On a model with experts, a position below the release floor is excused when the reference's own router logits "
    "there (ffn_moe_logits-N, any MoE layer) have a k-th to (k+1)-th gap of at most this many logits: a correct "
    "engine may keep another expert there, and in a small model one expert swapped moves the logits far. On a "
    "quantized file llama.cpp quantizes the activations of every quantized matmul (Q8_0 / Q8_K), which moves its "
    "router logits by about 1e-2 against exact arithmetic. Measured on fixture:trained-qwen35moe-256 (4 experts, 2 "
    "used) over the shipped prompts' 1,479 positions and its 12 file types: the exact oracle falls below 0.98 at "
    "one position on IQ4_XS (cosine 0.9765, llama.cpp router gap 0.026), oracle-bf16 there too and on Q4_K_M "
    "(0.927, gap 0.0018), transformers bfloat16 on Q4_K_M (0.927, gap 0.0018); 0.05 is about 2x the widest of them."
    " 23 % of positions have a gap at most 0.05, so the excuse is bounded by moe_router_max_excused, and the "
    "positions it excuses are named on the release line and left out of the calibrated tier too, whose KLD gates "
    "judge the rest."
)
MOE_SHARE_WHY = (
    "At most this share of a cell's positions (rounded down, at least one) may be excused at a router near-tie; "
    "past it none is, and the release gate judges every position. The known-good engines on fixture:trained-"
    "qwen35moe-256 needed at most 1 of 1,479 (0.07 %); the MoE mutants there fall below 0.98 at 1-6 (mutant:moe-"
    "weights-unnormalized) and 14-19 (mutant:shexp-gate-ignored) positions per file type, many of them where the "
    "router is not near-tied, so 1 % keeps a fault that shows at many positions from being excused. Where every "
    "such position of a fault is near-tied (mutant:moe-weights-unnormalized on IQ4_XS and Q6_K), the release gate "
    "excuses them and the calibrated tier is what catches it."
)
RELEASE = {
    "min_cosine": {"value": 0.98, "basis": {
        "kind": "declared", "who": "harness maintainers (the product's release gate)",
        "why": "Per-position logit cosine >= 0.98 over >= 64 positions is the product's release gate: a floor every engine "
               "of every precision must meet on every file. Calibrated rows tighten it; none may loosen it.",
        "date": "2026-11-30"}},
    "min_positions": {"value": 64, "basis": {
        "kind": "declared", "who": "harness maintainers (the product's release gate)",
        "why": "Fewest positions over the whole prompt set for a cosine minimum to mean anything; below it the cell is "
               "UNMEASURED, not PASS.", "date": "2026-11-30"}},
    "moe_router_tie_gap": {"value": 0.05, "basis": {
        "kind": "declared", "who": "harness maintainers (MoE router near-ties at the release gate; harness/compare/near_ties.py)",
        "why": MOE_TIE_WHY, "date": "2026-12-01"}},
    "moe_router_max_excused": {"value": 0.01, "basis": {
        "kind": "declared", "who": "harness maintainers (MoE router near-ties at the release gate; harness/compare/near_ties.py)",
        "why": MOE_SHARE_WHY, "date": "2026-12-01"}},
}
"""The release gate as thresholds.yaml declares it (``moe_router_*``: the positions it excuses on
an MoE model, ``harness.compare.near_ties.release_excuses``)."""


class CalibrationRefused(HarnessError):
    """Known-good pairs spread past a proposed threshold, or a mutant passes every gate (exit 1)."""

    verdict = Verdict.FAIL


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


class CachedReference:
    """llama.cpp logits (and router activations) per token sequence, computed once: every pair
    on a model shares them."""

    def __init__(self, engine):
        self.engine = engine
        self.cache: dict[tuple[int, ...], np.ndarray] = {}
        self.acts: dict[tuple[tuple[int, ...], tuple[str, ...]], dict[str, np.ndarray]] = {}

    def activations(self, tokens: Sequence[int], names: Sequence[str]) -> dict[str, np.ndarray]:
        """``engine.activations(tokens, names=names)``, once per (tokens, names)."""
        key = (tuple(tokens), tuple(names))
        if key not in self.acts:
            self.acts[key] = self.engine.activations(list(tokens), names=list(names))
        return self.acts[key]

    def get(self, tokens: Sequence[int]) -> np.ndarray:
        key = tuple(tokens)
        if key not in self.cache:
            self.cache[key] = gather(self.engine.logits(tokens), len(tokens))
        return self.cache[key]


@dataclass
class RouterFlips:
    """How a known-good pair on an MoE model is measured the way ``harness parity`` judges it
    (``harness.compare.near_ties``): each prompt up to the first position where the candidate
    keeps other experts than llama.cpp, when llama.cpp's router gap there is at most
    ``max_gap`` (thresholds.yaml ``probes.moe_router_max_gap``); a flip where the router is not
    near-tied is measured like any other position, so it would widen the row and show."""

    n_layer: int
    n_expert_used: int
    max_gap: float
    log: Callable[[str], None] = print

    def cut(self, ref: Any, cand: Any, toks: Sequence[int], label: str) -> int | None:
        """The position the prompt's comparison ends at, or None (the whole prompt)."""
        from harness.compare import near_ties
        from harness.errors import HarnessError

        try:
            f, gap = near_ties.first_flip(ref, cand, toks, self.n_layer, self.n_expert_used)
        except (HarnessError, ValueError) as e:
            self.log(f"    {label}: router logits not compared ({str(e).splitlines()[0][:120]}): whole prompt measured")
            return None
        if f is None:
            return None
        if not gap <= self.max_gap:
            self.log(f"    {label}: keeps other experts from position {f} where llama.cpp's router gap is {gap:.3g} "
                     f"(> {self.max_gap:g}): measured, not cut")
            return None
        self.log(f"    {label}: keeps other experts from position {f} of {len(toks)} (router gap {gap:.2g}): measured up to it")
        return f


@dataclass
class ReleaseExcuses:
    """How a known-good pair on an MoE model is measured the way ``harness parity``'s release gate
    judges it (``harness.compare.near_ties.release_excuses``): a position below the release floor
    where llama.cpp's router gap is at most ``max_gap`` is left out, when such positions are at
    most ``max_share`` of the pair's positions; past that share none is, and the row shows them."""

    n_layer: int
    n_expert_used: int
    max_gap: float
    max_share: float
    floor: float = RELEASE["min_cosine"]["value"]
    log: Callable[[str], None] = print

    def candidates(self, ref: Any, toks: Sequence[int], pm: dict[str, np.ndarray]) -> np.ndarray:
        """Indices of the prompt's positions (of ``pm``, maybe cut) below the floor at a near-tie."""
        from harness.compare import near_ties

        below = np.flatnonzero(pm["finite"] & (pm["cosine"] < self.floor))
        if not below.size:
            return below
        gaps = near_ties.router_gaps(ref, toks, self.n_layer, self.n_expert_used)
        return below[gaps[below] <= self.max_gap]

    def decide(self, found: list[np.ndarray], n_positions: int, label: str) -> list[np.ndarray]:
        """``found`` (per prompt) when within the share, else nothing excused (logged)."""
        from harness.compare import near_ties

        n = sum(f.size for f in found)
        if n and n > near_ties.allowed_excuses(n_positions, self.max_share):
            self.log(f"    {label}: {n} positions below {self.floor:g} at a router near-tie, more than "
                     f"{self.max_share:.0%} of {n_positions}: none left out")
            return [np.zeros(0, int) for _ in found]
        if n:
            self.log(f"    {label}: {n} position(s) below {self.floor:g} at a router near-tie (gap ≤ {self.max_gap:g}) left out, "
                     "as the release gate excuses them")
        return found


def release_excuses(hp: Any, log: Callable[[str], None] = print) -> ReleaseExcuses | None:
    """The release gate's near-tie excuses as ``RELEASE`` declares them, for a model with experts
    (``hp``: its ``HParams``); None for a dense model."""
    if hp.n_expert <= 0:
        return None
    return ReleaseExcuses(hp.n_layer, hp.n_expert_used, float(RELEASE["moe_router_tie_gap"]["value"]),
                          float(RELEASE["moe_router_max_excused"]["value"]), log=log)


def measure_pair(label: str, good: bool, model: str, ref: CachedReference, cand, prompts: list[list[int]],
                 flips: RouterFlips | None = None, excuses: ReleaseExcuses | None = None) -> PairStats:
    """Per-position metrics of ``cand`` vs the cached reference over ``prompts``; the pair's class
    is the candidate's declared ``compute_class`` (``f64`` when none: the oracle's mutants).
    ``flips``: a known-good pair on an MoE model, each prompt measured up to its router flip
    (``RouterFlips``; ``extra["router_flips"]`` lists them). ``excuses``: a known-good pair on an
    MoE model, the positions the release gate would excuse left out (``ReleaseExcuses``;
    ``extra["release_excused"]`` counts them)."""
    pms, cut_at, found = [], [], []
    for i, toks in enumerate(prompts):
        pm = metrics.position_metrics(ref.get(toks), gather(cand.logits(toks), len(toks)))
        f = flips.cut(ref, cand, toks, label) if flips is not None else None
        if f is not None:
            cut_at.append({"prompt_index": i, "position": f, "positions": len(toks)})
            pm = {k: v[:f] for k, v in pm.items()}
        pms.append(pm)
        found.append(excuses.candidates(ref, toks, pm) if excuses is not None else np.zeros(0, int))
    if excuses is not None:
        found = excuses.decide(found, sum(pm["cosine"].size for pm in pms), label)
    mins, klds = [], []
    for pm, drop in zip(pms, found):
        if drop.size:
            keep = np.setdiff1d(np.arange(pm["cosine"].size), drop)
            pm = {k: v[keep] for k, v in pm.items()}
        if not pm["cosine"].size:
            continue
        cos = np.where(pm["finite"], pm["cosine"], -1.0)
        mins.append(float(np.min(cos)))
        klds.append(np.where(pm["finite"], pm["kld"], np.inf))
    allk = np.concatenate(klds)
    pair = PairStats(label, good, model, float(min(mins)), float(np.mean(allk)), float(np.quantile(allk, 0.99)),
                     np.array(mins), klds, compute_class=cand.info.compute_class or "f64")
    if cut_at:
        pair.extra["router_flips"] = cut_at
    if sum(f.size for f in found):
        pair.extra["release_excused"] = int(sum(f.size for f in found))
    return pair


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


PROBE_MIN_STEP = {"f64": (1e-8, 1e-9)}
"""Per class, the smallest probe tolerance (1 − cosine, KLD) where the class engines' own
self-consistency floor is below it; ``(1e-6, 1e-6)`` for a class not listed. An f64 engine fed in
pieces differs from itself fed whole only by float64 summation order, far below 1e-12 after its
logits are rounded to float32 (the oracle's measured floor is cosine 1.0, KLD 0), so 1e-6 would let
a state kept in a narrower format pass: f16 rounding of the recurrent state every 8 decode calls
reaches KLD 1.7e-8 on the default model (``tests/test_state_faults.py``)."""


def propose_probes(floor_cos: float, floor_kld: float, cls: str | None = None) -> dict[str, dict[str, Any]]:
    """Probe tolerances from an engine class's own self-consistency floor (20× in 1−cosine,
    50× in KLD, with the smallest steps ``PROBE_MIN_STEP`` so an exact engine is not held to zero)."""
    step_cos, step_kld = PROBE_MIN_STEP.get(cls or "", (1e-6, 1e-6))
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


def _worst(result) -> tuple[float, float] | None:
    """(min cosine, max KLD) over a probe's comparisons (None: nothing compared)."""
    comps = [c for c in result.comparisons if c.min_cosine is not None]
    if not comps:
        return None
    return min(c.min_cosine for c in comps), max(c.max_kld for c in comps)


# ------------------------------------------------------------------------------- the plan
def _llama(path, **settings):
    from harness.engines.llamacpp import LlamaCppEngine, LlamaCppSettings

    return LlamaCppEngine(path, settings=LlamaCppSettings(**settings))


def _oracle(path):
    from harness.engines.oracle import load_oracle

    return load_oracle(path)


def _lowp(cls):
    def make(path):
        from harness.engines.oracle.lowp import load_lowp_oracle

        return load_lowp_oracle(path, cls)
    return make


def _transformers(dtype):
    def make(path):
        from harness.engines.transformers_engine import load_transformers

        return load_transformers(path, dtype=dtype)
    return make


KNOWN_GOOD: dict[str, list[tuple[str, Callable[[Path], Any], bool]]] = {
    "f64": [("oracle", _oracle, False)],
    "f32": [("llama.cpp n_ubatch=7", lambda p: _llama(p, n_ubatch=7), False),
            ("llama.cpp n_threads=1", lambda p: _llama(p, n_threads=1), False),
            ("transformers float32", _transformers("float32"), True)],
    "bf16": [("oracle-bf16", _lowp("bf16"), False), ("transformers bfloat16", _transformers("bfloat16"), True)],
    "f16": [("oracle-f16", _lowp("f16"), False), ("transformers float16", _transformers("float16"), True)],
}
"""Compute class → known-good engines of that class: (label, factory(path), needs the hf extra).
``llama.cpp`` at default settings is the reference itself; its variants are the f32 engines."""
CLASS_MEMBERS = {"f64": ("f64",), "f32": ("f32",), "bf16": ("bf16",), "f16": ("f16",), "mixed": ("f32", "bf16", "f16")}
"""The classes whose known-good pairs make each class's row (``mixed``: the loosest of them)."""
NEEDS_REAL_ENGINE = ("bf16", "f16")
"""Classes whose rows need a real engine beside the emulation (refused without the hf extra)."""


def have_torch() -> bool:
    try:
        import torch  # noqa: F401
        import transformers  # noqa: F401
    except ImportError:
        return False
    return True


@dataclass
class CalibrationPlan:
    """What to measure: the F32 trained models (mutants run on these), the file-type ladder,
    the compute classes, the mutants, and the tokens per prompt (``max_tokens`` on the F32 trained
    models, where the mutants run; ``ladder_max_tokens`` on the file-type ladder, where only
    known-good pairs run). None, the default for both: whole prompts, as ``harness parity``
    judges them. A recurrent state's drift grows with the position: rows measured on the first
    256 tokens judged the shipped prompts' 1,026-token one with gates it crosses (llama.cpp at
    n_ubatch 7 on ``trained-qwen35-256-F32``: KLD mean 1.28e-6 and p99 1.2e-5 against 1e-6 and
    1e-5, the largest KLD at position 946)."""

    base_model: str = "fixture:trained-qwen35"
    moe_model: str = "fixture:trained-qwen35moe"
    floor_models: tuple[tuple[str, tuple[str, ...]], ...] = (("fixture:tiny-qwen35", ("f64", "f32", "f16")),)
    """``(model, classes)``: known-good pairs of those classes only (no mutant runs on them),
    joining the F32 rows of their architecture. The random-weight dense fixture, which sign-offs
    and CI run engines on: its sharper logits put the f16 emulation further from llama.cpp than on
    the trained model (oracle-f16: 1 − cosine 1.0e-4 and KLD mean 6.0e-5, where a row measured on
    the trained fixtures alone allowed 4.8e-5 and 2.5e-5). Not for bf16: there a correct bf16
    engine falls below the release floor itself (oracle-bf16 min cosine 0.941, transformers
    bfloat16 0.946), which no row can loosen."""
    ladder: tuple[str, ...] | None = None  # None: every TRAINED_LADDER entry plus the F16 bases
    classes: tuple[str, ...] = COMPUTE_CLASSES
    mutants: tuple[str, ...] | None = None  # None: all
    include_transformers: bool = True
    max_tokens: int | None = None
    ladder_max_tokens: int | None = None

    def models(self) -> list[str]:
        from harness.fixtures.synthetic import LADDER_BASES, TRAINED_LADDER

        ladder = self.ladder if self.ladder is not None else tuple(
            f"fixture:{n}" for n in (*LADDER_BASES, *TRAINED_LADDER))
        return [m for m in (self.base_model, self.moe_model, *(f for f, _ in self.floor_models), *ladder) if m]

    def classes_for(self, spec: str) -> tuple[str, ...]:
        """The classes measured on ``spec``: all of ``classes``, or a floor model's own."""
        own = dict(self.floor_models).get(spec)
        return self.classes if own is None else tuple(c for c in self.classes if c in own)


@dataclass
class ModelMeasurement:
    """What calibration measured on one model."""

    spec: str
    path: Path
    weights: str
    file_type: str
    dims: dict[str, Any]
    prompts: list[list[int]]
    ref: CachedReference


@dataclass
class CalibrationResult:
    """Measured pairs, one row per weights key × class, probe/localization tolerances, the
    known-bad × gates matrix (at f64, the mutants' own class) and the per-class detection matrix."""

    goods: list[PairStats]
    bads: list[PairStats]
    rows: list[dict[str, Any]]
    probes: dict[str, dict[str, dict[str, Any]]]
    localization: dict[str, dict[str, Any]]
    matrix: dict[str, dict[str, bool]]
    class_matrix: dict[str, dict[str, str]]
    skipped: list[str]
    problems: list[str]
    moe_excursions: dict[str, Any] | None = None

    @property
    def gates(self) -> dict[str, dict[str, Any]]:
        """The f64 row on F32 weights (the oracle's class on the default model's file type)."""
        return next(r["gates"] for r in self.rows if r["weights"] == "F32" and r["class"] == "f64" and r.get("arch", "qwen35") == "qwen35")


def _prompts(model_path: Path, n_max_tokens: int | None) -> list[list[int]]:
    """The shipped prompts as llama.cpp tokenizes them, each cut to ``n_max_tokens`` (None: whole)."""
    from harness.compare.prompts import load_prompt_set, tokenize_prompts
    from harness.engines.llamacpp import LlamaCppEngine

    ps = tokenize_prompts(load_prompt_set(None), LlamaCppEngine(model_path))
    return [p.tokens[:n_max_tokens] for p in ps]


def open_for_calibration(spec: str, max_tokens: int | None) -> ModelMeasurement:
    """Resolve ``spec`` (building a ladder fixture if needed) and set up its cached reference."""
    from harness.engines.llamacpp import LlamaCppEngine
    from harness.fixtures.resolve import resolve_model
    from harness.model.gguf_model import GGUFModel

    path = resolve_model(spec)
    m = GGUFModel(path)
    hp = m.hparams
    dims = {"name": spec, "sha256": m.sha256, "arch": hp.arch, "n_layer": hp.n_layer, "n_embd": hp.n_embd}
    return ModelMeasurement(spec, path, m.weights_key, m.file_type, dims, _prompts(path, max_tokens), CachedReference(LlamaCppEngine(path)))


def measure_goods(mm: ModelMeasurement, classes: Sequence[str], use_torch: bool, log: Callable[[str], None]) -> list[PairStats]:
    """Every known-good engine of the member classes of ``classes`` on one model."""
    from harness.compare.near_ties import cuts_apply
    from harness.model.gguf_model import GGUFModel

    wanted = sorted({c for k in classes for c in CLASS_MEMBERS[k]}, key=COMPUTE_CLASSES.index)
    hp = GGUFModel(mm.path).hparams
    flips = RouterFlips(hp.n_layer, hp.n_expert_used, float(MOE_ROUTER_MAX_GAP["value"]), log) if hp.n_expert > 0 else None
    excuses = release_excuses(hp, log)
    out = []
    for cls in wanted:
        for label, make, needs_torch in KNOWN_GOOD[cls]:
            if needs_torch and not use_torch:
                continue
            log(f"  good ({cls}): {label} vs llama.cpp on {mm.spec}")
            p = measure_pair(f"{label} vs llama.cpp", True, mm.spec, mm.ref, make(mm.path), mm.prompts,
                             flips if cuts_apply(cls, mm.weights) else None, excuses)
            p.compute_class, p.weights = cls, mm.weights
            p.extra.update(file_type=mm.file_type, dims=mm.dims)
            out.append(p)
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
            rows.append({"weights": weights, "class": cls, "arch": arch, "goods": members, "gates": propose(members),
                         "file_types": sorted({g.extra["file_type"] for g in members}),
                         "basis_models": list({g.extra["dims"]["name"]: g.extra["dims"] for g in members}.values())})
    return rows, skipped


def _probe_engines(classes: Sequence[str], use_torch: bool) -> dict[str, list[tuple[str, Callable[[Path], Any]]]]:
    """The engines whose self-consistency sets each member class's probe floor: the class's
    known-good engines (llama.cpp at n_ubatch 7 and at 1 thread among the f32 ones: a thread
    count changes its decode numerics), and llama.cpp at its defaults for ``f32``."""
    engines: dict[str, list[tuple[str, Callable[[Path], Any]]]] = {"f32": [("llama.cpp", lambda p: _llama(p))]}
    for cls, goods in KNOWN_GOOD.items():
        engines.setdefault(cls, [])
        engines[cls] += [(label, make) for label, make, needs_torch in goods if use_torch or not needs_torch]
    needed = {c for k in classes for c in CLASS_MEMBERS[k]}
    return {c: e for c, e in engines.items() if c in needed}


def _self_comparisons(engine: Any, prompts: Sequence[Sequence[int]], decode_tokens: int) -> list[dict[str, np.ndarray]]:
    """Per-position metrics (``metrics.position_metrics``) of every way the split and decode
    probes feed ``engine`` (the longest prompt's first ``MAIN_TOKENS`` split at each point; the
    ``decode_prompt`` tokens after a prefill of 1 and 16) against the same tokens fed whole."""
    from harness.compare.probes import MAIN_TOKENS, decode_prompt, split_points

    out = []
    main = list(max(prompts, key=len))[:MAIN_TOKENS]
    whole = gather(engine.logits(main), len(main))
    for p in split_points(len(main)):
        out.append(metrics.position_metrics(whole, gather(engine.logits(main, chunks=[p, len(main) - p]), len(main))))
    toks = decode_prompt(prompts, decode_tokens)
    whole = gather(engine.logits(toks), len(toks))
    for k in (1, 16):
        out.append(metrics.position_metrics(whole, gather(engine.logits(toks, chunks=[k] + [1] * (len(toks) - k)), len(toks))))
    return out


PROBE_FLOOR_MODELS = ("fixture:tiny-qwen35",)
"""Models whose f64/f32 engines' floor joins the base model's in the probe tolerances calibration
writes to thresholds.yaml (``probe_floors(..., extra=True)``): the random-weight dense fixture,
which sign-offs and CI run f32 engines on (llama.cpp, ``command:example``) and whose sharper logits
drift further over a long decode (llama.cpp: 1 − cosine 5.1e-6 against 4.1e-7 on the trained
model at 640 tokens; a tolerance from the trained model alone sat 1.6× above it). Not for bf16/f16
(``EXTRA_FLOOR_CLASSES``): rounding random weights to 8 mantissa bits gives 1 − cosine 6.5e-3 there,
no measure of a real model's noise, and a tolerance of 0.86 that would pass anything."""
EXTRA_FLOOR_CLASSES = ("f64", "f32")


def _extra_floor_models(path: Path) -> list[tuple[str, Path]]:
    from harness.fixtures.resolve import resolve_model

    out = [(spec, resolve_model(spec)) for spec in PROBE_FLOOR_MODELS]
    return [(spec, p) for spec, p in out if Path(p).resolve() != Path(path).resolve()]


def _measured(label: str, make: Callable[[Path], Any], path: Path, decode_tokens: int, log: Callable[[str], None],
              prompts: Sequence[Sequence[int]] | None = None) -> list[dict[str, np.ndarray]] | None:
    """``_self_comparisons`` of ``make(path)`` on ``prompts`` (default: the shipped prompts
    tokenized whole), or None, logged, when the engine cannot build that model (transformers
    cannot build every fixture, e.g. the random-weight MoE)."""
    log(f"  {label}: split and {decode_tokens}-token decode")
    try:
        return _self_comparisons(make(path), prompts if prompts is not None else _prompts(path, None), decode_tokens)
    except (HarnessError, RuntimeError) as e:
        log(f"  skipped: {label}: {str(e).splitlines()[0][:160]}")
        return None


def probe_floors(path: Path, classes: Sequence[str], use_torch: bool, log: Callable[[str], None],
                 decode_tokens: int | None = None, extra: bool = False) -> dict[str, dict[str, dict[str, Any]]]:
    """Probe tolerances per class (``propose_probes``) from the class engines' own split and
    decode floor on one model, measured as ``harness probe`` runs them: the shipped prompts
    tokenized whole, decode over ``decode_tokens`` (default ``probes.DECODE_TOKENS``) one token per
    call, so a drift a correct engine shows only after hundreds of calls is in the floor; for
    ``f32`` also llama.cpp at n_ubatch 7 against its default. ``extra``: the same engines on
    ``PROBE_FLOOR_MODELS`` join the floor (what thresholds.yaml's rows use; a subject's own
    measurement does not). Each tolerance's ``floor`` is the worst position of any comparison,
    ``n`` the comparisons, ``engines`` the worst per engine (and model), ``models`` the models."""
    from harness.compare.probes import DECODE_TOKENS, MAIN_TOKENS

    decode_tokens = decode_tokens or DECODE_TOKENS
    prompts = _prompts(path, None)
    extras = _extra_floor_models(path) if extra else []
    floors: dict[str, tuple[int, dict[str, tuple[float, float]], list[str]]] = {}
    for cls, engs in _probe_engines(classes, use_torch).items():
        where = [("", path, prompts)] + ([(f" on {spec}", p, None) for spec, p in extras] if cls in EXTRA_FLOOR_CLASSES else [])
        per: dict[str, tuple[float, float]] = {}
        n = 0
        for (label, make), (suffix, p, ps) in ((e, w) for e in engs for w in where):
            comps = _measured(f"probe floor ({cls}): {label}{suffix}", make, p, decode_tokens, log, ps)
            if comps is not None:
                per[label + suffix] = (min(float(np.min(c["cosine"])) for c in comps), max(float(np.max(c["kld"])) for c in comps))
                n += len(comps)
        if cls == "f32":
            main = list(max(prompts, key=len))[:MAIN_TOKENS]
            pm = metrics.position_metrics(gather(_llama(path).logits(main), len(main)), gather(_llama(path, n_ubatch=7).logits(main), len(main)))
            per["llama.cpp n_ubatch 7 vs default"] = (float(np.min(pm["cosine"])), float(np.max(pm["kld"])))
            n += 1
        floors[cls] = (n, per, [str(path)] + [spec for spec, _ in extras if cls in EXTRA_FLOOR_CLASSES])
    out = {}
    for cls in classes:
        members = CLASS_MEMBERS[cls]
        per = {label: w for c in members for label, w in floors[c][1].items()}
        out[cls] = propose_probes(min((c for c, _ in per.values()), default=1.0), max((k for _, k in per.values()), default=0.0), cls)
        for v in out[cls].values():
            v["models"] = list(dict.fromkeys(m for c in members for m in floors[c][2]))
            v["n"] = sum(floors[c][0] for c in members)
            v["engines"] = per
            v["decode_tokens"] = decode_tokens
    return out


MOE_EXCURSION_MARGIN = 3
"""``moe_excursions`` is this many times the most positions a known-good f32 engine's comparison
had outside the f32 probe bounds on the MoE models (at least ``MOE_EXCURSION_MIN``)."""
MOE_EXCURSION_MIN = 16
"""The least allowance: router near-ties are rare and prompt-specific, so the shipped and 80
seeded random prompts may show none at the f32 bounds, while one 97-token counting prompt
("0 1 2 ... 35") on ``tiny-qwen35moe`` gives llama.cpp a burst of 9 positions whenever it is split
before position 83; 16 is that burst with a margin short of 2×."""


EXCURSION_MODELS = ("fixture:trained-qwen35moe", "fixture:tiny-qwen35moe")
"""The MoE models ``harness calibrate`` measures the excursion allowance on: the trained MoE
fixture (the MoE calibration model) and the random-weight one, whose router has more near-ties."""


def moe_excursions(specs: Sequence[str], bounds: dict[str, dict[str, Any]], use_torch: bool, log: Callable[[str], None],
                   decode_tokens: int | None = None) -> dict[str, Any]:
    """The excursion allowance of probes on MoE models: on each MoE model of ``specs``, every f32
    probe engine's split and decode comparisons (``_self_comparisons``) counted for positions
    outside ``bounds`` (the f32 class's probe tolerances, ``propose_probes``); the allowance is
    ``MOE_EXCURSION_MARGIN`` × the largest count, at least ``MOE_EXCURSION_MIN``. Returns
    ``{"value", "floor" (largest count), "n" (comparisons), "engines" ({"label on model": count}),
    "min_cosine" (the lowest cosine among them), "model" (the specs, comma-joined)}``."""
    from harness.compare.probes import DECODE_TOKENS, ProbeTolerance, outside
    from harness.fixtures.resolve import resolve_model

    decode_tokens = decode_tokens or DECODE_TOKENS
    tol = ProbeTolerance(min_cosine=bounds["min_cosine"]["value"], max_kld=bounds["max_kld"]["value"])
    counts, n, low, skipped = {}, 0, 1.0, []
    for spec, (label, make) in ((s_, e) for s_ in specs for e in _probe_engines(["f32"], use_torch)["f32"]):
        label = f"{label} on {spec}"
        comps = _measured(f"MoE router excursions: {label}", make, resolve_model(spec), decode_tokens, log)
        if comps is None:
            skipped.append(label)
            continue
        counts[label] = max(int(outside(c, tol).sum()) for c in comps)
        low = min([low] + [float(np.min(c["cosine"])) for c in comps])
        n += len(comps)
    worst = max(counts.values())
    return {"value": max(MOE_EXCURSION_MIN, MOE_EXCURSION_MARGIN * worst), "floor": worst, "n": n, "engines": counts,
            "min_cosine": low, "decode_tokens": decode_tokens, "model": ", ".join(specs), "skipped": skipped}


def localization_bounds(path: Path, tokens: list[int]) -> tuple[dict[str, dict[str, Any]], dict[str, np.ndarray]]:
    """Per-tensor bounds from llama.cpp (F32) against the oracle, and the oracle's activations."""
    oracle_acts = _oracle(path).activations(tokens)
    rows = metrics.compare_activations(oracle_acts, _llama(path).activations(tokens))
    ok_rows = [r for r in rows if r["status"] == "ok"]
    nm_floor = max(r["nmse"] for r in ok_rows)
    cos_floor = min(r["cosine"] for r in ok_rows)
    return {
        "localize_max_nmse": {"value": _round_up(max(100 * nm_floor, 1e-6)), "floor": nm_floor, "n": len(ok_rows)},
        "localize_min_cosine": {"value": round(1 - _round_up(max(100 * (1 - cos_floor), 1e-4)), 8), "floor": cos_floor, "n": len(ok_rows)},
    }, oracle_acts


def measure_mutants(plan: CalibrationPlan, base: ModelMeasurement, moe: ModelMeasurement | None, ptol, localization,
                    oracle_acts: dict[str, np.ndarray], log: Callable[[str], None]) -> tuple[list[PairStats], list[str]]:
    """Every mutant vs llama.cpp on the F32 trained model of its arch, with the probes and
    first-divergence localization it trips."""
    from harness.compare.localize import localize_activations
    from harness.compare.probes import probe_decode, probe_determinism, probe_split
    from harness.engines.mutants import MUTANTS
    from harness.engines.registry import resolve_engine
    from harness.model.gguf_model import GGUFModel

    bads, skipped = [], []
    loc_tokens = base.prompts[0][:96]
    for name in plan.mutants or tuple(MUTANTS):
        m = MUTANTS[name]
        use_moe = "qwen35" not in m.archs
        if use_moe and moe is None:
            skipped.append(f"mutant:{name}: needs a qwen35moe model ({plan.moe_model} unavailable)")
            continue
        mm = moe if use_moe else base
        log(f"  bad: mutant:{name} vs llama.cpp on {mm.spec}")
        eng = resolve_engine(f"mutant:{name}", mm.path)
        # judged as parity judges it: on an MoE model, positions the release gate excuses are left out
        p = measure_pair(f"mutant:{name}", False, mm.spec, mm.ref, eng, mm.prompts,
                         excuses=release_excuses(GGUFModel(mm.path).hparams, log))
        p.weights = mm.weights
        p.extra["arch"] = mm.dims["arch"]
        toks = max(mm.prompts, key=len)[:160]
        split, decode = probe_split(eng, toks, ptol), probe_decode(eng, toks[:48], ptol)
        p.extra["probe_split"], p.extra["probe_split_worst"] = split.verdict is Verdict.FAIL, _worst(split)
        p.extra["probe_decode"], p.extra["probe_decode_worst"] = decode.verdict is Verdict.FAIL, _worst(decode)
        p.extra["probe_determinism"] = probe_determinism(eng, toks[:64]).verdict is Verdict.FAIL
        o_acts = oracle_acts if mm is base else _oracle(mm.path).activations(loc_tokens)
        loc = localize_activations(GGUFModel(mm.path).hparams, o_acts, eng.activations(loc_tokens),
                                   localization["localize_max_nmse"]["value"], localization["localize_min_cosine"]["value"])
        p.extra["localize"] = loc.first is not None
        p.extra["first_divergence"] = loc.first.name if loc.first else None
        bads.append(p)
    return bads, skipped


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


def calibrate(plan: CalibrationPlan, log: Callable[[str], None] = print) -> CalibrationResult:
    """Run every pair of ``plan`` and propose the thresholds (does not write them). Raises
    ``InvalidInput`` for a mutant name ``MUTANTS`` does not know (before anything runs).

    Long because it is the phases in order, each a named function: open the models, measure the
    known-good pairs per class, make the rows, probe and localization floors, mutants, checks.
    """
    from harness.compare.probes import ProbeTolerance
    from harness.engines.mutants import MUTANTS

    unknown = [m for m in plan.mutants or () if m not in MUTANTS]
    if unknown:  # before any model is opened or measured
        raise InvalidInput(f"unknown mutant {unknown[0]!r}; mutants: {', '.join(MUTANTS)}")
    use_torch = plan.include_transformers and have_torch()
    skipped = [] if use_torch else ["transformers (every class): the hf extra (torch) is not installed"]
    models: list[ModelMeasurement] = []
    for spec in plan.models():
        tokens = plan.max_tokens if spec in (plan.base_model, plan.moe_model, *dict(plan.floor_models)) else plan.ladder_max_tokens
        try:
            models.append(open_for_calibration(spec, tokens))
        except HarnessError as e:
            skipped.append(f"{spec}: {e}")
    if not models or models[0].spec != plan.base_model:
        raise InvalidInput(f"calibration needs its base model {plan.base_model}")
    goods = [p for mm in models for p in measure_goods(mm, plan.classes_for(mm.spec), use_torch, log)]
    rows, row_skips = rows_from_goods(goods, plan.classes, use_torch)
    skipped += row_skips
    base = models[0]
    moe = next((mm for mm in models if mm.spec == plan.moe_model), None)
    probes = probe_floors(base.path, [r["class"] for r in rows if r["weights"] == "F32"] or ["f32"], use_torch, log, extra=True)
    localization, oracle_acts = localization_bounds(base.path, base.prompts[0][:96])
    p64 = probes.get("f64", probes.get("f32"))
    ptol = ProbeTolerance(min_cosine=p64["min_cosine"]["value"], max_kld=p64["max_kld"]["value"])
    bads, mut_skips = measure_mutants(plan, base, moe, ptol, localization, oracle_acts, log)
    skipped += mut_skips
    matrix = {b.label: caught(b, r["gates"]) for b in bads if (r := _f32_row(rows, "f64", b)) is not None}
    ex = moe_excursions(dict.fromkeys([moe.spec, *EXCURSION_MODELS[1:]]), probes["f32"], use_torch, log) if moe is not None and "f32" in probes else None
    return CalibrationResult(goods, bads, rows, probes, localization, matrix, class_detection(bads, rows, probes), skipped,
                             consistency_problems(goods, bads, rows, probes), ex)


# ------------------------------------------------------------------------------- the subject
@dataclass
class SubjectCalibration:
    """``calibrate_subject``'s result: the row, the pairs it came from, and what was left out."""

    row: Row
    goods: list[PairStats]
    model: ModelMeasurement
    skipped: list[str]


def calibrate_subject(spec: str, compute_class: str, max_tokens: int = 128, use_torch: bool | None = None,
                      log: Callable[[str], None] = print) -> SubjectCalibration:
    """Measure the calibrated tier on the subject itself: the known-good engines of
    ``compute_class`` against llama.cpp on ``spec`` over the shipped prompts cut to
    ``max_tokens`` each (a bounded cost), the row by ``propose``, and the class's probe
    tolerances from the same engines' self-consistency on this model.

    Raises ``InvalidInput`` (unknown class; a bf16/f16 class without a real engine of it) and
    ``EngineError``.
    """
    if compute_class not in CLASS_MEMBERS:
        raise InvalidInput(f"unknown compute class {compute_class!r}; classes: {', '.join(COMPUTE_CLASSES)}")
    use_torch = have_torch() if use_torch is None else use_torch
    if any(c in NEEDS_REAL_ENGINE for c in CLASS_MEMBERS[compute_class]) and not use_torch:
        raise InvalidInput(f"measuring class {compute_class} needs a real engine of that class beside the emulation "
                           "(transformers): pip install -e .[hf]")
    mm = open_for_calibration(spec, max_tokens)
    goods = measure_goods(mm, [compute_class], use_torch, log)
    probes = probe_floors(mm.path, [compute_class], use_torch, log)[compute_class]
    gates = propose(goods)
    n = sum(g.n for g in goods)
    basis = {name: {"value": v["value"], "basis": _basis("harness calibrate --model " + spec + " --class " + compute_class, max(n, 1), spec,
                                                         v["floor"], [], f"measured on the subject itself by {', '.join(g.label for g in goods)}; "
                                                         f"{MARGIN}x the bootstrap CI by prompt.")} for name, v in gates.items()}
    pbasis = {name: {"value": v["value"], "basis": _basis("harness calibrate --model " + spec + " --class " + compute_class, 1, spec, v["floor"], [],
                                                          "the class engines' own split/decode floor on the subject.")} for name, v in probes.items()}
    row = Row(mm.weights, compute_class, (mm.dims,), basis, pbasis, f"measured on the subject ({spec})", mm.file_type,
              max_tokens=max_tokens)
    return SubjectCalibration(row, goods, mm, [] if use_torch else ["transformers: the hf extra is not installed"])


# ------------------------------------------------------------------------------- writing
def _basis(command: str, n: int, model: str, floor: float, bads: list[tuple[float, str]], note: str,
           threshold: float | None = None, lower_is_bad: bool = True) -> dict[str, Any]:
    """A measured basis. ``known_bad`` lists the known-bad values this gate separates (beyond
    ``threshold``), closest first; the ones it misses are named in the note."""
    vals = [(float(v), w) for v, w in bads if v is not None and math.isfinite(v)]
    if threshold is not None:
        sep = [(v, w) for v, w in vals if (v < threshold if lower_is_bad else v > threshold)]
        missed = [w for v, w in vals if (v, w) not in sep]
        if missed:
            note += f" Missed by this gate alone (caught by another, or below this class's floor): {', '.join(missed)}."
        vals = sep
    known_bad = [{"value": v, "what": w} for v, w in vals][:12]
    if not known_bad:
        known_bad = [{"value": float(floor), "what": "no known-bad value separated by this gate alone (see note)"}]
    return {"kind": "measured", "command": command, "n": int(n), "model": model, "date": datetime.date.today().isoformat(),
            "known_good_floor": float(floor), "known_bad": known_bad, "note": note}


def _row_document(r: dict[str, Any], res: CalibrationResult, command: str, commit_txt: str) -> dict[str, Any]:
    g = r["gates"]
    n = sum(p.n for p in r["goods"])
    model = r["basis_models"][0]["name"]
    goods_txt = "; ".join(f"{p.label} on {p.model}: min cos {p.min_cosine:.8f}, KLD mean {p.kld_mean:.3g}, p99 {p.kld_p99:.3g}" for p in r["goods"])
    f32_mutants = r["weights"] == "F32"
    bads = [b for b in res.bads if b.extra.get("arch", r.get("arch")) == r.get("arch")] if f32_mutants else []
    bad_cos = [(b.min_cosine, b.label) for b in sorted(bads, key=lambda b: -b.min_cosine)]
    bad_km = [(b.kld_mean, b.label) for b in sorted(bads, key=lambda b: b.kld_mean)]
    bad_kp = [(b.kld_p99, b.label) for b in sorted(bads, key=lambda b: b.kld_p99)]
    where = f"Known-bad values are the mutants' (F32 trained {r.get('arch')} models)." if f32_mutants else \
        "No mutant runs on this file type; the per-class mutant matrix is measured on F32."
    doc = {
        "weights": r["weights"], "class": r["class"], "file_type": ", ".join(r["file_types"]),
        "basis_models": [{k: d[k] for k in ("name", "sha256", "arch", "n_layer", "n_embd")} for d in r["basis_models"]],
        "gates": {
            "min_cosine": {"value": g["min_cosine"]["value"], "basis": _basis(command, n, model, g["min_cosine"]["floor"], bad_cos,
                           f"1 - {MARGIN}x(1 - lower 95% bootstrap CI by prompt {g['min_cosine']['ci']:.8f}), at most 1 - {MIN_STEP['min_cosine']:g}, "
                           "never below the release floor. "
                           f"Known-good ({r['class']}): {goods_txt}. {where}{commit_txt}", g["min_cosine"]["value"], True)},
            "max_kld_mean": {"value": g["max_kld_mean"]["value"], "basis": _basis(command, n, model, g["max_kld_mean"]["floor"], bad_km,
                             f"{MARGIN}x upper 95% bootstrap CI by prompt ({g['max_kld_mean']['ci']:.3g}) of the known-good KLD mean, at least "
                             f"{MIN_STEP['max_kld_mean']:g}.{commit_txt}",
                             g["max_kld_mean"]["value"], False)},
            "max_kld_p99": {"value": g["max_kld_p99"]["value"], "basis": _basis(command, n, model, g["max_kld_p99"]["floor"], bad_kp,
                            f"{MARGIN}x upper 95% bootstrap CI by prompt ({g['max_kld_p99']['ci']:.3g}) of the known-good KLD p99, at least "
                            f"{MIN_STEP['max_kld_p99']:g}.{commit_txt}",
                            g["max_kld_p99"]["value"], False)},
        },
    }
    pr = res.probes.get(r["class"])
    if pr:
        split_bads = [(0.0, b.label) for b in res.bads if b.extra.get("probe_split")]
        doc["probes"] = probe_document(r["class"], pr, command, res.goods[0].model, split_bads, commit_txt)
    return doc


def _floors_text(v: dict[str, Any]) -> str:
    return "; ".join(f"{label}: min cos {c:.10f}, max KLD {k:.3g}" for label, (c, k) in v.get("engines", {}).items())


def probe_document(cls: str, pr: dict[str, dict[str, Any]], command: str, model: str, split_bads: list[tuple[float, str]],
                   commit_txt: str) -> dict[str, Any]:
    """A row's ``probes`` section (``min_cosine``, ``max_kld``, each with its basis) from the
    class's ``probe_floors`` result; ``split_bads``: (value, what) of the mutants the split probe
    fails, the known-bad side of the basis."""
    tokens = pr["min_cosine"].get("decode_tokens")
    decode = f"decode over {tokens} tokens one per call" if tokens else "decode"
    ub = " and n_ubatch 7" if cls in ("f32", "mixed") else ""
    n = pr["min_cosine"].get("n", 1)
    model = ", ".join([model, *pr["min_cosine"].get("models", [model])[1:]])
    return {
        "min_cosine": {"value": pr["min_cosine"]["value"], "basis": _basis(command, n, model, pr["min_cosine"]["floor"], split_bads,
                       f"20x (in 1 - cosine) the {cls} engines' own floor across split points, {decode}{ub} "
                       f"({_floors_text(pr['min_cosine'])}); known-bad: mutants the split probe fails.{commit_txt}")},
        "max_kld": {"value": pr["max_kld"]["value"], "basis": _basis(command, n, model, pr["max_kld"]["floor"], [(1.0, w) for _, w in split_bads],
                    f"50x the {cls} engines' own max KLD across split points, {decode}{ub}.{commit_txt}")},
    }


def moe_excursions_document(ex: dict[str, Any], command: str, commit_txt: str) -> dict[str, Any]:
    """thresholds.yaml ``probes.moe_excursions`` with its basis, from ``moe_excursions``."""
    counts = "; ".join(f"{label}: {c}" for label, c in ex["engines"].items())
    return {"value": int(ex["value"]), "basis": {
        "kind": "measured", "command": command, "n": int(ex["n"]), "model": ex["model"], "date": datetime.date.today().isoformat(),
        "known_good_floor": float(ex["floor"]),
        "known_bad": [{"value": float(ex["decode_tokens"] - 1), "what": "a state dropped or drifting between calls (mutant:ssm-state-reset, "
                       "a recurrent state rounded to bf16): up to every position after the first call leaves the bounds"}],
        "note": (f"{MOE_EXCURSION_MARGIN}x (at least {MOE_EXCURSION_MIN}: a 97-token counting prompt gives llama.cpp a 9-position burst on tiny-qwen35moe) the most positions of one split or {ex['decode_tokens']}-token decode "
                 f"comparison that a known-good f32 engine had outside the f32 probe bounds on these MoE models ({counts}; lowest cosine "
                 f"{ex['min_cosine']:.6f}): an expert-router near-tie picks another expert when the prompt is fed in other pieces. The burst must end before the comparison's last position: a state fault lasts to it."
                 + (f" Not measured (the engine cannot load the model): {', '.join(ex['skipped'])}." if ex.get("skipped") else "")
                 + commit_txt)}}


def calibrate_probes(base_model: str, moe_model: str | None, classes: Sequence[str], use_torch: bool | None = None,
                     log: Callable[[str], None] = print) -> tuple[dict[str, dict[str, dict[str, Any]]], dict[str, Any] | None]:
    """``harness calibrate --probes``: only the probe tolerances, per class, on ``base_model``
    (``probe_floors``) and the MoE excursion allowance on ``moe_model`` and the other
    ``EXCURSION_MODELS`` (``moe_excursions``, from the f32 bounds). Cheaper than a full calibration; raises ``InvalidInput`` for an unknown class."""
    from harness.fixtures.resolve import resolve_model

    unknown = [c for c in classes if c not in CLASS_MEMBERS]
    if unknown:
        raise InvalidInput(f"unknown compute class {unknown[0]!r}; classes: {', '.join(COMPUTE_CLASSES)}")
    use_torch = have_torch() if use_torch is None else use_torch
    probes = probe_floors(resolve_model(base_model), list(dict.fromkeys([*classes, "f32"])), use_torch, log, extra=True)
    ex = moe_excursions(list(dict.fromkeys([moe_model, *EXCURSION_MODELS[1:]])), probes["f32"], use_torch, log) if moe_model else None
    return {c: v for c, v in probes.items() if c in classes}, ex


MOE_ROUTER_MAX_GAP = {"value": 1e-3, "basis": {
    "kind": "declared", "who": "harness maintainers (MoE router near-ties in parity; harness/compare/near_ties.py)",
    "why": "An MoE prompt's calibrated comparison ends at its first position outside the row's bounds when the reference's own "
           "router logits have a k-th to (k+1)-th gap of at most this many logits there (any MoE layer): a correct engine may keep "
           "other experts from there on, and the Gated DeltaNet state carries the difference to every later position. Measured "
           "on fixture:trained-qwen35moe, llama.cpp n_ubatch=7 against llama.cpp, prompt prose-deltanet: the first position outside "
           "the f32 row is 336, at a reference router gap of 3.5e-4 (66 positions follow, the worst at cosine 0.99915 and KLD 0.116 "
           "nats); 1e-3 is about 3x that gap. Over the shipped prompts' 1,479 positions 1.8 % have a gap at most 1e-3 (0.95 % at "
           "most 5e-4, the smallest 2.5e-6), so a fault that first shows elsewhere is judged on every position. Applies to "
           "classes f64 and f32 on unquantized weights (F32, F16, BF16): on a quantized file llama.cpp's quantized activations "
           "move its router logits by ~1e-2, and every class's rows are measured with the flips in them.",
    "date": "2026-12-01"}}
"""thresholds.yaml ``probes.moe_router_max_gap``: not measured by ``harness calibrate``, so every
document it writes carries this declared value and basis."""


def merge_probe_rows(path: str | Path, probes: dict[str, dict[str, dict[str, Any]]], ex: dict[str, Any] | None, command: str,
                     base_model: str, commit: str | None) -> Path:
    """thresholds.yaml at ``path`` with every calibrated row's ``probes`` section of a class in
    ``probes`` replaced (known-bad sides kept from the file) and, with ``ex``,
    ``probes.moe_excursions``; every other number kept; written by ``write_thresholds``."""
    from harness.gates.thresholds import load_thresholds

    commit_txt = f" harness commit {commit}." if commit else ""
    doc = dict(load_thresholds(path).data)
    for row in doc.get("calibrated", []):
        if row["class"] in probes:
            old = row.get("probes", {}).get("min_cosine", {}).get("basis", {}).get("known_bad", [])
            bads = [(0.0, b["what"]) for b in old if str(b.get("what", "")).startswith("mutant:")]
            row["probes"] = probe_document(row["class"], probes[row["class"]], command, base_model, bads, commit_txt)
    if ex is not None:
        doc["probes"] = {**doc.get("probes", {}), "moe_excursions": moe_excursions_document(ex, command, commit_txt)}
    doc["probes"] = {**doc.get("probes", {}), "moe_router_max_gap": doc.get("probes", {}).get("moe_router_max_gap", MOE_ROUTER_MAX_GAP)}
    return write_thresholds(doc, path)


def thresholds_document(res: CalibrationResult, command: str, commit: str | None, near_tie_margin: float = 0.25) -> dict[str, Any]:
    """The thresholds.yaml (``harness-thresholds/v2``) content: the declared release gate, the
    localization bounds and one measured row per weights key × class."""
    commit_txt = f" harness commit {commit}." if commit else ""
    base = res.goods[0].model
    loc_bads = [b for b in res.bads if b.extra.get("localize")]
    lz = res.localization
    doc = {
        "schema": "harness-thresholds/v2",
        "report_only": {"near_tie_margin": near_tie_margin},
        "release": RELEASE,
        "probes": {
            "localize_max_nmse": {"value": lz["localize_max_nmse"]["value"], "basis": _basis(command, lz["localize_max_nmse"]["n"], base,
                                  lz["localize_max_nmse"]["floor"], [(1.0, f"{b.label} (first divergence {b.extra.get('first_divergence')})") for b in loc_bads],
                                  "100x the largest per-tensor NMSE of llama.cpp (F32) against the oracle." + commit_txt)},
            "localize_min_cosine": {"value": lz["localize_min_cosine"]["value"], "basis": _basis(command, lz["localize_min_cosine"]["n"], base,
                                    lz["localize_min_cosine"]["floor"], [(0.0, b.label) for b in loc_bads],
                                    "1 - 100x(1 - smallest per-tensor cosine of llama.cpp (F32) against the oracle), at most 0.9999." + commit_txt)},
        },
        "calibrated": [_row_document(r, res, command, commit_txt) for r in res.rows],
    }
    if res.moe_excursions is not None:
        doc["probes"]["moe_excursions"] = moe_excursions_document(res.moe_excursions, command, commit_txt)
    doc["probes"]["moe_router_max_gap"] = MOE_ROUTER_MAX_GAP
    return doc


def matrix_markdown(res: CalibrationResult, command: str) -> str:
    """The per-class detection matrix as Markdown: each mutant caught (by which gates) or below
    the class floor, per class, with its numbers (``class_detection``)."""
    classes = list(res.class_matrix)
    lines = ["# Mutants × compute classes: caught, or below the class floor", "",
             f"Written by `{command}` ({datetime.date.today().isoformat()}). Each mutant runs against llama.cpp on the F32 trained",
             "fixture of its architecture; a cell says which gates of that class's F32 row (`cosine`, `kld_mean`, `kld_p99`),",
             "probes (`probe_split`, `probe_decode`, `probe_determinism`) or first-divergence localization (`localize`) catch it,",
             "or that its logits are **below the class floor**: within what a correct engine of that class produces.", "",
             "| mutant | " + " | ".join(classes) + " |", "|---|" + "---|" * len(classes)]
    for b in res.bads:
        lines.append(f"| `{b.label}` | " + " | ".join(res.class_matrix[c].get(b.label, "-") for c in classes) + " |")
    return "\n".join(lines) + "\n"


HEADER = (
    "# Every number that gates a verdict, each with its basis (docs/gates.md).\n"
    "# Written by `harness calibrate` (harness/gates/calibrate.py): the release gate is a declared floor;\n"
    "# every calibrated row is measured (command, n, known-good floor, known-bad values it separates) for one\n"
    "# weights key x compute class. Schema: harness/schemas/thresholds.schema.json. Edit by re-running\n"
    "# calibration, or replace a value with a declared basis (who, why) -- a number without a basis refuses\n"
    "# to gate (exit 2), and no row may be looser than the release floor.\n"
)


def write_thresholds(doc: dict[str, Any], path: str | Path) -> Path:
    """Write ``doc`` as thresholds.yaml (header comment + YAML) atomically, then validate it by
    loading it back (``InvalidInput`` if it does not validate)."""
    import os
    import tempfile

    from harness.gates.thresholds import load_thresholds

    path = Path(path)
    text = HEADER + yaml.safe_dump(doc, sort_keys=False, width=100, allow_unicode=True)
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


# ------------------------------------------------------------------------------- top-k rows
TOPK_CLASSES = ("f64", "f32")
"""Classes whose top-k rows ``calibrate_topk`` measures without the hf extra (bf16/f16 rows need a
real engine of the class, as their calibrated rows do: ``NEEDS_REAL_ENGINE``)."""


def measure_topk_pair(label: str, good: bool, model: str, ref: CachedReference, cand, prompts: list[list[int]], k: int) -> PairStats:
    """``cand``'s full logits cut to their top ``k`` (``topk.cut_topk``, what a server giving k
    logprobs would send) against the cached reference: per-prompt top-k KLDs (``min_cosine`` NaN:
    not computable from top-k)."""
    from harness.compare import topk

    klds = []
    for toks in prompts:
        pm = topk.topk_position_metrics(ref.get(toks), topk.cut_topk(gather(cand.logits(toks), len(toks)), k))
        klds.append(np.where(pm["finite"], pm["kld"], np.inf))
    allk = np.concatenate(klds)
    return PairStats(label, good, model, math.nan, float(np.mean(allk)), float(np.quantile(allk, 0.99)),
                     np.zeros(len(prompts)), klds, compute_class=cand.info.compute_class or "f64")


def calibrate_topk(k: int, classes: Sequence[str] = TOPK_CLASSES, models: Sequence[str] = ("fixture:trained-qwen35", "fixture:trained-qwen35moe"),
                   mutants: Sequence[str] | None = None, max_tokens: int = 256, log: Callable[[str], None] = print,
                   command: str = "harness calibrate --topk", commit: str | None = None) -> list[dict[str, Any]]:
    """The ``topk:`` rows of thresholds.yaml for ``k`` logprobs per position: per class, the
    known-good pairs of ``KNOWN_GOOD`` (llama.cpp at other settings for f32, the oracle for f64;
    transformers where the hf extra is installed) on the F32 trained ``models``, cut to top-k;
    ``max_topk_kld_mean`` / ``max_topk_kld_p99`` = ``MARGIN`` × the upper 95% bootstrap CI by
    prompt, as ``propose``; the known-bad values are the mutants' (on the first model) cut the same
    way, each on the model of its architecture. Bounded: only these models and classes, no probes,
    no ladder (a few minutes on two cores).

    Raises ``CalibrationRefused`` when a known-good pair lies past its proposed gate (the mutants a
    row misses, e.g. the state faults a whole-prompt feed never reaches, are named in its basis);
    ``InvalidInput`` for a class it cannot measure here.
    """
    from harness.engines import mutants as mutant_mod

    bad_cls = [c for c in classes if c not in KNOWN_GOOD]
    if bad_cls:
        raise InvalidInput(f"top-k rows are measured for {', '.join(KNOWN_GOOD)}; not {', '.join(bad_cls)}")
    use_torch = have_torch()
    if any(c in NEEDS_REAL_ENGINE for c in classes) and not use_torch:
        raise InvalidInput("bf16/f16 top-k rows need transformers (pip install -e .[hf]) beside the emulation")
    mms = [open_for_calibration(m, max_tokens) for m in models]
    goods: list[PairStats] = []
    for mm in mms:
        for cls in classes:
            for label, make, needs_torch in KNOWN_GOOD[cls]:
                if needs_torch and not use_torch:
                    continue
                log(f"  good top-{k} ({cls}): {label} vs llama.cpp on {mm.spec}")
                p = measure_topk_pair(f"{label} vs llama.cpp", True, mm.spec, mm.ref, make(mm.path), mm.prompts, k)
                p.compute_class, p.weights = cls, mm.weights
                p.extra.update(file_type=mm.file_type, dims=mm.dims)
                goods.append(p)
    base = mms[0]
    moe = next((mm for mm in mms if mm.dims["arch"] == "qwen35moe"), None)
    bads = []
    for name in (mutants if mutants is not None else list(mutant_mod.MUTANTS)):
        mm = base if "qwen35" in mutant_mod.MUTANTS[name].archs or moe is None else moe
        log(f"  bad top-{k}: mutant:{name} on {mm.spec}")
        bads.append(measure_topk_pair(f"mutant:{name}", False, mm.spec, mm.ref, mutant_mod.load_mutant(name, mm.path), mm.prompts, k))
    commit_txt = f" harness commit {commit}." if commit else ""
    rows, problems = [], []
    for cls in classes:
        gs = [g for g in goods if g.compute_class == cls]
        if gs:
            row, passing, late = _topk_row(k, cls, gs, bads, command, base.spec, commit_txt)
            rows.append(row)
            problems += late
            g = row["gates"]
            log(f"  top-{k} row {row['weights']} × {cls}: KLD mean ≤ {g['max_topk_kld_mean']['value']:g}, "
                f"p99 ≤ {g['max_topk_kld_p99']['value']:g}; mutants passing both: {', '.join(passing) or 'none'}")
    if problems:
        raise CalibrationRefused("top-k calibration refused: " + "; ".join(problems))
    return rows


def _topk_row(k: int, cls: str, gs: list[PairStats], bads: list[PairStats], command: str, base_spec: str,
              commit_txt: str) -> tuple[dict[str, Any], list[str], list[str]]:
    """One ``topk:`` row from the class's known-good top-k pairs (``propose``'s rule on the KLD
    mean and p99), the mutants passing both its gates, and the good pairs lying past it."""
    hi_mean = max(bootstrap_by_prompt(g, "kld_mean")[1] for g in gs)
    hi_p99 = max(bootstrap_by_prompt(g, "kld_p99")[1] for g in gs)
    gate_mean, gate_p99 = _round_up(max(MARGIN * hi_mean, 1e-7)), _round_up(max(MARGIN * hi_p99, 1e-7))
    n = sum(g.n for g in gs)
    goods_txt = "; ".join(f"{g.label} on {g.model}: top-{k} KLD mean {g.kld_mean:.3g}, p99 {g.kld_p99:.3g}" for g in gs)
    late = [f"{g.label} on {g.model} lies past its top-{k} row" for g in gs if g.kld_mean > gate_mean or g.kld_p99 > gate_p99]
    passing = [b.label for b in bads if b.kld_mean <= gate_mean and b.kld_p99 <= gate_p99]
    note = (f"{MARGIN}x upper 95% bootstrap CI by prompt of the known-good pairs cut to their top {k} logprobs "
            f"(harness.compare.topk: KLD with the tail as one bucket). Known-good ({cls}): {goods_txt}. Known-bad: the mutants "
            f"on the F32 trained model of their architecture, cut the same way.{commit_txt}")
    dims = {g.model: g.extra["dims"] for g in gs}
    row = {
        "weights": gs[0].weights, "class": cls, "k": int(k), "file_type": gs[0].extra["file_type"],
        "basis_models": [{kk: d[kk] for kk in ("name", "sha256", "arch", "n_layer", "n_embd")} for d in dims.values()],
        "gates": {
            "max_topk_kld_mean": {"value": gate_mean, "basis": _basis(command, n, base_spec, max(g.kld_mean for g in gs),
                                  [(b.kld_mean, b.label) for b in sorted(bads, key=lambda b: b.kld_mean)], note, gate_mean, False)},
            "max_topk_kld_p99": {"value": gate_p99, "basis": _basis(command, n, base_spec, max(g.kld_p99 for g in gs),
                                 [(b.kld_p99, b.label) for b in sorted(bads, key=lambda b: b.kld_p99)], note, gate_p99, False)},
        },
    }
    return row, passing, late


def merge_topk_rows(path: str | Path, rows: list[dict[str, Any]]) -> Path:
    """thresholds.yaml at ``path`` with ``rows`` replacing the top-k rows of the same weights ×
    class × k (every other number kept as it is), written by ``write_thresholds``."""
    from harness.gates.thresholds import load_thresholds

    doc = dict(load_thresholds(path).data)
    keys = {(r["weights"], r["class"], r["k"]) for r in rows}
    kept = [r for r in doc.get("topk", []) if (r["weights"], r["class"], r["k"]) not in keys]
    doc["topk"] = kept + rows
    return write_thresholds(doc, path)
