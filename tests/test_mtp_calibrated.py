"""The MTP cell's calibrated tier: the ``mtp:`` rows of thresholds.yaml (schema, loader, merge) and
the cell's checks judged by both tiers (``harness.runs.mtp.judge_check`` with ``mtp_tier``).

The engine-driven tests share one llama.cpp MTP-context call on ``fixture:tiny-qwen35-mtp`` (the
reference draft logits of one shipped prompt, cut as the cell cuts it) and judge the committed rows
of thresholds.yaml, as written by ``harness calibrate --mtp``.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import numpy as np
import pytest
import yaml

from harness.errors import InvalidInput
from harness.judge.thresholds import load_thresholds
from harness.judge.tiers import Subject
from harness.runs.calibrate.document import write_thresholds
from harness.runs.calibrate.mtp import merge_mtp_rows
from harness.runs.calibrate.plan import RELEASE
from harness.runs.mtp import MTP_CALIBRATE_COMMAND, judge_check, mtp_tier

REPO = Path(__file__).resolve().parents[1]
MODEL = "fixture:tiny-qwen35-mtp"


def _basis(value: float) -> dict:
    return {"kind": "measured", "command": "harness calibrate --mtp", "n": 10, "model": MODEL, "date": "2026-12-02",
            "known_good_floor": value, "known_bad": [{"value": 0.5, "what": "mutant:mtp-concat-swapped"}]}


def _row(cls: str = "f64", arch: str = "qwen35", cos: float = 0.99999, kmean: float = 1e-6) -> dict:
    return {"weights": "F32", "class": cls, "file_type": "ALL_F32", "max_tokens": 256,
            "basis_models": [{"name": MODEL, "arch": arch, "n_layer": 8, "n_embd": 64}],
            "gates": {"min_cosine": {"value": cos, "basis": _basis(cos)}, "max_kld_mean": {"value": kmean, "basis": _basis(kmean)},
                      "max_kld_p99": {"value": 1e-5, "basis": _basis(1e-5)}}}


def _subject(cls: str = "f64", arch: str = "qwen35", n_layer: int = 8) -> Subject:
    return Subject("F32", "ALL_F32", cls, True, n_layer, 64, "", arch)


@pytest.fixture
def bare(tmp_path):
    """A thresholds file with the release gate and one trunk row, no ``mtp:`` section."""
    trunk = copy.deepcopy(_row())
    trunk.pop("max_tokens")
    doc = {"schema": "harness-thresholds/v2", "release": RELEASE, "calibrated": [trunk]}
    return write_thresholds(doc, tmp_path / "thresholds.yaml")


def test_a_file_without_mtp_rows_loads_and_leaves_the_tier_unmeasured(bare):
    th = load_thresholds(bare)
    assert th.mtp_rows == []
    row, why = th.resolve_mtp(_subject())
    assert row is None and why == "no MTP row for weights F32 (ALL_F32), class f64"
    tier = mtp_tier(th, _subject())
    assert tier.command == MTP_CALIBRATE_COMMAND and tier.to_receipt() == {"status": "unmeasured", "reason": why,
                                                                           "command": MTP_CALIBRATE_COMMAND}


def test_merged_mtp_rows_round_trip_and_leave_other_sections_alone(bare):
    before = load_thresholds(bare).data
    merge_mtp_rows(bare, [_row("f64"), _row("f32", cos=0.9999, kmean=3e-6), _row("f64", arch="qwen35moe", cos=0.9998)])
    th = load_thresholds(bare)
    assert {k: v for k, v in th.data.items() if k != "mtp"} == before
    row, why = th.resolve_mtp(_subject("f32"))
    assert why == "" and row.compute_class == "f32" and row.source.endswith("mtp[1]") and row.max_tokens == 256
    assert row.gates["min_cosine"]["value"] == 0.9999 and row.gates["max_kld_mean"]["value"] == 3e-6
    moe, _ = th.resolve_mtp(_subject("f64", "qwen35moe"))
    assert moe.source.endswith("mtp[2]") and moe.gates["min_cosine"]["value"] == 0.9998
    # re-measuring a key replaces its row; the others stay
    merge_mtp_rows(bare, [_row("f64", cos=0.99995)])
    th = load_thresholds(bare)
    assert len(th.mtp_rows) == 3 and th.resolve_mtp(_subject("f64"))[0].gates["min_cosine"]["value"] == 0.99995
    # a row fits within 2x its basis model, never a deeper model, never another class
    assert th.resolve_mtp(_subject("f64", n_layer=17))[0] is None
    assert th.resolve_mtp(_subject("bf16"))[0] is None


def _write(tmp_path, rows):
    p = tmp_path / "t.yaml"
    p.write_text(yaml.safe_dump({"schema": "harness-thresholds/v2", "release": RELEASE, "mtp": rows}))
    return p


def test_bad_mtp_rows_refuse_to_load(tmp_path):
    with pytest.raises(InvalidInput, match=r"mtp\[0\] .* looser than the release floor 0.98"):
        load_thresholds(_write(tmp_path, [_row(cos=0.97)]))
    with pytest.raises(InvalidInput, match=r"mtp\[1\] .* repeats the key of mtp\[0\]"):
        load_thresholds(_write(tmp_path, [_row(), _row(cos=0.9999)]))
    no_basis = _row()
    no_basis["gates"]["max_kld_p99"] = {"value": 1e-5}
    with pytest.raises(InvalidInput, match=r"mtp\.0\.gates\.max_kld_p99 has no basis"):
        load_thresholds(_write(tmp_path, [no_basis]))
    no_arch = _row()
    del no_arch["basis_models"][0]["arch"]
    with pytest.raises(InvalidInput, match="'arch' is a required property"):
        load_thresholds(_write(tmp_path, [no_arch]))
    no_kld = _row()
    del no_kld["gates"]["max_kld_mean"]
    with pytest.raises(InvalidInput, match="max_kld_mean"):
        load_thresholds(_write(tmp_path, [no_kld]))


# ------------------------------------------------------------------ the cell, on the committed rows
@pytest.fixture(scope="module")
def drafts():
    """(tokens, reference draft logits [T−1, V]) of the first shipped prompt cut to 120 tokens,
    from llama.cpp's MTP context on the MTP fixture (llama.cpp row convention)."""
    from harness.engines.llamacpp import LlamaCppEngine
    from harness.fixtures.resolve import resolve_model
    from harness.measure.prompts import load_prompt_set, tokenize_prompts

    path = resolve_model(MODEL)
    ref = LlamaCppEngine(path)
    toks = list(tokenize_prompts(load_prompt_set(None), ref)[0].tokens[:120])
    return path, toks, ref.draft(toks).logits


