"""Calibration: the calibrated tier's rows from measurement, and which gate catches which
known-bad engine.

Known-good pairs are candidate vs llama.cpp (the reference, default settings: extra buffer types
off), one set of real engines per compute class (``KNOWN_GOOD``):

- ``f64``: the exact oracle;
- ``f32``: llama.cpp itself at another ``n_ubatch`` and thread count and with its extra buffer
  types on (``llama.cpp repack``, on a CPU without AMX: ``plan.REPACK_NEEDS``), and transformers in float32
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

The MTP draft head's rows (``mtp:``, the calibrated tier of ``harness parity --mtp``) are measured
on their own by ``harness.runs.calibrate.mtp.calibrate_mtp`` (``harness calibrate --mtp``).
"""

from __future__ import annotations

import datetime
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import yaml

from harness.engines.base import COMPUTE_CLASSES, gather
from harness.errors import HarnessError, InvalidInput, Verdict
from harness.judge.tiers import Row
from harness.measure import metrics
from harness.runs.calibrate.document import (  # noqa: F401  (re-exported: harness.runs.calibrate.NAME)
    HEADER,
    CalibrationResult,
    _basis,
    _floors_text,
    _row_document,
    _topk_row,
    matrix_markdown,
    merge_probe_rows,
    merge_topk_rows,
    moe_excursions_document,
    probe_document,
    section_rows,
    thresholds_document,
    write_calibration,
    write_thresholds,
)
from harness.runs.calibrate.fit import (  # noqa: F401  (re-exported: harness.runs.calibrate.NAME)
    PairStats,
    _f32_row,
    _round_up,
    bootstrap_by_prompt,
    caught,
    class_detection,
    consistency_problems,
    propose,
    propose_probes,
    rows_from_goods,
)
from harness.runs.calibrate.pairs import (  # noqa: F401  (re-exported: harness.runs.calibrate.NAME)
    CachedReference,
    ModelMeasurement,
    ReleaseExcuses,
    RouterFlips,
    _extra_floor_models,
    _measured,
    _probe_engines,
    _prompts,
    _self_comparisons,
    _worst,
    localization_bounds,
    measure_goods,
    measure_mutants,
    measure_pair,
    measure_topk_pair,
    moe_excursions,
    open_for_calibration,
    probe_floors,
    quantized_weights,
    weights_probe_files,
    weights_probe_floors,
    release_excuses,
)
from harness.runs.calibrate.plan import (  # noqa: F401  (re-exported: harness.runs.calibrate.NAME)
    CLASS_MEMBERS,
    EXCURSION_MODELS,
    EXTRA_FLOOR_CLASSES,
    GATES,
    KNOWN_GOOD,
    MARGIN,
    MIN_STEP,
    MOE_EXCURSION_MARGIN,
    MOE_EXCURSION_MIN,
    MOE_ROUTER_MAX_GAP,
    MOE_SHARE_WHY,
    MOE_TIE_WHY,
    NEEDS_REAL_ENGINE,
    PROBE_FLOOR_MODELS,
    PROBE_MIN_STEP,
    RELEASE,
    TOPK_CLASSES,
    CalibrationPlan,
    CalibrationRefused,
    _llama,
    _lowp,
    _oracle,
    _transformers,
    optional_skips,
    usable,
    have_torch,
)


