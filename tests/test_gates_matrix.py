"""The known-good matrix: every known-good engine of every class × every shipped file type (dense
and MoE), the low-bit i-quant files (``LOWBIT_LADDER``), the real-head fixtures and the two
random-weight fixtures sign-offs and CI run (``tiny-qwen35``, ``tiny-qwen35moe``) PASSes against llama.cpp under the committed thresholds, and gates calibrated
without a model give no FAIL on it (held out). Slow and needs the hf extra (transformers):

    pip install -e .[hf] && pytest -m "slow and hf" tests/test_gates_matrix.py
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from harness.runs.parity import judge_cell, measure_cell, router_near_ties, subject_of
from harness.measure.prompts import load_prompt_set, tokenize_prompts
from harness.engines.llamacpp import LlamaCppEngine
from harness.engines.registry import resolve_engine
from harness.runs import exact_check
from harness.errors import Verdict
from harness.fixtures import synthetic as fx
from harness.runs.calibrate import KNOWN_GOOD
from harness.runs.calibrate.plan import OPTIONAL_EXTRAS, REPACK_NEEDS, have_module
from harness.judge.thresholds import load_thresholds
from harness.model.gguf_model import GGUFModel

pytestmark = [pytest.mark.slow, pytest.mark.hf]
REPO = Path(__file__).resolve().parents[1]
_COMMITTED = fx.trained_fixtures()
MODELS = ["trained-qwen35", "trained-qwen35moe", "tiny-qwen35", "tiny-qwen35moe"] + [b for b in fx.LADDER_BASES if b in _COMMITTED] + [
    n for n, (base, _) in fx.TRAINED_LADDER.items() if base in _COMMITTED] + [
    n for n, (base, _) in fx.LOWBIT_LADDER.items() if base in _COMMITTED] + [
    "real-heads-qwen35", "real-heads-qwen35-kv1", "trained-real-heads-qwen35"]
MOE_F64_F32_ONLY = {"real-heads-qwen35moe"}  # calibrated at f64/f32 only (plan.CalibrationPlan.floor_models)
MODELS_F32 = sorted(MOE_F64_F32_ONLY)
ENGINES = [(cls, label, make, module) for cls, goods in KNOWN_GOOD.items() for label, make, module in goods]


def _needs(module):
    """Skip, naming the extra, when an optional known-good engine's module is not installed (the
    matrix itself runs under the hf marker, so torch is asked for every engine)."""
    pytest.importorskip("torch", reason="the hf extra (torch, transformers) is not installed")
    if module == REPACK_NEEDS and not have_module(module):
        pytest.skip("llama.cpp repack: this CPU has AMX, where llama.cpp's AMX path segfaults (llama.cpp #20824)")
    if module is not None and not have_module(module):
        pytest.skip(f"{module} is not installed: pip install -e .[{OPTIONAL_EXTRAS[module]}]")


def _judge(model: str, make, thresholds: Path):
    path = fx.build(model)
    gm = GGUFModel(path)
    ref = LlamaCppEngine(path)
    pset = load_prompt_set(None)
    prompts = tokenize_prompts(pset, ref)
    m = measure_cell(gm, ref, make(path), prompts)
    th = load_thresholds(thresholds)
    resolved = th.resolve(subject_of(gm, m.candidate_info), f"fixture:{model}")
    excuses, cuts = router_near_ties(m, resolved, gm, ref)  # as harness parity judges an MoE model (docs/gates.md)
    res = judge_cell(m, resolved.release_gates, resolved.row, resolved.subject, th.near_tie_margin, resolved.row_misfit,
                     cuts=cuts, excuses=excuses)
    if exact_check.applies(gm, m.candidate_info):  # a low-bit i-quant file: against the oracle too, as harness parity judges
        ex = exact_check.run(gm, th, make(path), m.candidate_info, prompts, lambda: resolve_engine("oracle", path), measure_cell,
                             th.near_tie_margin)
        verdict, message = exact_check.combine(res.verdict, res.message, ex)
        res = replace(res, verdict=verdict, message=message)
    return res, resolved


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("cls, label, make, module", ENGINES, ids=[e[1] for e in ENGINES])
def test_known_good_engines_pass_on_every_file_type(model, cls, label, make, module):
    _needs(module)
    res, resolved = _judge(model, make, REPO / "thresholds.yaml")
    assert resolved.row is not None, f"{label} on {model}: no calibrated row ({resolved.row_misfit})"
    assert res.verdict is Verdict.PASS, f"{label} ({cls}) on {model}: {res.message}"


@pytest.mark.parametrize("model", MODELS_F32)
@pytest.mark.parametrize("cls, label, make, module", [e for e in ENGINES if e[0] in ("f64", "f32")],
                         ids=[e[1] for e in ENGINES if e[0] in ("f64", "f32")])
def test_known_good_engines_pass_on_models_calibrated_at_f32(model, cls, label, make, module):
    """The real-head MoE fixture is in the f64/f32 rows only (oracle-bf16 has a position at cosine
    0.9798 there, at a router near-tie): its f64 and f32 engines PASS."""
    _needs(module)
    res, resolved = _judge(model, make, REPO / "thresholds.yaml")
    assert resolved.row is not None, f"{label} on {model}: no calibrated row ({resolved.row_misfit})"
    assert res.verdict is Verdict.PASS, f"{label} ({cls}) on {model}: {res.message}"


@pytest.mark.parametrize("cls, label, make, module", ENGINES, ids=[e[1] for e in ENGINES])
def test_held_out_model_gives_no_fail(cls, label, make, module):
    """trained-qwen35-heldout (another seed) is in no row's basis: the committed F32 rows, measured
    without it, judge it, and no known-good engine FAILs."""
    _needs(module)
    if "trained-qwen35-heldout" not in fx.trained_fixtures():
        pytest.fail("the held-out fixture trained-qwen35-heldout is not committed")
    th = load_thresholds(REPO / "thresholds.yaml")
    assert all("heldout" not in m["name"] for r in th.rows for m in r.basis_models)
    res, resolved = _judge("trained-qwen35-heldout", make, REPO / "thresholds.yaml")
    assert resolved.row is not None
    assert res.verdict is Verdict.PASS, f"{label} ({cls}) on the held-out model: {res.message}"
