"""The two-tier gate model (harness.judge.tiers): the release gate always judged, a calibrated tier
that applies only where its row fits, classes that decide which row, the low-precision emulation,
and the tier measured on the subject when no row fits."""

from __future__ import annotations

import json
from dataclasses import replace
import subprocess
import sys
import textwrap
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import yaml

from harness.judge import verdicts
from harness.measure import metrics
from harness.engines.oracle.lowp import (
    RoundedWeight,
    load_lowp_oracle,
    round_to,
    rounded_weight,
)
from harness.errors import Verdict
from harness.fixtures import synthetic as fx
from harness.judge import tiers

REPO = Path(__file__).resolve().parents[1]
RELEASE = {"min_cosine": {"value": 0.98}, "min_positions": {"value": 64}}


def per_position(cos: list[float]) -> dict[str, np.ndarray]:
    n = len(cos)
    return {"cosine": np.array(cos, float), "finite": np.ones(n, bool), "ref_finite": np.ones(n, bool)}


def subject(cls: str = "f32", declared: bool = True) -> tiers.Subject:
    return tiers.Subject("F32", "ALL_F32", cls, declared, 8, 96, "0" * 64)


def row(cos: float = 0.9999, kld_mean: float = 1e-6) -> tiers.Row:
    basis = {"kind": "measured"}
    return tiers.Row("F32", "f32", ({"name": "m", "n_layer": 8, "n_embd": 96},),
                     {"min_cosine": {"value": cos, "basis": basis}, "max_kld_mean": {"value": kld_mean, "basis": basis}}, {}, "test row")


def test_release_gate_always_has_a_line_and_a_verdict():
    ok = verdicts.judge_release(per_position([0.999] * 64), RELEASE)
    assert ok.status == "ok" and ok.line == "release gate cosine ≥ 0.98 over ≥ 64 positions: ok, min 0.99900 over 64 positions"
    few = verdicts.judge_release(per_position([0.999] * 63), RELEASE)
    assert few.status == "unmeasured" and few.checks[0].ok is None  # never counted as passed
    bad = verdicts.judge_release(per_position([0.999] * 70 + [0.97]), RELEASE)
    assert bad.status == "fail" and bad.failing_positions == 1 and bad.first_failing == 70 and "(1 below)" in bad.line
    nan = per_position([0.999] * 70)
    nan["finite"][5] = False
    assert verdicts.judge_release(nan, RELEASE).status == "fail"


def test_calibrated_tier_judges_cosine_and_kld_and_says_when_unmeasured():
    pp = per_position([0.99995] * 100)
    ok = verdicts.judge_calibrated(pp, {"kld": {"mean": 5e-7}}, row(), subject())
    assert ok.status == "ok" and [c.name for c in ok.checks] == ["min_cosine", "max_kld_mean"]
    kld = verdicts.judge_calibrated(pp, {"kld": {"mean": 5e-6}}, row(), subject())
    assert kld.status == "fail" and kld.checks[1].ok is False
    cos = verdicts.judge_calibrated(per_position([0.9998] * 100), {"kld": {"mean": 5e-7}}, row(), subject())
    assert cos.status == "fail" and cos.failing_positions == 100
    none = verdicts.judge_calibrated(pp, {}, None, subject("bf16"), "no calibrated row for weights F32 (ALL_F32), class bf16",
                                  "harness calibrate --model m.gguf --class bf16")
    assert none.status == "unmeasured" and none.checks == []
    assert "UNMEASURED" in none.line and "harness calibrate --model m.gguf --class bf16" in none.line


def test_a_row_judges_only_the_architecture_it_was_measured_on():
    """An MoE file's known-good floor is its own (expert routing): a row measured on qwen35moe
    files never judges a dense file of the same weights and class, nor the reverse."""
    basis = {"kind": "measured"}

    def arch_row(arch: str, cos: float) -> tiers.Row:
        return tiers.Row("F32+Q4_K+Q6_K", "f64", ({"name": f"m-{arch}", "arch": arch, "n_layer": 4, "n_embd": 256},),
                         {"min_cosine": {"value": cos, "basis": basis}}, {}, f"{arch} row")

    def subj(arch: str) -> tiers.Subject:
        return tiers.Subject("F32+Q4_K+Q6_K", "Q4_K_M", "f64", True, 4, 256, "0" * 64, arch)

    dense, moe = arch_row("qwen35", 0.995), arch_row("qwen35moe", 0.98)
    assert tiers.find_row([moe, dense], subj("qwen35"))[0] is dense
    assert tiers.find_row([dense, moe], subj("qwen35moe"))[0] is moe
    row, why = tiers.find_row([moe], subj("qwen35"))
    assert row is None and why == "no calibrated row for weights F32+Q4_K+Q6_K (Q4_K_M), class f64 measured on qwen35 models"
    assert moe.misfit(subj("qwen35")) == "measured on qwen35moe models, not qwen35"
    legacy = tiers.Row("F32+Q4_K+Q6_K", "f64", ({"name": "m", "n_layer": 4, "n_embd": 256},), dense.gates, {}, "no arch")
    assert legacy.archs is None and legacy.misfit(subj("qwen35moe")) is None  # a row that does not say fits either


