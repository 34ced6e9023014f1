"""First-divergence localization against the oracle."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from harness.runs.localize import LocalizeRequest, localize_activations, run_localize
from harness.engines.registry import resolve_engine
from harness.errors import Verdict
from harness.fixtures import synthetic as fx
from harness.model.gguf_model import GGUFModel


@pytest.fixture(scope="module")
def tiny():
    path = fx.build("tiny-qwen35")
    oracle = resolve_engine("oracle", path)
    toks = list(range(40, 140))
    return GGUFModel(path).hparams, oracle.activations(toks)


def test_llamacpp_localizes_clean_on_f32_and_compares_every_layer():
    loc = run_localize(LocalizeRequest(model="fixture:tiny-qwen35", candidate="llama.cpp"))
    assert loc.verdict is Verdict.PASS and loc.first is None
    assert loc.compared > 150
    layers = {e["layer"]: e for e in loc.per_layer}
    assert set(layers) == set(range(8)) | {-1}
    assert all(e["compared"] >= 15 for k, e in layers.items() if k >= 0)
    assert max(e["max_nmse"] for e in loc.per_layer) < 1e-6


def test_planted_fault_is_localized_to_its_layer_and_tensor(tiny):
    hp, acts = tiny
    cand = {k: v.copy() for k, v in acts.items()}
    cand["gate-5"][30:] *= 1.5  # planted in layer 5's DeltaNet decay from position 30 on
    for k in ("l_out-6", "l_out-7", "result_norm"):  # and, as a real fault would, downstream
        cand[k] = cand[k] * 1.1
    loc = localize_activations(hp, acts, cand, 1e-4, 0.999, "planted")
    assert loc.verdict is Verdict.FAIL
    assert (loc.first.name, loc.first.layer, loc.first.layer_type, loc.first.position) == ("gate-5", 5, "recurrent", 30)


def test_nothing_comparable_is_unmeasured(tiny):
    hp, acts = tiny
    loc = localize_activations(hp, acts, {"unrelated": np.zeros(3)}, 1e-4, 0.999)
    assert loc.verdict is Verdict.UNMEASURED and loc.compared == 0


def test_cli_localize_llamacpp_prints_counts():
    r = subprocess.run([sys.executable, "-m", "harness", "localize", "--candidate", "llama.cpp", "--model", "fixture:tiny-qwen35", "--max-tokens", "40"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "tensors compared" in r.stdout and "no tensor over the bounds" in r.stdout


# mutant -> (model, layer of the first divergent tensor). The layer type and op are the mutant table's
# (harness.engines.mutants.SHOWS_FIRST_AT, which localize failures quote as the likely cause); this
# test checks them. Faults in state carried between calls are localized with the prompt fed in two
# pieces; "nondeterministic" is not a forward fault (the determinism probe catches it) and localizes clean.
LOCALIZATION_MATRIX = {
    "attn-output-gate-dropped": ("tiny-qwen35", 3),
    "qk-norm-skipped": ("tiny-qwen35", 3),
    "rope-full-head": ("tiny-qwen35", 3),
    "q-gate-split-halves": ("tiny-qwen35", 3),
    "gqa-kv-tiled": ("tiny-qwen35", 3),
    "gdn-heads-grouped": ("tiny-qwen35", 0),
    "ssm-a-as-a-log": ("tiny-qwen35", 0),
    "dt-bias-dropped": ("tiny-qwen35", 0),
    "gdn-l2norm-skipped": ("tiny-qwen35", 0),
    "beta-sigmoid-dropped": ("tiny-qwen35", 0),
    "conv-kernel-flipped": ("tiny-qwen35", 0),
    "conv-state-dropped": ("tiny-qwen35", 0),
    "ssm-state-reset": ("tiny-qwen35", 0),
    "gdn-chunk-state-not-carried": ("tiny-qwen35", 0),
    "gdn-read-before-decay": ("tiny-qwen35", 0),
    "gdn-state-per-k-head": ("tiny-qwen35", 0),
    "ssm-norm-shifted": ("tiny-qwen35", 0),
    "schedule-off-by-one": ("tiny-qwen35", 0),
    "norm-shift-twice": ("tiny-qwen35", 0),
    "final-norm-shift-missing": ("tiny-qwen35", -1),
    "residual-after-norm": ("tiny-qwen35", 0),
    "nondeterministic": ("tiny-qwen35", None),
    "moe-weights-unnormalized": ("tiny-qwen35moe", 0),
    "shexp-gate-ignored": ("tiny-qwen35moe", 0),
}
CHUNKED = {"conv-state-dropped", "ssm-state-reset"}


@pytest.fixture(scope="module")
def oracle_acts():
    toks = list(range(40, 128))  # 88 > 64: the chunk-parallel delta rule spans a chunk boundary
    out = {}
    for fxn in ("tiny-qwen35", "tiny-qwen35moe"):
        o = resolve_engine("oracle", fx.build(fxn))
        out[fxn] = (o.activations(toks), o.activations(toks, [40, 48]))
    return toks, out


def test_every_mutant_is_localized_to_its_layer_type_and_op(oracle_acts):
    from harness.engines.mutants import MUTANTS, SHOWS_FIRST_AT

    assert set(LOCALIZATION_MATRIX) == set(MUTANTS) == set(SHOWS_FIRST_AT)
    toks, acts = oracle_acts
    got, expected = {}, {}
    for name, (fxn, layer) in LOCALIZATION_MATRIX.items():
        path = fx.build(fxn)
        chunks = [40, 48] if name in CHUNKED else None
        ref = acts[fxn][1] if chunks else acts[fxn][0]
        loc = localize_activations(GGUFModel(path).hparams, ref, resolve_engine(f"mutant:{name}", path).activations(toks, chunks), 1e-4, 0.999, name)
        f = loc.first
        got[name] = None if f is None else (f.layer_type, f.op, f.layer)
        expected[name] = None if SHOWS_FIRST_AT[name] is None else (*SHOWS_FIRST_AT[name], layer)
    wrong = {k: (got[k], expected[k]) for k in LOCALIZATION_MATRIX if got[k] != expected[k]}
    assert not wrong, f"localized (got, expected): {wrong}"


def test_cli_localize_failure_is_a_reproducer():
    """A real divergence prints what test-backend-ops would: candidate, model sha256, prompt,
    n_tokens, chunks, the numbers, the mutant table's bug class for that op, and the rerun command."""
    from harness.measure.prompts import load_prompt_set

    argv = ["localize", "--candidate", "mutant:attn-output-gate-dropped", "--model", "fixture:tiny-qwen35", "--max-tokens", "40",
            "--chunks", "16,24"]
    r = subprocess.run([sys.executable, "-m", "harness", *argv], capture_output=True, text=True, timeout=300)
    assert r.returncode == 1, r.stdout + r.stderr
    line = next(x for x in r.stdout.splitlines() if x.startswith("FAIL: first divergence"))
    sha = GGUFModel(fx.build("tiny-qwen35")).sha256[:12]
    prompt = load_prompt_set(None).prompts[0].id
    assert line.startswith("FAIL: first divergence: layer 3 (attention), mixer sub-block, tensor attn_gated-3 at position 0: NMSE ")
    assert (f"(candidate mutant:attn-output-gate-dropped, model fixture:tiny-qwen35 sha256 {sha}, prompt {prompt!r}, "
            f"n_tokens 40, chunks [16, 24]); likely cause: attention output gate dropped (as mutant:attn-output-gate-dropped); "
            f"reproduce: harness {' '.join(argv[:5])} --prompt {prompt} --max-tokens 40 --chunks 16,24") in line
    nmse = float(line.split("NMSE ")[1].split(",")[0])
    assert nmse > 1e-4  # over the default bound, as the verdict says


