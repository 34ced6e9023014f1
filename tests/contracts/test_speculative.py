"""Bound tests of contracts/qwen35-mtp-v1.yaml's speculative obligations (QMTP-SPEC-005 …
QMTP-PREFIX-008, QMTP-SERVE-010): the candidate's speculative greedy generation with MTP drafts
(``Engine.speculative``) equals its own plain greedy generation (``Engine.generate``) token for
token, a divergence excused only at a near-tie of the plain path's margin below
``harness.runs.probes.SPEC_NEAR_TIE`` (the comparison of ``harness.runs.probes.compare_speculative``,
the ``speculative`` probe's). Subjects: ``candidate_engine`` on ``harness_model_path`` (a file with
a nextn block). A failure names the case, the sequence, the verification step and the first
differing token.
"""

from __future__ import annotations

import numpy as np
import pytest
from contract_helpers import MTP_RUN, PROBE_SEED

from harness.errors import Verdict
from harness.runs.probes import SPEC_NEAR_TIE, SPEC_TOKENS, _spec_checked, compare_speculative, has_speculative
from harness.engines.base import last_row
from harness.measure import metrics

pytestmark = pytest.mark.contract


@pytest.fixture(scope="module")
def prompts(harness_model_path) -> tuple[list[int], list[int]]:
    from harness.model.gguf_model import GGUFModel

    n_vocab = int(GGUFModel(harness_model_path).tensor_info("token_embd.weight").ne[1])
    rng = np.random.default_rng(PROBE_SEED + 28)
    return rng.integers(0, n_vocab, 160).tolist(), rng.integers(0, n_vocab, 60).tolist()


@pytest.fixture(scope="module")
def spec(candidate_engine):
    if not has_speculative(candidate_engine):
        pytest.skip(f"{candidate_engine.info.name} does not declare 'speculative' and 'generate' (the model needs a nextn block): "
                    f"the obligation is unmeasured for it; checked with: {MTP_RUN}")
    return candidate_engine


def _check(engine, label: str, prompt: list[int], out, k: int, where: str) -> None:
    plain = [int(t) for t in engine.generate(list(prompt), SPEC_TOKENS)]

    def margin(i: int) -> float:
        seq = list(prompt) + plain[:i]
        return float(metrics.reference_margin(last_row(engine.logits(seq), len(seq)))[0])

    out = _spec_checked(out, SPEC_TOKENS, k, int(engine.n_vocab), engine.info.name)
    comp, row = compare_speculative(label, plain, out, margin, SPEC_NEAR_TIE["value"])
    assert comp.ok, f"speculative != plain greedy: {comp.label} ({where})"
    assert len(out.tokens) == len(plain) or row.get("near_tie"), f"{label}: {len(out.tokens)} tokens generated, plain gave {len(plain)} ({where})"


def test_speculative_equals_plain_greedy_chunked(spec, prompts, where):
    """QMTP-SPEC-005: the 160-token prompt fed as [64, 1, 95], draft_max 1 … 4."""
    long = prompts[0]
    for k in (1, 2, 3, 4):
        out = spec.speculative(long, SPEC_TOKENS, draft_max=k, chunks=[64, 1, len(long) - 65])
        _check(spec, f"chunked prompt, sequence 0, draft_max {k}", long, out, k, where)


def test_sequences_generated_together_equal_plain(spec, prompts, where):
    """QMTP-ROLL-006: two sequences generated together, draft_max 2."""
    if not callable(getattr(spec, "speculative_multi", None)):
        pytest.skip(f"the candidate has no speculative_multi; checked with: {MTP_RUN}")
    pair = [prompts[0][:48], prompts[1][:48]]
    outs = spec.speculative_multi(pair, SPEC_TOKENS, draft_max=2)
    assert len(outs) == 2, f"{len(outs)} continuations for 2 sequences ({where})"
    for i, q in enumerate(pair):
        _check(spec, f"two sequences together, sequence {i}, draft_max 2", q, outs[i], 2, where)


def test_three_token_prompt(spec, prompts, where):
    """QMTP-PROMPT-007: a 3-token prompt (1 + k tokens) with draft_max 2."""
    three = prompts[0][:3]
    _check(spec, "3-token prompt, sequence 0, draft_max 2", three, spec.speculative(three, SPEC_TOKENS, draft_max=2), 2, where)


