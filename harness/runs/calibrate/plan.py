"""What calibration measures: the plan (models, classes, mutants, tokens per prompt), the known-good
engines of each compute class, and the constants of the rule (``MARGIN``, ``MIN_STEP``, the release
gate as declared). Part of ``harness.runs.calibrate``; its module docstring states the rule."""

from __future__ import annotations

import importlib.util

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from harness.engines.base import COMPUTE_CLASSES
from harness.errors import HarnessError, Verdict

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
        "kind": "declared", "who": "harness maintainers (MoE router near-ties at the release gate; harness/measure/near_ties.py)",
        "why": MOE_TIE_WHY, "date": "2026-12-01"}},
    "moe_router_max_excused": {"value": 0.01, "basis": {
        "kind": "declared", "who": "harness maintainers (MoE router near-ties at the release gate; harness/measure/near_ties.py)",
        "why": MOE_SHARE_WHY, "date": "2026-12-01"}},
}
"""The release gate as thresholds.yaml declares it (``moe_router_*``: the positions it excuses on
an MoE model, ``harness.measure.near_ties.release_excuses``)."""


class CalibrationRefused(HarnessError):
    """Known-good pairs spread past a proposed threshold, or a mutant passes every gate (exit 1)."""

    verdict = Verdict.FAIL


PROBE_MIN_STEP = {"f64": (1e-8, 1e-9)}
"""Per class, the smallest probe tolerance (1 − cosine, KLD) where the class engines' own
self-consistency floor is below it; ``(1e-6, 1e-6)`` for a class not listed. An f64 engine fed in
pieces differs from itself fed whole only by float64 summation order, far below 1e-12 after its
logits are rounded to float32 (the oracle's measured floor is cosine 1.0, KLD 0), so 1e-6 would let
a state kept in a narrower format pass: f16 rounding of the recurrent state every 8 decode calls
reaches KLD 1.7e-8 on the default model (``tests/test_state_faults.py``)."""


# ------------------------------------------------------------------------------- the plan
def _llama(path, **settings):
    from harness.engines.llamacpp import LlamaCppEngine, LlamaCppSettings

    return LlamaCppEngine(path, settings=LlamaCppSettings(**settings))


def _llama_repack(path):
    from harness.engines.llamacpp import LlamaCppEngine, LlamaCppSettings

    return LlamaCppEngine(path, settings=LlamaCppSettings(use_extra_bufts=True))


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


def _mlx(dtype: str) -> Callable[[Path], Any]:
    def make(path: Path) -> Any:
        from harness.engines.mlx_engine import load_mlx

        return load_mlx(path, dtype=dtype)
    return make


REPACK_NEEDS = "cpu without AMX"
"""The third field of the known-good ``llama.cpp repack`` (the reference with llama.cpp's extra
buffer types on, ``use_extra_bufts``, as llama.cpp runs by default; its CPU_REPACK kernels round
quantized weights' products otherwise): not a module but the condition it runs under, a CPU
without AMX (``harness.engines.llamacpp.cpu_has_amx``). With AMX, llama.cpp 0.3.36 repacks into an
AMX buffer and segfaults at the first compute on every quantized fixture (llama.cpp #20824), so
there it is left out and named (``optional_skips``)."""


KNOWN_GOOD: dict[str, list[tuple[str, Callable[[Path], Any], str | None]]] = {
    "f64": [("oracle", _oracle, None)],
    "f32": [("llama.cpp n_ubatch=7", lambda p: _llama(p, n_ubatch=7), None),
            ("llama.cpp n_threads=1", lambda p: _llama(p, n_threads=1), None),
            ("llama.cpp repack", _llama_repack, REPACK_NEEDS),
            ("transformers float32", _transformers("float32"), "torch"),
            ("mlx float32", _mlx("float32"), "mlx_lm")],
    "bf16": [("oracle-bf16", _lowp("bf16"), None), ("transformers bfloat16", _transformers("bfloat16"), "torch"),
             ("mlx bfloat16", _mlx("bfloat16"), "mlx_lm")],
    "f16": [("oracle-f16", _lowp("f16"), None), ("transformers float16", _transformers("float16"), "torch"),
            ("mlx float16", _mlx("float16"), "mlx_lm")],
}
"""Compute class → known-good engines of that class: (label, factory(path), the module its extra
provides: ``torch`` for the ``hf`` extra's transformers, ``mlx_lm`` for the ``mlx`` extra (``_mlx``;
the state rows' engines, ``state.STATE_KNOWN_GOOD``, include it); ``REPACK_NEEDS`` for llama.cpp
with extra buffer types; None for an engine that is always there). ``llama.cpp`` at default
settings is the reference itself; its variants are the f32 engines. An engine whose extra is not installed is left out and named (``optional_skips``),
never silently."""


OPTIONAL_EXTRAS = {"torch": "hf", "mlx_lm": "mlx"}
"""The module an optional known-good engine needs → the extra that installs it."""


def have_module(module: str | None) -> bool:
    """Whether an optional engine's module can be imported (None: always); nothing is imported."""
    if module is None:
        return True
    if module == REPACK_NEEDS:
        from harness.engines.llamacpp import cpu_has_amx

        return not cpu_has_amx()
    if module == "torch":
        return have_torch()
    return importlib.util.find_spec(module) is not None


