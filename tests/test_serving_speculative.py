"""Speculation under traffic (harness/data/scenarios/serving-speculative.yaml): requests served
with MTP speculative decoding through the serving oracle's scheduler (verify batches beside other
requests' steps, at an odd batch size, after a prefix-cache hit), judged by the serving probe
against each request alone with plain greedy; the three mutants it must catch."""

from __future__ import annotations

import numpy as np
import pytest

from harness.engines.mutants import SERVE_SPEC_CAUGHT_BY, SERVE_SPEC_MUTANTS, load_mutant
from harness.engines.oracle import load_oracle
from harness.engines.serving import ServeRequest, ServeResult, ServeScenario, ServedRequest, Step, StepEntry, check_serve_result
from harness.errors import EngineError, InvalidInput, Verdict
from harness.fixtures import synthetic as fx
from harness.measure.prompts import PromptTokens
from harness.measure.scenarios import load_scenarios, speculative_scenarios_path
from harness.runs.probe_types import ProbeTolerance
from harness.runs.serving import probe_serving

F64 = ProbeTolerance(min_cosine=1 - 1e-8, max_kld=1e-9)


def _prompts(n_vocab: int) -> list[PromptTokens]:
    rng = np.random.default_rng(7)
    return [PromptTokens(f"p{i}", [int(t) for t in rng.integers(0, n_vocab, 160 + 17 * i)], "ids") for i in range(6)]


def _scenarios(*names):
    return [s for s in load_scenarios(speculative_scenarios_path()) if not names or s.name in names]


@pytest.fixture(scope="module")
def mtp_path():
    return fx.build("tiny-qwen35-mtp")


@pytest.fixture(scope="module")
def mtp(mtp_path):
    return load_oracle(mtp_path)


def test_the_speculative_scenarios_are_what_the_issue_names():
    sc = {s.name: s for s in _scenarios()}
    assert set(sc) == {"spec-batched-4", "spec-join-odd", "spec-prefix-hit"} and all(s.speculative for s in sc.values())
    assert sc["spec-batched-4"].expect["verify_together"] == ["s1", "s2", "s3", "s4"]
    assert sc["spec-join-odd"].expect["in_flight"] == 3 and sc["spec-prefix-hit"].expect["cache_hit"] == ["p2", "p3"]
    assert not any(s.speculative for s in load_scenarios())  # the plain shipped set decodes plainly


def test_the_serving_oracle_passes_speculating_and_its_log_shows_verify_batches(mtp):
    r = probe_serving(mtp, _prompts(mtp.n_vocab), F64, _scenarios())
    rows = {row["scenario"]: row for row in r.details["scenarios"]}
    assert r.verdict is Verdict.PASS, r.reason
    steps = rows["spec-batched-4"]["log"]["steps"]
    together = [s for s in steps if len([e for e in s["entries"] if len(e) == 6]) == 4]
    assert together and all(e[2] == 1 + e[4] and e[3] == e[5] + 1 for s in together for e in s["entries"])
    odd = [s for s in rows["spec-join-odd"]["log"]["steps"] if len(s["entries"]) == 3
           and {e[0] for e in s["entries"] if len(e) == 6} >= {"a", "b"}]
    assert odd, "a and b verify drafts in steps of 3 requests beside c"
    assert {q["request"]: q["cached"] for q in rows["spec-prefix-hit"]["requests"]} == {"p1": 0, "p2": 123, "p3": 64}
    assert all(q["proposed"] > 0 for row in rows.values() for q in row["requests"])


@pytest.mark.parametrize("name", list(SERVE_SPEC_MUTANTS))
def test_each_speculation_mutant_fails_naming_its_scenario_and_request(mtp_path, name):
    eng = load_mutant(name, mtp_path)
    scenario = SERVE_SPEC_CAUGHT_BY[name]
    r = probe_serving(eng, _prompts(eng.n_vocab), F64, _scenarios(scenario))
    assert r.verdict is Verdict.FAIL and r.reason.startswith(f"scenario {scenario!r}, request "), r.reason
    assert "slot" in r.reason and "in flight beside it" in r.reason


@pytest.mark.parametrize("name", list(SERVE_SPEC_MUTANTS))
def test_each_speculation_mutant_is_the_oracle_alone_and_plainly_served(mtp, mtp_path, name):
    eng = load_mutant(name, mtp_path)
    toks = _prompts(mtp.n_vocab)[0].tokens[:50]
    assert eng.generate(toks, 6) == mtp.generate(toks, 6)
    assert eng.speculative(toks, 8, draft_max=3).tokens == mtp.speculative(toks, 8, draft_max=3).tokens
    plain = [s for s in load_scenarios() if s.name == "concurrency-3"]
    assert probe_serving(eng, _prompts(mtp.n_vocab), F64, plain).verdict is Verdict.PASS


def test_a_model_without_an_mtp_block_shows_no_speculation_so_unmeasured():
    dense = load_oracle(fx.build("tiny-qwen35"))
    r = probe_serving(dense, _prompts(dense.n_vocab), F64, _scenarios("spec-prefix-hit"))
    assert r.verdict is Verdict.UNMEASURED and "asked to speculate (draft_max) but verified no drafts" in r.reason


def _one(entries, draft_max=2):
    sc = ServeScenario("s", [ServeRequest("a", [1, 2, 3], 3, draft_max=draft_max)])
    res = ServeResult({"a": ServedRequest("a", [1, 2, 3], [4, 5, 6], 0, 0)}, [Step(i, [e]) for i, e in enumerate(entries)])
    return sc, res


def test_the_step_log_of_a_verify_batch_must_add_up():
    ok = [StepEntry("a", 0, 3, 1), StepEntry("a", 0, 3, 2, 2, 1)]  # prefill; verify 2 drafts, 1 accepted (1 rejected)
    check_serve_result(*_one(ok), 16, "cand")
    with pytest.raises(EngineError, match="feeds 1 \\+ drafts and emits accepted \\+ 1"):
        check_serve_result(*_one([StepEntry("a", 0, 3, 1), StepEntry("a", 0, 3, 3, 2, 1)]), 16, "cand")
    with pytest.raises(EngineError, match="asked for no speculation"):
        check_serve_result(*_one(ok, draft_max=None), 16, "cand")
    with pytest.raises(EngineError, match="at most 1"):
        check_serve_result(*_one(ok, draft_max=1), 16, "cand")


def test_expect_speculated_names_a_request_with_draft_max(tmp_path):
    p = tmp_path / "s.yaml"
    p.write_text("schema: harness-serving-scenarios/v1\nscenarios:\n  - name: x\n    why: w\n    requests:\n"
                 "      - {id: a, prompt: [{prompt: 0, tokens: 8}], n_tokens: 4}\n    expect: {speculated: [a]}\n")
    with pytest.raises(InvalidInput, match="as speculating, but it has no draft_max"):
        load_scenarios(p)