def test_reused_prefix_equals_fresh(spec, prompts, where):
    """QMTP-PREFIX-008: generation continued from a session equals the whole history fed fresh."""
    a = prompts[0][:40]
    first = spec.speculative(a, 8, draft_max=3, session={"id": "bound-a"})
    hist = a + [int(t) for t in first.tokens[:-1]]
    tail = [int(first.tokens[-1])] + prompts[1][:8]
    out = spec.speculative(tail, SPEC_TOKENS, draft_max=3, session={"id": "bound-b", "parent": "bound-a", "after": len(hist)})
    _check(spec, f"reused prefix ({len(hist)} tokens), sequence 0, draft_max 3", hist + tail, out, 3, where)
    if callable(getattr(spec, "drop_sessions", None)):
        spec.drop_sessions()


@pytest.fixture(scope="module")
def spec_tolerance(request, spec, harness_model_path, harness_model_spec):
    """The probe tolerances of the calibrated row for the candidate's class (``probes.probe_tolerance``,
    as the e2e contract's ``probe_tolerance``); skipped, naming why, where no row fits."""
    from pathlib import Path

    from harness.judge.thresholds import load_thresholds
    from harness.model.gguf_model import GGUFModel
    from harness.runs.parity import subject_of
    from harness.runs.probes import probe_tolerance

    th = load_thresholds(Path(request.config.rootpath) / "thresholds.yaml")
    model = GGUFModel(harness_model_path)
    resolved = th.resolve(subject_of(model, spec.info.to_dict()), harness_model_spec)
    tol = probe_tolerance(resolved, moe=model.hparams.n_expert > 0)
    if tol is None:
        pytest.skip(f"no probes row for {spec.info.name}'s class ({resolved.row_misfit}); checked with: {MTP_RUN}")
    return tol


def test_given_drafts_accept_what_the_plain_path_implies(spec, prompts, spec_tolerance, where):
    """QMTP-GIVEN-009: given drafts (``harness.runs.spec_given``): runs of 0 … 8 accepted with a
    rejection at every depth on the 160-token prompt, and verification batches across cells 256,
    512 and 1,024 of the prompts cycled; tokens, counts and verify rows as the plain path implies."""
    from harness.runs.probes import long_tokens
    from harness.runs.spec_given import given_cases, run_given

    cases, short = given_cases(prompts[0], long_tokens([prompts[0], prompts[1]], 1024))
    assert not short
    from harness.errors import EngineError

    try:
        comps, _ = run_given(spec, cases, lambda p, n: [int(t) for t in spec.generate(list(p), n)], SPEC_NEAR_TIE["value"], spec_tolerance)
    except EngineError as e:  # an engine that computes non-finite values on a long history fails the obligation
        raise AssertionError(f"QMTP-GIVEN-009: the candidate failed on the given drafts: {e} ({where})") from None
    bad = [c.label for c in comps if not c.ok]
    assert not bad, f"QMTP-GIVEN-009: {bad[0]} ({where}); {len(bad)} of {len(comps)} comparisons failed"


def test_speculation_under_traffic(spec, spec_tolerance, where):
    """QMTP-SERVE-010: every scenario of harness/data/scenarios/serving-speculative.yaml served by
    the candidate's scheduler with speculative decoding, each request against itself alone with
    plain greedy (the serving probe's judgement, no reference), under the calibrated probes row of
    the candidate's class."""
    from harness.measure.prompts import PromptTokens
    from harness.measure.scenarios import load_scenarios, speculative_scenarios_path
    from harness.runs.serving import has_serve, probe_serving

    if not has_serve(spec):
        pytest.skip(f"{spec.info.name} does not declare 'serve': the obligation is unmeasured for it; checked with: {MTP_RUN}")
    # Seed 7: prompts on which the tiny MTP head's drafts are accepted at different counts by the
    # requests verifying together (with the earlier seed every request accepted the same count at
    # every step, so a scheduler committing one row's count for all was invisible).
    rng = np.random.default_rng(7)
    prompts = [PromptTokens(f"p{i}", rng.integers(0, int(spec.n_vocab), 160 + 17 * i).tolist(), "ids") for i in range(6)]
    r = probe_serving(spec, prompts, spec_tolerance, load_scenarios(speculative_scenarios_path()))
    rows = {row["scenario"]: row for row in r.details["scenarios"]}
    unmeasured = [f"{n}: {row['reason']}" for n, row in rows.items() if row["verdict"] == "UNMEASURED"]
    if unmeasured and r.verdict is not Verdict.FAIL:
        pytest.skip(f"QMTP-SERVE-010 unmeasured: {'; '.join(unmeasured)}; checked with: {MTP_RUN}")
    assert r.verdict is Verdict.PASS, f"QMTP-SERVE-010: {r.reason} ({where})"


