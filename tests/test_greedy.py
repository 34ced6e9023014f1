"""Free-running greedy generation (harness.runs.greedy): the pure step comparison, each
built-in engine's own continuation, and what parity records (receipt, report, ledger row)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from harness.runs import greedy
from harness.runs.greedy import compare_generation, free_running
from harness.runs.inputs import RunRequest
from harness.engines.base import EngineInfo, gather
from harness.engines.registry import resolve_engine
from harness.fixtures.resolve import default_model, resolve_model


def test_identical_continuations():
    r = compare_generation("p", [5, 6, 7, 8], [5, 6, 7, 8], 4)
    assert (r.steps, r.identical, r.diverged_at, r.stop) == (4, 4, None, "n_tokens")


def test_first_divergence_with_the_reference_margin_near_tie_or_hard():
    asked = []
    margin = lambda step: asked.append(step) or 0.1  # noqa: E731
    r = compare_generation("p", [5, 6, 7, 8], [5, 6, 9, 8], 4, margin_at=margin, near_tie_margin=0.25)
    assert (r.identical, r.diverged_at, r.reference_token, r.candidate_token, r.margin, r.near_tie) == (2, 2, 7, 9, 0.1, True)
    assert asked == [2]  # the margin is asked for at the divergence only
    hard = compare_generation("p", [5, 6, 7, 8], [5, 6, 9, 8], 4, margin_at=lambda s: 3.0, near_tie_margin=0.25)
    assert hard.near_tie is False


def test_the_comparison_stops_at_n_or_at_the_reference_eos():
    r = compare_generation("p", [5, 2, 7, 8], [5, 2, 1, 1], 4, eos_ids={2})
    assert (r.steps, r.identical, r.stop, r.diverged_at) == (2, 2, "eos", None)  # what follows the reference's EOS is not compared
    r = compare_generation("p", [5, 6, 7, 8, 9], [5, 6, 7, 1, 1], 3, eos_ids={2})
    assert (r.steps, r.stop, r.diverged_at) == (3, "n_tokens", None)


def test_a_candidate_that_stops_early_diverges_where_it_stopped():
    r = compare_generation("p", [5, 6, 7], [5], 3, margin_at=lambda s: 1.0)
    assert (r.diverged_at, r.candidate_token) == (1, None)


class _NoGenerate:
    info = EngineInfo("plain", "test", capabilities=["chunks"])
    n_vocab = 10


def test_an_engine_without_generate_is_unmeasured():
    fr = free_running(_NoGenerate(), _NoGenerate(), [], 8)
    assert fr["unmeasured"].startswith("reference plain cannot generate")


@pytest.fixture(scope="module")
def default():
    path = resolve_model(default_model())
    req = RunRequest(model=default_model())
    inputs = req.resolve()
    ref = resolve_engine("llama.cpp", path)
    return path, ref, inputs.tokens(ref), greedy.eos_token_ids(inputs.model)


def test_oracle_generate_is_the_argmax_of_its_own_decode_path(default):
    path, _, prompts, _ = default
    o = resolve_engine("oracle", path)
    toks = prompts[1].tokens[:40]
    got = o.generate(toks, 12)
    fed = gather(o.logits(toks + got[:-1], chunks=[len(toks)] + [1] * 11))
    assert got == [int(i) for i in np.argmax(fed[len(toks) - 1:], axis=1)]


def test_oracle_vs_llama_cpp_identical_for_64_tokens_or_a_near_tie(default):
    path, ref, prompts, eos = default
    fr = free_running(ref, resolve_engine("oracle", path), prompts, 64, eos)
    for p in fr["prompts"]:
        assert p["diverged_at"] is None or p["near_tie"], p
    assert fr["identical"] == len(prompts)  # measured: every prompt of the default set, all 64 steps


def test_dt_bias_dropped_reports_its_divergence_step_and_margin(default):
    path, ref, prompts, eos = default
    fr = free_running(ref, resolve_engine("mutant:dt-bias-dropped", path), prompts, 64, eos)
    diverged = [p for p in fr["prompts"] if p["diverged_at"] is not None]
    assert fr["diverged"] == len(diverged) >= 1
    for p in diverged:
        assert 0 <= p["diverged_at"] < 64 and p["identical"] == p["diverged_at"]
        assert p["reference_token"] != p["candidate_token"]
        assert math.isfinite(p["margin"]) and p["margin"] >= 0 and p["near_tie"] == (p["margin"] < fr["near_tie_margin"])
    assert fr["first_divergence"] == min(p["diverged_at"] for p in diverged)


def test_last_row_keeps_one_block_and_checks_the_stream():
    """``last_row`` (what a divergence's reference margin reads) equals the gathered array's last
    row and rejects the streams ``gather`` rejects."""
    from harness.engines.base import last_row
    from harness.errors import EngineError

    rng = np.random.default_rng(0)
    full = rng.normal(size=(10, 7)).astype(np.float32)
    blocks = [(0, full[:4]), (4, full[4:9]), (9, full[9:])]
    assert np.array_equal(last_row(iter(blocks), 10), full[-1:]) and np.array_equal(gather(iter(blocks), 10)[-1:], full[-1:])
    with pytest.raises(EngineError, match="expected 11"):
        last_row(iter(blocks), 11)
    with pytest.raises(EngineError, match="starts at 9, expected 4"):
        last_row(iter([blocks[0], blocks[2]]))
    with pytest.raises(EngineError, match="no positions"):
        last_row(iter([]))


def test_an_oracle_too_large_for_a_session_leaves_generation_unmeasured():
    """The oracle keeps every layer's float64 weights only up to ``session_weights_bytes``: above
    it ``generate`` is an EngineError naming the sizes, so free-running greedy is unmeasured
    (report-only) instead of holding the whole model in float64."""
    from harness.errors import EngineError

    oracle = resolve_engine("oracle", resolve_model(default_model()))
    need = oracle.session_bytes()
    assert need > 0
    oracle.session_weights_bytes = need - 1
    with pytest.raises(EngineError, match="over the oracle's"):
        oracle.generate([1, 2, 3], 2)
    oracle.session_weights_bytes = need
    assert len(oracle.generate([1, 2, 3], 2)) == 2