def test_report_likely_causes_come_from_the_mutant_table():
    """A verdict page's likely cause (harness.judge.causes) is the mutants whose first divergence
    is the same op in the same kind of layer (SHOWS_FIRST_AT, checked above against real runs),
    with what that op computes; every op a mutant first diverges at is described."""
    from harness.judge.causes import OPS, explain
    from harness.engines.mutants import SHOWS_FIRST_AT

    assert {at[1] for at in SHOWS_FIRST_AT.values() if at} <= set(OPS)
    ex = explain({"layer": 3, "layer_type": "attention", "op": "Qcur_normed"})
    assert {c.mutant for c in ex["causes"]} == {"qk-norm-skipped", "q-gate-split-halves"}
    assert "QK-norm skipped" in ex["summary"] and ex["op_meaning"].startswith("Q after the per-head RMSNorm")
    assert explain({"layer": 1, "layer_type": "recurrent", "op": "z"})["causes"] == []


def test_each_tensor_is_labelled_by_its_sub_block():
    from harness.runs.localize import sub_block

    dense, moe = GGUFModel(fx.build("tiny-qwen35")).hparams, GGUFModel(fx.build("tiny-qwen35moe")).hparams
    assert [sub_block(dense, 2, op) for op in ("attn_norm", "conv_output_silu", "Qcur_normed", "attn_gated", "attn_residual")] == ["mixer"] * 5
    assert [sub_block(dense, 2, op) for op in ("attn_post_norm", "ffn_out", "post_ffn")] == ["ffn"] * 3
    assert [sub_block(moe, 2, op) for op in ("ffn_moe_probs", "ffn_shexp", "ffn_out", "post_moe")] == ["moe"] * 4
    assert (sub_block(dense, 2, "l_out"), sub_block(dense, -1, "result_norm"), sub_block(dense, -1, "model.input_embed")) == \
        ("block output", "output", "input")