def usable(module: str | None, use_optional: bool) -> bool:
    """Whether a known-good engine needing ``module`` runs: always for None, else when optional
    engines are wanted (``use_optional``: calibrate's default; ``CalibrationPlan.include_transformers``)
    and ``module`` is installed; ``REPACK_NEEDS``: where this CPU has no AMX, optional or not)."""
    if module == REPACK_NEEDS:
        return have_module(module)
    return module is None or (use_optional and have_module(module))


def optional_skips(use_optional: bool) -> list[str]:
    """One line per optional known-good engine family left out, naming why (the extra to install)."""
    out = []
    for module, extra in OPTIONAL_EXTRAS.items():
        labels = sorted({label.split()[0] for goods in KNOWN_GOOD.values() for label, _, m in goods if m == module})
        if not labels:
            continue
        if not use_optional:
            out.append(f"{', '.join(labels)} (every class): optional engines were not asked for")
        elif not have_module(module):
            out.append(f"{', '.join(labels)} (every class): the {extra} extra ({module}) is not installed")
    if not have_module(REPACK_NEEDS):
        out.append("llama.cpp repack (f32): this CPU has AMX (amx_int8), where llama.cpp's AMX path segfaults (llama.cpp #20824)")
    return out


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
    floor_models: tuple[tuple[str, tuple[str, ...]], ...] = (("fixture:tiny-qwen35", COMPUTE_CLASSES),
                                                             ("fixture:tiny-qwen35moe", COMPUTE_CLASSES),
                                                             ("fixture:real-heads-qwen35", COMPUTE_CLASSES),
                                                             ("fixture:real-heads-qwen35-kv1", COMPUTE_CLASSES),
                                                             ("fixture:real-heads-qwen35moe", ("f64", "f32")),
                                                             ("fixture:trained-real-heads-qwen35", COMPUTE_CLASSES))
    """``(model, classes)``: known-good pairs of those classes only (no mutant runs on them),
    joining the F32 rows of their architecture. The random-weight fixtures that sign-offs and CI
    run engines on: their logits are sharper than the trained models' in places (the f16 emulation
    on ``tiny-qwen35``: 1 − cosine 1.0e-4 and KLD mean 6.0e-5, where a row measured on the trained
    fixtures alone allowed 4.8e-5 and 2.5e-5), so every class's row includes them. Every class:
    since their block matrices are scaled down (``FixtureSpec.layer_gain``) a correct bf16 engine
    stays above the release floor on them (oracle-bf16 0.99885 on ``tiny-qwen35``, 0.99498 on
    ``tiny-qwen35moe``; docs/gates.md, "Random fixtures"). The real-head fixtures
    (``REAL_HEAD_FIXTURES``, and the trained ``trained-real-heads-qwen35``) join them, so the rows
    a GPU engine is judged by at Qwen3.5's head sizes include those shapes (issue 56); the MoE one
    at f64/f32 only: oracle-bf16 there has a position at cosine 0.9798 (router gap 0.0053, excused
    at the release gate), and a known-good pair below the floor keeps a group from its row."""
    ladder: tuple[str, ...] | None = None  # None: every TRAINED_LADDER and LOWBIT_LADDER entry plus the F16 bases
    classes: tuple[str, ...] = COMPUTE_CLASSES
    mutants: tuple[str, ...] | None = None  # None: all
    include_transformers: bool = True
    max_tokens: int | None = None
    ladder_max_tokens: int | None = None

    def models(self) -> list[str]:
        from harness.fixtures.lowbit import LOWBIT_LADDER
        from harness.fixtures.synthetic import LADDER_BASES, TRAINED_LADDER

        ladder = self.ladder if self.ladder is not None else tuple(
            f"fixture:{n}" for n in (*LADDER_BASES, *TRAINED_LADDER, *LOWBIT_LADDER))
        return [m for m in (self.base_model, self.moe_model, *(f for f, _ in self.floor_models), *ladder) if m]

    def classes_for(self, spec: str) -> tuple[str, ...]:
        """The classes measured on ``spec``: all of ``classes``, or a floor model's own."""
        own = dict(self.floor_models).get(spec)
        return self.classes if own is None else tuple(c for c in self.classes if c in own)


PROBE_FLOOR_MODELS = ("fixture:tiny-qwen35",)
"""Models whose f64/f32 engines' floor joins the base model's in the probe tolerances calibration
writes to thresholds.yaml (``probe_floors(..., extra=True)``): the random-weight dense fixture,
which sign-offs and CI run f32 engines on (llama.cpp, ``command:example``) and whose logits drifted
further over a long decode when it was drawn unscaled (llama.cpp: 1 − cosine 5.1e-6 against 4.1e-7
on the trained model at 640 tokens; drawn with ``layer_gain`` 0.7 it gives 6.1e-7). Not for
bf16/f16 (``EXTRA_FLOOR_CLASSES``): drawn unscaled, rounding its random weights to 8 mantissa bits
gave 1 − cosine 6.5e-3 there, no measure of a real model's noise; the peaked fixture has not been
measured for these probe floors yet."""


EXTRA_FLOOR_CLASSES = ("f64", "f32")


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


MOE_ROUTER_MAX_GAP = {"value": 1e-3, "basis": {
    "kind": "declared", "who": "harness maintainers (MoE router near-ties in parity; harness/measure/near_ties.py)",
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


# ------------------------------------------------------------------------------- top-k rows
TOPK_CLASSES = ("f64", "f32")
"""Classes whose top-k rows ``calibrate_topk`` measures without the hf extra (bf16/f16 rows need a
real engine of the class, as their calibrated rows do: ``NEEDS_REAL_ENGINE``)."""