def test_head_acceptance_against_the_reference_head(request, spec, reference_engine, where):
    """QMTP-ACCEPT-011: on the two longest shipped code prompts (``harness.measure.code_prompts``,
    tokenized by the reference), fed as the speculative probe feeds them (the first 160 tokens in
    chunks [64, 1, rest] with draft_max 1, and both prompts' first 48 generated together with
    draft_max 2), each case's first drafts at the candidate's own steps keep the reference head's
    (``harness.runs.spec_acceptance``: drop at most thresholds.yaml
    ``probes.spec_max_acceptance_drop``, judged where the reference hits at least
    ``probes.spec_min_reference_accepted``). Where no case can be judged: RED when the candidate's
    own steps are not the reference's (a lossy speculative output, or a greedy continuation that
    leaves the reference's: its head's acceptance cannot be set beside the reference head's), else
    skipped (the reference head hits too few)."""
    from pathlib import Path

    from harness.judge.thresholds import load_thresholds
    from harness.measure.code_prompts import CODE_PROMPTS
    from harness.measure.prompts import load_prompt_set, tokenize_prompts
    from harness.runs.spec_acceptance import gate_case, gate_from

    gate = gate_from({n: type("G", (), {"value": g["value"]})() for n, g in
                      load_thresholds(Path(request.config.rootpath) / "thresholds.yaml").data.get("probes", {}).items()})
    if gate[0] is None:
        pytest.skip(gate[1])
    code = sorted(tokenize_prompts(load_prompt_set(CODE_PROMPTS), reference_engine), key=lambda p: len(p.tokens), reverse=True)[:2]
    first, second = code[0].tokens[:160], code[1].tokens
    cases = [("chunked prompt, draft_max 1, code prompts", first, spec.speculative(first, SPEC_TOKENS, draft_max=1, chunks=[64, 1, len(first) - 65]), 1)]
    if callable(getattr(spec, "speculative_multi", None)):
        pair = [first[:48], second[:48]]
        outs = spec.speculative_multi(pair, SPEC_TOKENS, draft_max=2)
        cases += [(f"two sequences together, sequence {i}, draft_max 2, code prompts", q, outs[i], 2) for i, q in enumerate(pair)]
    judged, diverged = 0, []
    for label, prompt, out, k in cases:
        out = _spec_checked(out, SPEC_TOKENS, k, int(spec.n_vocab), spec.info.name)
        plain = [int(t) for t in spec.generate(list(prompt), SPEC_TOKENS)]
        if [int(t) for t in out.tokens] != plain:  # a lossy case is QMTP-SPEC-005's and QMTP-ROLL-006's to judge
            diverged.append(f"{label}: its speculative output leaves its own greedy continuation (lossy)")
            continue
        rec, comp = gate_case(label, prompt, plain, out, reference_engine, gate)
        assert comp is None, f"QMTP-ACCEPT-011: {comp.label} ({where})"
        if rec["acceptance_gate"].get("verdict") in ("PASS", "FAIL"):
            judged += 1
            continue
        ref_plain = [int(t) for t in reference_engine.generate(list(prompt), SPEC_TOKENS)]
        if ref_plain != plain:  # the candidate's steps are not the reference's: its trunk decides other tokens
            step = next(i for i, (a, b) in enumerate(zip(plain + [-1], ref_plain + [-2])) if a != b)
            diverged.append(f"{label}: greedy token {step} is {plain[step] if step < len(plain) else 'none'}, the reference's "
                            f"{ref_plain[step] if step < len(ref_plain) else 'none'}")
    # Nothing judged because the candidate's own steps are not the reference's (a lossy output, or a trunk that
    # continues otherwise): its head cannot be shown to keep the reference head's acceptance.
    assert judged or not diverged, (f"QMTP-ACCEPT-011: no case could be judged, the candidate's steps are not the "
                                    f"reference's: {'; '.join(diverged)} ({where})")
    if not judged:
        pytest.skip(f"the reference head hits too few first drafts on the code prompts to judge any case; checked with: {MTP_RUN}")
