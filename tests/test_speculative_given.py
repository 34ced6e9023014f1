"""The speculative probe's given-draft cases (harness/runs/spec_given.py; docs/engine-protocol.md
"Given drafts"): the plan of planted drafts, the counts the plain path implies, the verify
batches of the shipped cases across cells 256, 512 and 1,024, the near-tie continuation by teacher
forcing, the refusals naming the case, and the three mutants each FAILing naming case, step and
token while the oracle PASSes the same case."""

from __future__ import annotations

import numpy as np
import pytest

from harness.engines.base import SPEC_GIVEN_MAX, Speculation
from harness.engines.mutants import load_mutant
from harness.engines.oracle.qwen35 import Qwen35Oracle
from harness.errors import EngineError
from harness.fixtures.resolve import resolve_model
from harness.measure.continuation import forced_by_restarts
from harness.runs.probe_types import ProbeTolerance
from harness.runs.probes import compare_speculative, long_tokens
from harness.runs.spec_given import (GIVEN_BOUNDARIES, GIVEN_RUNS, GivenCase, given_cases, implied_counts, plant, run_given,
                                     runs_wrong, straddles)

MTP = "fixture:tiny-qwen35-mtp"
F64 = ProbeTolerance(min_cosine=1 - 1e-8, max_kld=1e-9)
RNG = np.random.default_rng(53)
LONG = RNG.integers(0, 515, 160).tolist()
HISTORY = long_tokens([LONG, LONG[::-1]], 1024)


@pytest.fixture(scope="module")
def oracle():
    return Qwen35Oracle(resolve_model(MTP))


def _plain(engine):
    return lambda prompt, n: [int(t) for t in engine.generate(list(prompt), n)]


def _case(name: str) -> GivenCase:
    cases, _ = given_cases(LONG, HISTORY)
    return next(c for c in cases if c.label.startswith(name))


def test_planted_drafts_imply_every_run_and_a_rejection_at_every_depth():
    wrong, n = runs_wrong(GIVEN_RUNS)
    plain = list(range(100, 100 + n))
    given = plant(plain, wrong, 515)
    acc, rej = implied_counts(plain, given, SPEC_GIVEN_MAX, n)
    assert acc == [0, 1, 2, 3, 4, 5, 6, 7, 8] and rej == [8, 7, 6, 5, 4, 3, 2, 1, 0]
    assert n == 46 and wrong == (1, 3, 6, 10, 15, 21, 28, 36)
    assert implied_counts(plain, plain[:5], 8, n)[0][:2] == [4, 0]  # no drafts past the given list


def test_shipped_cases_have_verify_batches_across_each_boundary():
    cases, short = given_cases(LONG, HISTORY)
    assert not short
    seen = {}
    for c in cases:
        plain = list(range(c.n_tokens))
        acc, rej = implied_counts(plain, plant(plain, c.wrong, 10 ** 6), c.draft_max, c.n_tokens)
        batches = Speculation(plain, acc, rej).batches(len(c.prompt))
        for b in GIVEN_BOUNDARIES:
            seen[b] = seen.get(b, False) or straddles(batches, b)
    assert seen == {256: True, 512: True, 1024: True}
    assert max(len(c.prompt) + c.n_tokens for c in cases) >= 1024
    assert given_cases(LONG, HISTORY[:600])[1] == [1024]


def test_oracle_given_drafts_accept_exactly_what_the_plain_path_implies(oracle):
    case = _case("given drafts, runs")
    plain = _plain(oracle)(case.prompt, case.n_tokens)
    s = oracle.speculative(case.prompt, case.n_tokens, draft_max=8, given=plant(plain, case.wrong, oracle.n_vocab))
    assert s.tokens == plain and s.accepted == list(GIVEN_RUNS) and s.rejected == [8 - a for a in GIVEN_RUNS]
    assert s.logits.shape == (case.n_tokens, oracle.n_vocab) and (s.logits.argmax(axis=1) == plain).all()


def test_oracle_passes_the_256_case_with_a_batch_across_it(oracle):
    comps, rows = run_given(oracle, [_case("given drafts across cell 256")], _plain(oracle), 1e-3, F64)
    assert [c.ok for c in comps] == [True, True, True], [c.label for c in comps]
    assert straddles(rows[0]["batches"], 256) and rows[0]["reported_accepted"] == rows[0]["implied_accepted"] == [8, 0, 4]


