"""The MTP draft head: the oracle's head against llama.cpp's own MTP context, and the MTP cell
(``harness parity --mtp``, ``harness.runs.mtp``) on correct and planted heads.

The pinned comparison is what makes the oracle a reference for the head: on each MTP fixture
(dense, MoE, and the variant with its own embed_tokens / shared_head_head) the float64 head and
llama.cpp's MTP context agree to float32 rounding in both row conventions, whole and chunked.
The mutants must each FAIL at the check ``MTP_CAUGHT_BY`` names, and at no check before the
trunk: their trunk logits are the oracle's.
"""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from harness.engines.base import gather
from harness.engines.llamacpp import LlamaCppEngine
from harness.engines.mutants import MTP_CAUGHT_BY, MTP_MUTANTS, MUTANTS, load_mutant
from harness.engines.oracle import load_oracle
from harness.engines.oracle.qwen35 import _Recorder
from harness.errors import EngineError, Verdict
from harness.fixtures.resolve import resolve_model
from harness.measure import metrics
from harness.runs.mtp import MtpRequest, run_mtp

MTP_FIXTURES = ("fixture:tiny-qwen35-mtp", "fixture:tiny-qwen35moe-mtp", "fixture:tiny-qwen35-mtp-own-head")
TOKENS = list(range(5, 53))  # 48 ids inside every fixture's vocabulary
PIECES = [17, 1, 30]


def min_cosine(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.min(metrics.cosine(a, b)))


def head_on(oracle, hidden: np.ndarray, tokens, chunks, conv: str) -> np.ndarray:
    """The oracle's head alone, fed ``hidden`` (another engine's h_t) instead of its own trunk's."""
    g, first = oracle.mtp_forward(np.asarray(hidden, np.float64), np.asarray(tokens, np.int64), chunks or [len(tokens)], conv,
                                  _Recorder(None))
    return oracle.mtp_logits(g[first:], oracle.mtp_layer())


@pytest.mark.parametrize("spec", MTP_FIXTURES)
def test_oracle_head_equals_llamacpp_mtp_context(spec):
    """Pinned: the oracle's head fed llama.cpp's h_t equals llama.cpp's MTP context in both
    conventions, whole and chunked, and for two sequences side by side (measured 1 − cosine ≤ 7e-8).
    End to end (the oracle's own trunk too) the dense fixtures agree as closely; the random MoE
    fixture's trunk parts from llama.cpp's at a router near-tie (trunk cosine 0.985 at row 9),
    and its drafts stay above the release floor."""
    path = resolve_model(spec)
    oracle, ref = load_oracle(path, []), LlamaCppEngine(path)
    assert "mtp" in oracle.info.capabilities and "mtp" in ref.info.capabilities
    moe = oracle.hp.n_expert > 0
    for conv in ("llama.cpp", "vllm"):
        oracle.mtp_convention = conv
        whole, pieces = ref.draft_many([(TOKENS, None), (TOKENS, PIECES)], conv)
        assert whole.logits.shape == (len(TOKENS) - 1, ref.n_vocab)
        assert 1 - min_cosine(head_on(oracle, whole.hidden, TOKENS, None, conv), whole.logits) < 1e-6, (spec, conv)
        assert 1 - min_cosine(head_on(oracle, pieces.hidden, TOKENS, PIECES, conv), pieces.logits) < 1e-6, (spec, conv)
        own = oracle.draft(TOKENS)
        assert own.logits.shape == whole.logits.shape
        assert min_cosine(own.logits, whole.logits) >= (0.98 if moe else 1 - 1e-6), (spec, conv)
        if not moe:
            assert 1 - min_cosine(oracle.draft(TOKENS, PIECES).logits, pieces.logits) < 1e-6, (spec, conv)
    a, b = ref.draft_multi([TOKENS[:30], TOKENS[8:]], "llama.cpp")
    assert 1 - min_cosine(head_on(oracle, a.hidden, TOKENS[:30], None, "llama.cpp"), a.logits) < 1e-6
    assert 1 - min_cosine(head_on(oracle, b.hidden, TOKENS[8:], None, "llama.cpp"), b.logits) < 1e-6


def test_the_conventions_differ_by_the_sentinel_key():
    """The two conventions are not a relabelling: the sentinel row is one more key, so the
    draft logits differ (an exact comparison has to drive the reference in the candidate's)."""
    oracle = load_oracle(resolve_model("fixture:tiny-qwen35-mtp"), [])
    oracle.mtp_convention = "llama.cpp"
    a = oracle.draft(TOKENS).logits
    oracle.mtp_convention = "vllm"
    b = oracle.draft(TOKENS).logits
    assert np.abs(a - b).max() > 0.1