@pytest.fixture(scope="module")
def committed():
    return load_thresholds(REPO / "thresholds.yaml")


def _judge(committed, path, toks, ref, cand_logits, cls):
    from harness.model.gguf_model import GGUFModel
    from harness.runs.inputs import subject_of

    tier = mtp_tier(committed, subject_of(GGUFModel(path), {"compute_class": cls}))
    return judge_check("whole", [("prose-deltanet", ref, cand_logits)], committed.data["release"], True, tier), tier


def test_the_oracle_passes_both_tiers(drafts, committed):
    from harness.engines.oracle import load_oracle

    path, toks, ref = drafts
    check, tier = _judge(committed, path, toks, ref, load_oracle(path).draft(toks).logits, "f64")
    assert tier.row is not None and "mtp[" in tier.row.source and tier.row.compute_class == "f64"
    assert check.verdict.value == "PASS" and check.positions == len(toks) - 1
    assert check.calibrated["status"] == "ok" and all(c["ok"] for c in check.calibrated["checks"])
    assert [c["name"] for c in check.calibrated["checks"]] == ["min_cosine", "max_kld_mean", "max_kld_p99"]
    assert "release gate cosine ≥ 0.98" in check.line and f"calibrated tier (weights F32 (ALL_F32), class f64, {tier.row.source})" in check.line


def test_a_mutant_fails_the_calibrated_tier(drafts, committed):
    from harness.engines.mutants import load_mutant

    path, toks, ref = drafts
    check, _ = _judge(committed, path, toks, ref, load_mutant("mtp-head-norm-skipped", path).draft(toks).logits, "f64")
    assert check.verdict.value == "FAIL" and check.calibrated["status"] == "fail"
    failed = {c["name"] for c in check.calibrated["checks"] if c["ok"] is False}
    assert "max_kld_mean" in failed and check.first_failing is not None


def test_a_bf16_candidate_is_unmeasured_at_the_calibrated_tier_and_judged_at_the_release_floor(drafts, committed):
    from harness.engines.mutants import load_mutant
    from harness.engines.oracle import load_oracle

    path, toks, ref = drafts
    check, tier = _judge(committed, path, toks, ref, load_oracle(path).draft(toks).logits, "bf16")
    assert tier.row is None and tier.command is None and "no bf16 engine or emulation runs the MTP head" in tier.reason
    assert check.verdict.value == "PASS" and check.calibrated["status"] == "unmeasured"
    assert "calibrated tier (weights F32 (ALL_F32), class bf16): UNMEASURED" in check.line
    # the release floor still judges it: a head fed the pre-norm hidden state falls below 0.98
    bad, _ = _judge(committed, path, toks, ref, load_mutant("mtp-prenorm-hidden", path).draft(toks).logits, "bf16")
    assert bad.verdict.value == "FAIL" and bad.calibrated["status"] == "unmeasured" and "release gate" in bad.line and "FAIL" in bad.line