@pytest.mark.parametrize("given, k, message", [
    ([600], 8, "given draft 600 is not a token id in \\[0, 515\\)"),
    ([1], 9, "given drafts with draft_max 9: at most 8"),
    ([1] * 20, 4, "20 given drafts for 16 tokens"),
])
def test_refused_given_drafts_are_an_engine_error_naming_the_case(oracle, given, k, message):
    with pytest.raises(EngineError, match=message):
        oracle.speculative(LONG[:20], 16, draft_max=k, given=given)

    class Planting:
        """The oracle, sent the bad drafts in place of the case's."""

        n_vocab, info = oracle.n_vocab, oracle.info
        generate, logits = oracle.generate, oracle.logits

        def speculative(self, p, n, *, draft_max, given_drafts=None, **kw):
            return oracle.speculative(p, n, draft_max=k, given=given)

    case = GivenCase("given drafts, refused", LONG[:20], 16, ())
    with pytest.raises(EngineError, match="speculative case 'given drafts, refused': oracle: " + message) as e:
        run_given(Planting(), [case], _plain(oracle), 1e-3, F64)
    assert "\n" not in str(e.value)


def test_a_near_tie_does_not_end_the_comparison():
    """RED before: the comparison ended at the first near-tie and PASSed the hard divergence after it."""
    plain = [1, 2, 3, 4, 5, 6, 7, 8]
    margins = {2: 1e-4}  # index 2 a near-tie; 6 is not
    free = Speculation([1, 2, 9, 9, 9, 9, 9, 9], [1, 1, 1], [0, 0, 0])
    restarts = {3: [4, 5, 6, 0, 8], 7: [8]}  # teacher forced from plain[:3]: a hard divergence at index 6
    comp, row = compare_speculative("case", plain, free, lambda i: margins.get(i, 1.0), 1e-3, lambda i: restarts[i])
    assert not comp.ok and comp.first_bad_position == 6 and "token 6: plain 7, speculative 0" in comp.label
    assert row["near_ties"][0]["index"] == 2 and row["forced"] is True
    ok, row = compare_speculative("case", plain, free, lambda i: margins.get(i, 1.0), 1e-3, lambda i: plain[i:])
    assert ok.ok and row["forced"] is True
    ok, row = compare_speculative("case", plain, free, lambda i: margins.get(i, 1.0), 1e-3)
    assert ok.ok and row["forced"] is False  # without a rerun the row says nothing after it was judged


def test_forced_by_restarts_reads_the_choices_along_the_solo_path():
    solo = [1, 2, 3, 4, 5]
    assert forced_by_restarts(solo, [1, 9, 9, 9, 9], {2: [3, 8, 8], 4: [5]}.__getitem__) == [1, 9, 3, 8, 5]
    assert forced_by_restarts(solo, solo, lambda i: []) == solo
    assert forced_by_restarts(solo, [1, 2], lambda i: [7] * (5 - i)) == [1, 2, -1, 7, 7]


GIVEN_CAUGHT_BY = {"spec-position-gap": "given drafts, runs", "spec-early-commit": "given drafts, runs",
                   "spec-verify-drops-last-row": "given drafts across cell 256"}


@pytest.mark.parametrize("name", list(GIVEN_CAUGHT_BY))
def test_each_given_draft_mutant_fails_naming_case_step_and_token(oracle, name):
    mutant = load_mutant(name, resolve_model(MTP))
    case = _case(GIVEN_CAUGHT_BY[name])
    comps, _ = run_given(mutant, [case], _plain(mutant), 1e-3, F64)
    bad = [c for c in comps if not c.ok]
    assert bad and all(c.label.startswith(case.label) for c in bad), [c.label for c in comps]
    assert "step " in bad[0].label and "token " in bad[0].label, bad[0].label
    good, _ = run_given(oracle, [case], _plain(oracle), 1e-3, F64)
    assert all(c.ok for c in good), [c.label for c in good if not c.ok]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["oracle", "command:example"])
def test_the_whole_speculative_probe_passes_on_the_controls(name):
    """The probe with every case, given drafts included, on the two known-good controls (slow: 34 s
    for the oracle, 37 s for the example on 2 shared cores; run with
    ``pytest -m slow tests/test_speculative_given.py``)."""
    from harness.engines import persistent
    from harness.engines.registry import resolve_engine
    from harness.runs.probes import probe_speculative
    from harness.errors import Verdict

    engine = resolve_engine(name, resolve_model(MTP))
    tol = F64 if name == "oracle" else ProbeTolerance(min_cosine=1 - 1.3e-5, max_kld=1.6e-3)
    try:
        res = probe_speculative(engine, LONG, [LONG[::-1]], None, tol=tol, history=HISTORY)
    finally:
        persistent.close_all()
    assert res.verdict is Verdict.PASS, [c.label for c in res.comparisons if not c.ok]
    given = res.details["given"]
    assert [r["reported_accepted"] for r in given][0] == list(GIVEN_RUNS)
    assert all(straddles(r["batches"], b) for r, b in zip(given[1:], GIVEN_BOUNDARIES))
    assert sum(1 for c in res.comparisons if c.label.endswith("verify logits")) == 4
