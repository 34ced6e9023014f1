"""The exact check on low-bit i-quant files (issue 59, harness.runs.exact_check): a candidate that
dequantizes is judged against the float64 oracle too, where llama.cpp's activation rounding is as
large as a subtle trunk fault."""

from __future__ import annotations

import json

import pytest

from harness.errors import Verdict
from harness.fixtures import lowbit
from harness.fixtures import synthetic as fx
from harness.model.gguf_model import GGUFModel
from harness.paths import llama_tool
from harness.runs import exact_check
from harness.runs.parity import ParityRequest, run_parity

pytestmark = [pytest.mark.parity,
              pytest.mark.skipif(llama_tool("llama-quantize") is None, reason=f"llama.cpp's tools are not built: {lowbit.BUILD_HINT}")]

IQ2_M = "fixture:trained-qwen35-256-IQ2_M"


def _run(tmp_path, candidate):
    req = ParityRequest(model=IQ2_M, candidate=candidate, reference="llama.cpp", ledger=str(tmp_path / "ev" / "ledger.jsonl"),
                        write_evidence=True, greedy_tokens=0, localize=False)
    out = run_parity(req)
    receipt = json.loads(out.receipt_path.read_text())
    return out, receipt


def test_it_applies_to_dequantizing_candidates_on_low_bit_i_quant_files_only():
    iq2 = GGUFModel(fx.build("trained-qwen35-256-IQ2_M"))
    f32 = GGUFModel(fx.build("trained-qwen35"))
    deq = {"name": "mlx", "capabilities": ["chunks", exact_check.CAPABILITY]}
    assert exact_check.low_bit_types(iq2) == ["IQ2_S", "IQ3_S"]
    assert exact_check.applies(iq2, deq)
    assert not exact_check.applies(f32, deq)  # no low-bit i-quant type: llama.cpp is near the exact forward
    assert not exact_check.applies(iq2, {"name": "llama.cpp", "capabilities": ["chunks"]})
    assert not exact_check.applies(iq2, {"name": "oracle", "capabilities": [exact_check.CAPABILITY]})  # itself
    line = exact_check.not_run_line(iq2, {"name": "llama.cpp", "capabilities": ["chunks"]})
    assert line and "not run" in line and "dequantized_weights" in line and "IQ2_S/IQ3_S" in line
    assert exact_check.not_run_line(f32, {"name": "llama.cpp", "capabilities": []}) is None


def test_a_trunk_fault_inside_the_references_noise_fails_against_the_oracle(tmp_path):
    """``gdn-chunk-state-not-carried`` on IQ2_M is within llama.cpp's own quantization noise (KLD mean
    6.2e-4 against llama.cpp, where the exact oracle measures 5.9e-4), so the IQ2_M row passes it;
    against the oracle on the same dequantized weights it is 20× over the F32 f64 row's KLD gate."""
    out, receipt = _run(tmp_path, "mutant:gdn-chunk-state-not-carried")
    assert out.result.verdict is Verdict.FAIL
    ex = receipt["gated"]["exact_check"]
    assert ex["status"] == "fail" and ex["row"]["source"].endswith("calibrated[0]")
    assert ex["summary"]["kld_mean"] > 1e-5 and ex["summary"]["positions"] == receipt["gated"]["positions"]
    assert receipt["gated"]["release"]["status"] == "ok"  # against llama.cpp alone it would pass
    assert receipt["gated"]["calibrated"]["status"] == "ok"
    assert receipt["gated"]["message"].startswith("exact check (candidate against the float64 oracle")


def test_a_correct_dequantizing_candidate_passes_the_exact_check(tmp_path):
    """oracle-f16 (the oracle's float16 emulation: dequantized weights, float16 matmul inputs) is
    judged by the F32 weights' f16 row against the oracle, and passes it."""
    out, receipt = _run(tmp_path, "oracle-f16")
    ex = receipt["gated"]["exact_check"]
    assert out.result.verdict is Verdict.PASS, receipt["gated"]["message"]
    assert ex["status"] == "pass" and "class f16" in ex["line"]


def test_llama_cpp_as_the_candidate_is_judged_against_llama_cpp_alone_and_told_why(tmp_path):
    out, receipt = _run(tmp_path, "llama.cpp")
    assert receipt["gated"]["exact_check"]["status"] == "not-run"
    assert "exact check: not run" in receipt["gated"]["message"]
    assert receipt["gated"]["exact_check"]["line"] in receipt["gated"]["message"]
    assert out.result.verdict is Verdict.PASS
