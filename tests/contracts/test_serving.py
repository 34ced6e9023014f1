"""Bound tests of contracts/qwen35-serving-v1.yaml: each request of a serving scenario, served by
the candidate's own scheduler (``Engine.serve``, capability ``serve``), equals the same request run
alone (``generate`` and ``logits``) within the probe tolerances of the candidate's class; the
judgement of ``harness.runs.serving.probe_serving`` (the ``serving`` probe) without the solo runs'
comparison with the reference, which is parity's obligation (QE2E-PAR-001). The scenarios are the
shipped ones (``harness/data/scenarios/serving.yaml``) and, for the continued conversation, a
two-turn one (the shipped multi-turn, to 4,096 positions, takes minutes on the oracle). A scenario
whose intent did not happen in the candidate's step log (e.g. nothing overlapped) is skipped as
unmeasured for it, naming what did not happen, never passed.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from contract_helpers import PROBE_SEED

from harness.errors import Verdict
from harness.measure.prompts import PromptTokens

pytestmark = pytest.mark.contract

TWO_TURNS = """\
schema: harness-serving-scenarios/v1
scenarios:
  - name: two-turns
    why: a conversation continued through the engine's own cache
    requests:
      - {id: t1, prompt: [{prompt: 0, tokens: 70}], n_tokens: 8}
      - {id: t2, continues: t1, prompt: [{prompt: 1, tokens: 30}], n_tokens: 8, arrival: {after: t1, tokens: 8}}
    expect: {cache_hit: [t2]}
"""
SHIPPED = ("shared-header", "block-grid", "join-running", "slot-reuse-finished", "slot-reuse-aborted", "concurrency-3")
RUN = "pytest tests/contracts/test_serving.py --candidate oracle, or harness discharge contracts/qwen35-serving-v1.yaml"


@pytest.fixture(scope="module")
def served(request, candidate_engine, harness_model_path, harness_model_spec, hp, tmp_path_factory):
    """``{scenario: row}`` of the serving judgement of the candidate on the contract's scenarios
    (run once per session); skips where the candidate does not serve or no tolerance fits."""
    from harness.measure.scenarios import load_scenarios
    from harness.runs import probes
    from harness.runs.serving import has_serve, probe_serving

    if not has_serve(candidate_engine):
        pytest.skip(f"{candidate_engine.info.name} does not declare 'serve': the obligation is unmeasured for it; checked with: {RUN}")
    from harness.judge.thresholds import load_thresholds
    from harness.model.gguf_model import GGUFModel
    from harness.runs.parity import subject_of

    th = load_thresholds(Path(request.config.rootpath) / "thresholds.yaml")
    resolved = th.resolve(subject_of(GGUFModel(harness_model_path), candidate_engine.info.to_dict()), harness_model_spec)
    tol = probes.probe_tolerance(resolved, moe=hp.n_expert > 0)
    if tol is None:
        pytest.skip(f"no probe tolerance for {candidate_engine.info.name}'s class ({resolved.row_misfit}); checked with: {RUN}")
    n_vocab = int(candidate_engine.n_vocab)
    rng = np.random.default_rng(PROBE_SEED + 49)
    prompts = [PromptTokens(f"p{i}", rng.integers(0, n_vocab, 90 + 17 * i).tolist(), "ids") for i in range(6)]
    path = tmp_path_factory.mktemp("serving") / "two-turns.yaml"
    path.write_text(TWO_TURNS)
    scenarios = [s for s in load_scenarios() if s.name in SHIPPED] + load_scenarios(path)
    r = probe_serving(candidate_engine, prompts, tol, scenarios, reference=None, context_length=hp.context_length or None)
    return {row["scenario"]: row for row in r.details["scenarios"]}


def _check(served, name: str, obligation: str, where: str) -> None:
    row = served[name]
    if row["verdict"] == Verdict.UNMEASURED.value:
        pytest.skip(f"{obligation}: scenario {name!r} unmeasured: {row['reason']}; checked with: {RUN}")
    assert row["verdict"] == Verdict.PASS.value, f"{obligation}: {row.get('failure', row.get('reason'))} ({where})"


def test_slot_reused_after_a_finished_request(served, where):
    """QSRV-SLOT-001: B served in the slot A finished in equals B alone."""
    _check(served, "slot-reuse-finished", "QSRV-SLOT-001", where)


def test_slot_reused_after_an_aborted_request(served, where):
    """QSRV-ABORT-002: B served in the slot of A, aborted after 4 of 32 tokens, equals B alone."""
    _check(served, "slot-reuse-aborted", "QSRV-ABORT-002", where)


def test_prompts_sharing_a_header(served, where):
    """QSRV-HDR-003: six prompts sharing an 80-token header, served one after another with the
    prefix cache, each equal themselves alone."""
    _check(served, "shared-header", "QSRV-HDR-003", where)


def test_prefixes_around_the_cache_grid(served, where):
    """QSRV-GRID-004: prompts sharing 63 … 257 tokens with an earlier one each equal themselves alone."""
    _check(served, "block-grid", "QSRV-GRID-004", where)


def test_a_request_joining_a_running_batch(served, where):
    """QSRV-JOIN-005: B's prefill in the steps of A's decode: both equal themselves alone."""
    _check(served, "join-running", "QSRV-JOIN-005", where)


def test_an_odd_batch_size(served, where):
    """QSRV-PAD-006: three requests in flight together each equal themselves alone."""
    _check(served, "concurrency-3", "QSRV-PAD-006", where)


def test_a_continued_conversation(served, where):
    """QSRV-TURN-007: the second turn, continued through the engine's cache, equals the whole
    history fed alone."""
    _check(served, "two-turns", "QSRV-TURN-007", where)