def calibrate(plan: CalibrationPlan, log: Callable[[str], None] = print) -> CalibrationResult:
    """Run every pair of ``plan`` and propose the thresholds (does not write them). Raises
    ``InvalidInput`` for a mutant name ``MUTANTS`` does not know (before anything runs).

    Long because it is the phases in order, each a named function: open the models, measure the
    known-good pairs per class, make the rows, probe and localization floors, mutants, checks.
    """
    from harness.engines.mutants import MUTANTS
    from harness.runs.probes import ProbeTolerance

    unknown = [m for m in plan.mutants or () if m not in MUTANTS]
    if unknown:  # before any model is opened or measured
        raise InvalidInput(f"unknown mutant {unknown[0]!r}; mutants: {', '.join(MUTANTS)}")
    use_torch = plan.include_transformers and have_torch()
    skipped = optional_skips(plan.include_transformers)
    models: list[ModelMeasurement] = []
    for spec in plan.models():
        tokens = plan.max_tokens if spec in (plan.base_model, plan.moe_model, *dict(plan.floor_models)) else plan.ladder_max_tokens
        try:
            models.append(open_for_calibration(spec, tokens))
        except HarnessError as e:
            skipped.append(f"{spec}: {e}")
    if not models or models[0].spec != plan.base_model:
        raise InvalidInput(f"calibration needs its base model {plan.base_model}")
    goods = [p for mm in models for p in measure_goods(mm, plan.classes_for(mm.spec), plan.include_transformers, log)]
    rows, row_skips = rows_from_goods(goods, plan.classes, use_torch)
    skipped += row_skips
    base = models[0]
    moe = next((mm for mm in models if mm.spec == plan.moe_model), None)
    probes = probe_floors(base.path, [r["class"] for r in rows if r["weights"] == "F32"] or ["f32"], plan.include_transformers, log, extra=True)
    wprobes = weights_probe_floors(weights_probe_files(rows), probes, log)
    localization, oracle_acts = localization_bounds(base.path, base.prompts[0][:96])
    p64 = probes.get("f64", probes.get("f32"))
    ptol = ProbeTolerance(min_cosine=p64["min_cosine"]["value"], max_kld=p64["max_kld"]["value"])
    bads, mut_skips = measure_mutants(plan, base, moe, ptol, localization, oracle_acts, log)
    skipped += mut_skips
    matrix = {b.label: caught(b, r["gates"]) for b in bads if (r := _f32_row(rows, "f64", b)) is not None}
    ex = moe_excursions(dict.fromkeys([moe.spec, *EXCURSION_MODELS[1:]]), probes["f32"], plan.include_transformers, log) if moe is not None and "f32" in probes else None
    return CalibrationResult(goods, bads, rows, probes, localization, matrix, class_detection(bads, rows, probes), skipped,
                             consistency_problems(goods, bads, rows, probes), ex, wprobes)


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
    use_optional = True if use_torch is None else use_torch
    use_torch = have_torch() if use_torch is None else use_torch
    if any(c in NEEDS_REAL_ENGINE for c in CLASS_MEMBERS[compute_class]) and not use_torch:
        raise InvalidInput(f"measuring class {compute_class} needs a real engine of that class beside the emulation "
                           "(transformers): pip install -e .[hf]")
    mm = open_for_calibration(spec, max_tokens)
    goods = measure_goods(mm, [compute_class], use_optional, log)
    probes = probe_floors(mm.path, [compute_class], use_optional, log)[compute_class]
    gates = propose(goods)
    n = sum(g.n for g in goods)
    basis = {name: {"value": v["value"], "basis": _basis("harness calibrate --model " + spec + " --class " + compute_class, max(n, 1), spec,
                                                         v["floor"], [], f"measured on the subject itself by {', '.join(g.label for g in goods)}; "
                                                         f"{MARGIN}x the bootstrap CI by prompt.")} for name, v in gates.items()}
    pbasis = {name: {"value": v["value"], "basis": _basis("harness calibrate --model " + spec + " --class " + compute_class, 1, spec, v["floor"], [],
                                                          "the class engines' own split/decode floor on the subject.")} for name, v in probes.items()}
    row = Row(mm.weights, compute_class, (mm.dims,), basis, pbasis, f"measured on the subject ({spec})", mm.file_type,
              max_tokens=max_tokens)
    return SubjectCalibration(row, goods, mm, optional_skips(use_optional))


def calibrate_probes(base_model: str, moe_model: str | None, classes: Sequence[str], use_torch: bool | None = None,
                     log: Callable[[str], None] = print, rows: Sequence[dict[str, Any]] = ()
                     ) -> tuple[dict[str, dict[str, dict[str, Any]]], dict[str, Any] | None, dict[str, dict[str, dict[str, dict[str, Any]]]]]:
    """``harness calibrate --probes``: only the probe tolerances, per class, on ``base_model``
    (``probe_floors``), per quantized weights key of ``rows`` (the calibrated rows of the
    thresholds file they merge into: ``weights_probe_floors`` on the file each names), and the MoE
    excursion allowance on ``moe_model`` and the other ``EXCURSION_MODELS`` (``moe_excursions``,
    from the f32 bounds). Returns (per class, the allowance or None, per weights key and class).
    Cheaper than a full calibration; raises ``InvalidInput`` for an unknown class."""
    from harness.fixtures.resolve import resolve_model

    unknown = [c for c in classes if c not in CLASS_MEMBERS]
    if unknown:
        raise InvalidInput(f"unknown compute class {unknown[0]!r}; classes: {', '.join(COMPUTE_CLASSES)}")
    use_optional = True if use_torch is None else use_torch
    probes = probe_floors(resolve_model(base_model), list(dict.fromkeys([*classes, "f32"])), use_optional, log, extra=True)
    wprobes = weights_probe_floors(weights_probe_files(rows), {c: v for c, v in probes.items() if c in classes}, log)
    ex = moe_excursions(list(dict.fromkeys([moe_model, *EXCURSION_MODELS[1:]])), probes["f32"], use_optional, log) if moe_model else None
    return {c: v for c, v in probes.items() if c in classes}, ex, wprobes


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
            for label, make, module in KNOWN_GOOD[cls]:
                if not usable(module, use_torch):
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