def test_a_row_measured_over_the_first_positions_judges_only_those():
    """A row measured on the subject over each prompt's first N positions (harness calibrate
    --model: 128) judges those positions; later ones, where a recurrent state has drifted further,
    are the release gate's alone."""
    cos = [0.99995] * 100 + [0.9990] * 50
    ref = np.random.default_rng(0).standard_normal((150, 16)).astype(np.float32)
    pp = dict(metrics.position_metrics(ref, ref), cosine=np.array(cos), kld=np.zeros(150), position=np.arange(150),
              prompt_index=np.zeros(150, int))
    bounded = tiers.Row("F32", "f32", ({"name": "m", "n_layer": 8, "n_embd": 96},),
                        {"min_cosine": {"value": 0.9999, "basis": {"kind": "measured"}}}, {}, "measured on the subject", max_tokens=100)
    ok = verdicts.judge_calibrated(pp, {}, bounded, subject())
    assert ok.status == "ok" and "judged over each prompt's first 100 positions" in ok.line and "50 later positions" in ok.line
    whole = verdicts.judge_calibrated(pp, {}, replace(bounded, max_tokens=None), subject())
    assert whole.status == "fail" and whole.failing_positions == 50
    assert bounded.to_receipt()["max_tokens"] == 100 and "max_tokens" not in replace(bounded, max_tokens=None).to_receipt()


def test_verdict_combines_the_tiers():
    rel_ok = verdicts.judge_release(per_position([0.999] * 100), RELEASE)
    rel_bad = verdicts.judge_release(per_position([0.9] * 100), RELEASE)
    cal_ok = verdicts.judge_calibrated(per_position([0.99995] * 100), {"kld": {"mean": 1e-7}}, row(), subject())
    cal_bad = verdicts.judge_calibrated(per_position([0.999] * 100), {"kld": {"mean": 1e-7}}, row(), subject())
    cal_none = verdicts.judge_calibrated(per_position([0.999] * 100), {}, None, subject(), "no row", "cmd")
    assert verdicts.overall(rel_ok, cal_ok, subject())[0] is Verdict.PASS
    assert verdicts.overall(rel_bad, cal_ok, subject())[0] is Verdict.FAIL
    assert verdicts.overall(rel_ok, cal_bad, subject())[0] is Verdict.FAIL
    v, msg = verdicts.overall(rel_ok, cal_none, subject())
    assert v is Verdict.PASS and "verdict is the release gate's" in msg and "cmd" in msg
    assert verdicts.overall(rel_ok, cal_none, subject(), require_calibrated=True)[0] is Verdict.UNMEASURED
    v, msg = verdicts.overall(rel_ok, cal_bad, subject(declared=False))
    assert v is Verdict.FAIL and '"compute_class": "bf16" in info.json' in msg  # the one-line advice


def test_emulation_rounds_to_nearest_even_and_accumulates_in_float32():
    x = np.array([1.0 + 2**-8, 1.0 + 3 * 2**-8, 1.00390625], np.float64)  # halfway cases of bfloat16
    assert round_to(x, ml_dtypes.bfloat16).tolist() == [1.0, 1.015625, 1.0]  # ties to even
    w = rounded_weight(np.random.default_rng(0).normal(size=(5, 7)), ml_dtypes.bfloat16)
    a = np.random.default_rng(1).normal(size=(3, 7))
    got = a @ w.T
    assert type(got) is np.ndarray and got.dtype == np.float32
    want = round_to(a, ml_dtypes.bfloat16) @ np.asarray(w).view(np.ndarray).T
    np.testing.assert_array_equal(got, want.astype(np.float32))
    assert isinstance(w.T, RoundedWeight) and isinstance(w[0], RoundedWeight)


def test_emulated_engines_state_their_class_and_differ_from_the_exact_oracle():
    from harness.engines.base import gather
    from harness.engines.oracle import load_oracle

    path = fx.build("tiny-qwen35")
    toks = list(range(40, 100))
    exact = gather(load_oracle(path).logits(toks))
    for cls in ("bf16", "f16"):
        eng = load_lowp_oracle(path, cls)
        assert eng.info.name == f"oracle-{cls}" and eng.info.compute_class == cls
        got = gather(eng.logits(toks))
        pm = metrics.position_metrics(exact, got)
        assert 0.99 < pm["cosine"].min() < 1 - 1e-7  # close, but a different class of numbers
    assert load_oracle(path).info.compute_class == "f64"