def test_the_head_is_fed_the_post_norm_state():
    """``output · h_t`` is the trunk's logit row t (to float32 rounding of h)."""
    oracle = load_oracle(resolve_model("fixture:tiny-qwen35-mtp"), [])
    d = oracle.draft(TOKENS)
    trunk = gather(oracle.logits(TOKENS), len(TOKENS))
    w = oracle.read_tensor("output.weight") if oracle.model.has_tensor("output.weight") else oracle.read_tensor("token_embd.weight")
    assert 1 - min_cosine(trunk, d.hidden.astype(np.float64) @ w.T) < 1e-9


def test_no_mtp_block_is_a_clear_engine_error():
    oracle = load_oracle(resolve_model("fixture:tiny-qwen35"), [])
    assert "mtp" not in oracle.info.capabilities
    with pytest.raises(EngineError, match="no MTP"):
        oracle.draft(TOKENS)


def test_mtp_mutants_are_not_trunk_mutants():
    """Trunk calibration must catch every entry of MUTANTS; the MTP mutants leave the trunk as it
    is, so they live in a table of their own, each with the check that catches it."""
    assert not set(MTP_MUTANTS) & set(MUTANTS)
    assert set(MTP_CAUGHT_BY) == set(MTP_MUTANTS)
    path = resolve_model("fixture:tiny-qwen35-mtp")
    oracle = gather(load_oracle(path, []).logits(TOKENS), len(TOKENS))
    for name in MTP_MUTANTS:
        assert np.array_equal(gather(load_mutant(name, path).logits(TOKENS), len(TOKENS)), oracle), name


@pytest.fixture(scope="module")
def prompts(tmp_path_factory):
    """Two prompts given as ids (so no tokenizer run is needed)."""
    p = tmp_path_factory.mktemp("mtp") / "prompts.jsonl"
    p.write_text("\n".join(json.dumps({"id": f"p{i}", "tokens": t}) for i, t in enumerate([TOKENS, list(range(60, 100))])) + "\n")
    return str(p)


def cell(candidate: str, prompts: str, reference: str = "llama.cpp", **kw):
    return run_mtp(MtpRequest(model="fixture:tiny-qwen35-mtp", candidate=candidate, reference=reference, prompts=prompts,
                              write_evidence=False, max_tokens=48, **kw))


def test_the_oracle_passes_the_mtp_cell_against_llamacpp(prompts):
    run = cell("oracle", prompts)
    checks = {c.name: c for c in run.checks}
    assert run.verdict is Verdict.PASS, run.message
    assert all(c.verdict is Verdict.PASS for c in checks.values()), run.message
    assert checks["whole"].positions == (len(TOKENS) - 1) + 39 and checks["whole"].min_cosine > 1 - 1e-6
    acc = run.receipt["report_only"]["acceptance"]
    assert acc["candidate"]["rows"] == acc["reference"]["rows"] == (len(TOKENS) - 2) + 38


@pytest.mark.parametrize("name", sorted(MTP_MUTANTS))
def test_every_mtp_mutant_fails_at_the_check_it_names(name, prompts):
    """Against the oracle as reference (it equals llama.cpp's MTP context: the pinned test above);
    the named check FAILs with a reproducer, and the cell names the first divergent MTP tensor
    for the mutants whose fault is inside the head's graph."""
    run = cell(f"mutant:{name}", prompts, reference="oracle")
    checks = {c.name: c for c in run.checks}
    assert run.verdict is Verdict.FAIL
    named = checks[MTP_CAUGHT_BY[name]]
    assert named.verdict is Verdict.FAIL, run.message
    assert named.first_failing is not None and named.reproducer and "harness parity" in named.reproducer
    where = run.receipt["report_only"].get("localization") or {}
    expected_first = {"mtp-prenorm-hidden": "mtp_hnorm-8", "mtp-concat-swapped": "mtp_concat-8", "mtp-head-norm-skipped": "h_nextn"}
    if name in expected_first:
        assert where.get("tensor") == expected_first[name], where


def test_a_mutant_fails_against_llamacpp_too(prompts):
    run = cell("mutant:mtp-concat-swapped", prompts)
    assert run.verdict is Verdict.FAIL and {c.name: c.verdict for c in run.checks}["whole"] is Verdict.FAIL


def test_cli_mtp_on_a_model_without_a_head_is_unmeasured(tmp_path):
    """No head to judge: every check UNMEASURED with its reason, exit 5, never PASS."""
    r = subprocess.run([sys.executable, "-m", "harness", "parity", "--mtp", "--candidate", "oracle", "--model", "fixture:tiny-qwen35",
                        "--ledger", str(tmp_path / "ledger.jsonl"), "--mtp-max-tokens", "16", "--json"],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 5, r.stderr
    receipt = json.loads(r.stdout)
    assert receipt["kind"] == "mtp" and receipt["verdict"] == "UNMEASURED"
    assert all(c["verdict"] == "UNMEASURED" and "mtp" in c["reason"] for c in receipt["checks"])
    rows = [json.loads(x) for x in (tmp_path / "ledger.jsonl").read_text().splitlines()]
    assert rows[-1]["kind"] == "mtp" and rows[-1]["verdict"] == "UNMEASURED"
