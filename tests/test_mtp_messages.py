"""What an MTP FAIL names (harness/runs/mtp.py, issue 54): the first row that failed either tier
(not the first below the release gate), the worst contributor when only an aggregate bound (KLD
mean) failed, and a likely cause of the chunked check that does not blame the chunked prefill when
``whole`` failed too. Synthetic logits, no engine: each test fails on the code before the fix."""

from __future__ import annotations

import numpy as np
import pytest
import yaml

from harness.errors import Verdict
from harness.judge.reproducer import Reproducer
from harness.judge.thresholds import load_thresholds
from harness.judge.tiers import Subject
from harness.runs.calibrate.plan import RELEASE
from harness.runs.mtp import MtpCheck, _add_reproducers, judge_check, mtp_tier

V, R = 16, 80
RNG = np.random.default_rng(54)


def _tier(tmp_path, cos: float = 0.99, kmean: float = 1e-6):
    basis = {"kind": "measured", "command": "harness calibrate --mtp", "n": 10, "model": "fixture:tiny-qwen35-mtp", "date": "2026-12-04",
             "known_good_floor": cos, "known_bad": [{"value": 0.5, "what": "mutant:mtp-concat-swapped"}]}
    row = {"weights": "F32", "class": "f64", "file_type": "ALL_F32", "max_tokens": 256,
           "basis_models": [{"name": "fixture:tiny-qwen35-mtp", "arch": "qwen35", "n_layer": 8, "n_embd": 64}],
           "gates": {"min_cosine": {"value": cos, "basis": basis}, "max_kld_mean": {"value": kmean, "basis": basis},
                     "max_kld_p99": {"value": 1.0, "basis": basis}}}
    p = tmp_path / "t.yaml"
    p.write_text(yaml.safe_dump({"schema": "harness-thresholds/v2", "release": RELEASE, "mtp": [row]}))
    th = load_thresholds(p)
    tier = mtp_tier(th, Subject("F32", "ALL_F32", "f64", True, 8, 64, "", "qwen35"))
    assert tier.row is not None
    return th.data["release"], tier


def _bend(row: np.ndarray, cos: float) -> np.ndarray:
    """``row`` turned to cosine ``cos`` with itself (same norm)."""
    u = RNG.standard_normal(row.shape)
    u -= (u @ row) / (row @ row) * row
    u *= np.linalg.norm(row) / np.linalg.norm(u)
    return (cos * row + np.sqrt(1 - cos * cos) * u).astype(np.float32)


def test_the_fail_names_the_first_row_failing_the_calibrated_tier(tmp_path):
    release, tier = _tier(tmp_path)
    ref = RNG.standard_normal((R, V)).astype(np.float32)
    cand = ref.copy()
    cand[0] = _bend(ref[0], 0.985)  # above the release floor 0.98, below the calibrated 0.99
    cand[9] = _bend(ref[9], 0.5)  # below both
    check = judge_check("whole", [("a", ref, cand)], release, True, tier)
    assert check.verdict is Verdict.FAIL
    assert check.first_failing["row"] == 0 and check.first_failing["prompt"] == "a"


def test_an_aggregate_fail_names_prompt_and_row_of_the_worst_contributor(tmp_path):
    release, tier = _tier(tmp_path)
    ref = RNG.standard_normal((2, R // 2, V)).astype(np.float32)
    cand = ref.copy()
    cand[1, 17] *= 3.0  # cosine exactly 1, KLD > 0: only the KLD mean fails
    cand[0, 5] *= 1.2  # a smaller contributor
    check = judge_check("whole", [("a", ref[0], cand[0]), ("b", ref[1], cand[1])], release, True, tier)
    assert check.verdict is Verdict.FAIL
    assert [c["name"] for c in check.calibrated["checks"] if c["ok"] is False] == ["max_kld_mean"]
    assert check.first_failing["prompt"] == "b" and check.first_failing["row"] == 17
    case = Reproducer("mutant:x", "fixture:tiny-qwen35-mtp", "0" * 64)
    _add_reproducers([check], case)
    assert "worst contributor to the KLD mean: row 17 of prompt 'b'" in check.reproducer, check.reproducer


@pytest.mark.parametrize("whole_fails", [True, False])
def test_the_chunked_cause_blames_kv_priming_only_when_whole_passed(whole_fails):
    whole = MtpCheck("whole", Verdict.FAIL if whole_fails else Verdict.PASS, first_failing={"prompt": "a", "row": 0} if whole_fails else None)
    chunked = MtpCheck("chunked", Verdict.FAIL, first_failing={"prompt": "a", "row": 3})
    _add_reproducers([whole, chunked], Reproducer("mutant:x", "fixture:tiny-qwen35-mtp", "0" * 64))
    if whole_fails:
        assert "KV not filled by a chunked prefill" not in chunked.reproducer, chunked.reproducer
        assert "whole fails too" in chunked.reproducer
    else:
        assert "KV not filled by a chunked prefill" in chunked.reproducer


def test_a_command_engine_fail_says_no_mtp_tensor_is_named(tmp_path):
    """``command:example`` made to FAIL (a KLD-mean bound of 1e-30 in every MTP row: its ``hidden``
    check's 7e-14 fails it): localization cannot name an MTP tensor of an engine that returns none,
    and the message and receipt say so (12 s on 2 shared cores)."""
    from pathlib import Path

    from harness.runs.mtp import MtpRequest, run_mtp

    doc = yaml.safe_load((Path(__file__).resolve().parents[1] / "thresholds.yaml").read_text())
    for r in doc["mtp"]:
        r["gates"]["max_kld_mean"]["value"] = 1e-30
    strict = tmp_path / "strict.yaml"
    strict.write_text(yaml.safe_dump(doc))
    run = run_mtp(MtpRequest(model="fixture:tiny-qwen35-mtp", candidate="command:example", thresholds=str(strict), write_evidence=False,
                             max_tokens=40))
    assert run.verdict is Verdict.FAIL
    assert "no MTP tensor named: command:example returns no named MTP tensors" in run.message, run.message
    assert "returns no named MTP tensors" in run.receipt["report_only"]["localization"]["unmeasured"]