def _bf16_engine_config(tmp_path: Path, declare: bool) -> Path:
    """A command engine that computes in bf16 (the oracle's emulation), declaring it or not."""
    script = tmp_path / "bf16_engine.py"
    script.write_text(textwrap.dedent(f"""
        import json, sys
        import numpy as np
        from harness.engines.base import gather
        from harness.engines.oracle.lowp import load_lowp_oracle
        req = json.load(open(sys.argv[1])); out = sys.argv[2]
        np.save(out + "/logits.npy", gather(load_lowp_oracle(req["model"], "bf16").logits(req["tokens"], req.get("chunks"))))
        info = {{"name": "my-bf16-engine", "version": "1.0", "settings": {{}}}}
        if {declare!r}:
            info["compute_class"] = "bf16"
        json.dump(info, open(out + "/info.json", "w"))
    """))
    cfg = tmp_path / "harness.toml"
    cfg.write_text(f'[engines.bf16]\ncommand = ["{{python}}", "{script}", "{{request}}", "{{out_dir}}"]\ntimeout_s = 300\n')
    return cfg


@pytest.mark.parametrize("declare", [False, True])
def test_a_bf16_engine_that_declares_no_class_is_told_how_and_declared_it_passes(tmp_path, declare):
    env = {**__import__("os").environ, "HARNESS_CONFIG": str(_bf16_engine_config(tmp_path, declare))}
    r = subprocess.run([sys.executable, "-m", "harness", "parity", "--candidate", "command:bf16", "--model", "fixture:trained-qwen35",
                        "--ledger", str(tmp_path / "ev" / "ledger.jsonl"), "--thresholds", str(REPO / "thresholds.yaml")],
                       capture_output=True, text=True, timeout=900, env=env, cwd=tmp_path)
    out = r.stdout + r.stderr
    assert "release gate cosine ≥ 0.98 over ≥ 64 positions: ok" in out
    if declare:
        assert r.returncode == 0, out
        assert "class bf16" in out
    else:
        assert r.returncode == 1, out
        assert 'declare it: "compute_class": "bf16" in info.json' in out
        assert "judged as f32" in out


def _thresholds_without(tmp_path: Path, weights: str) -> Path:
    doc = yaml.safe_load((REPO / "thresholds.yaml").read_text())
    doc["calibrated"] = [r for r in doc["calibrated"] if r["weights"] != weights]
    p = tmp_path / "thresholds.yaml"
    p.write_text(yaml.safe_dump(doc, sort_keys=False))
    return p


def test_no_row_the_tier_is_measured_on_the_subject_or_unmeasured_with_the_command(tmp_path):
    th = _thresholds_without(tmp_path, "F32+Q8_0")
    ledger = tmp_path / "ev" / "ledger.jsonl"
    base = [sys.executable, "-m", "harness", "parity", "--candidate", "oracle", "--model", "fixture:trained-qwen35-256-Q8_0",
            "--thresholds", str(th), "--ledger", str(ledger)]

    r = subprocess.run(base + ["--no-calibrate"], capture_output=True, text=True, timeout=900, cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "calibrated tier (weights F32+Q8_0 (Q8_0), class f64): UNMEASURED" in r.stdout
    assert "harness calibrate --model fixture:trained-qwen35-256-Q8_0 --class f64" in r.stdout
    assert "verdict is the release gate's" in r.stdout

    r = subprocess.run(base + ["--no-calibrate", "--require-calibrated"], capture_output=True, text=True, timeout=900, cwd=tmp_path)
    assert r.returncode == 5, r.stdout + r.stderr

    r = subprocess.run(base + ["--json"], capture_output=True, text=True, timeout=900, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    rec = json.loads(r.stdout)
    assert rec["gated"]["calibrated"]["status"] == "ok" and rec["gated"]["verdict"] == "PASS"
    cal_id = rec["thresholds"]["self_calibration"]
    assert cal_id and rec["thresholds"]["calibrated"]["source"] == f"calibration receipt {cal_id[:12]}"
    rows = [json.loads(line) for line in ledger.read_text().splitlines()]
    assert [x["kind"] for x in rows] == ["parity", "parity", "calibration", "parity"]
    assert rows[2]["receipt_id"] == cal_id and rows[2]["compute_class"] == "f64"
    cal = json.loads((ledger.parent / "receipts" / cal_id[:2] / f"{cal_id}.json").read_text())
    assert cal["schema"] == "harness-calibration-receipt/v1" and cal["model"]["weights"] == "F32+Q8_0"

    # a second run reuses the recorded row: no new calibration
    r = subprocess.run(base + ["--json"], capture_output=True, text=True, timeout=900, cwd=tmp_path)
    assert json.loads(r.stdout)["thresholds"]["self_calibration"] == cal_id
    assert [json.loads(line)["kind"] for line in ledger.read_text().splitlines()][-1] == "parity"
    v = subprocess.run([sys.executable, "-m", "harness", "ledger", "verify", "--ledger", str(ledger)], capture_output=True, text=True)
    assert v.returncode == 0, v.stdout
