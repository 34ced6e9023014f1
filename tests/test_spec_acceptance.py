"""The speculative probe's acceptance gate (harness/runs/spec_acceptance.py): first drafts at the
candidate's own steps against the reference head's at the same steps, and the code prompt sets."""

from __future__ import annotations

import json

import numpy as np
import pytest

from harness.engines.base import Drafts, EngineInfo, Speculation
from harness.measure.code_prompts import CODE_CALIBRATION_PROMPTS, CODE_PROMPTS, code_prompt_set
from harness.measure.prompts import load_prompt_set
from harness.runs.probe_types import acceptance_lines
from harness.runs.spec_acceptance import AcceptanceGate, first_draft_steps, gate_case, gate_from, judge, reference_hits

GATE = AcceptanceGate(0.5, 4)


def test_first_draft_steps_name_the_token_each_first_draft_predicts():
    # prefill -> token 0; step 0 accepts 2 (tokens 1, 2, 3), step 1 is draft-less (token 4), step 2 rejects at once (token 5)
    assert first_draft_steps([2, 0, 0], [0, 0, 2]) == [(0, 1, True), (2, 5, False)]


class _Ref:
    """A reference whose draft row t predicts ``targets[t]``."""

    def __init__(self, targets):
        self.targets = targets
        self.info = EngineInfo(name="ref", version="0", settings={}, capabilities=["mtp"])

    def draft(self, tokens, chunks=None, names=None):
        rows = np.zeros((len(tokens) - 1, 16), np.float32)
        rows[np.arange(len(rows)), self.targets[: len(rows)]] = 1.0
        return Drafts(rows, None)


def test_reference_hits_read_row_n_plus_j_minus_2():
    prompt, plain = [1, 2, 3], [4, 5, 6, 7]
    seq = prompt + plain
    targets = [seq[t + 2] if t + 2 < len(seq) else 0 for t in range(len(seq) - 1)]  # a perfect head
    targets[3 + 2 - 2] = 0  # wrong about plain[2] only
    assert reference_hits(_Ref(targets), prompt, plain, [1, 2, 3]) == [True, False, True]


def test_a_collapsed_head_fails_naming_case_step_and_token():
    steps = [(0, 1, False), (1, 3, True), (2, 5, False), (3, 7, False), (4, 9, False)]
    rec, comp = judge("two sequences together, sequence 1", steps, [True, True, True, True, False], GATE, "llama.cpp")
    assert rec["verdict"] == "FAIL" and rec["drop"] == pytest.approx(0.75) and rec["lost_steps"] == [0, 2, 3]
    assert comp is not None and not comp.ok and comp.first_bad_position == 1
    assert "candidate 1/5, reference head llama.cpp 4/5, drop 0.75 > 0.5" in comp.label and "first lost at step 0, token 1" in comp.label


def test_same_hits_pass_and_too_few_reference_hits_are_unmeasured():
    steps = [(i, 2 * i + 1, i < 4) for i in range(6)]
    rec, comp = judge("c", steps, [i < 4 for i in range(6)], GATE, "ref")
    assert (rec["verdict"], rec["drop"], comp) == ("PASS", 0.0, None)
    rec, comp = judge("c", steps, [i < 3 for i in range(6)], GATE, "ref")
    assert rec["verdict"] == "UNMEASURED" and "fewer than 4" in rec["reason"] and comp is None


def test_half_lost_is_not_a_fail_at_the_bound():
    steps = [(i, i + 1, i < 2) for i in range(4)]
    rec, comp = judge("c", steps, [True] * 4, GATE, "ref")
    assert rec["verdict"] == "PASS" and rec["drop"] == 0.5 and comp is None


def test_gate_case_without_rows_or_reference_is_unmeasured():
    spec = Speculation([1, 2, 3], [1], [0])
    got, comp = gate_case("c", [9, 9], [1, 2, 3], spec, None, gate_from({}))
    assert got["acceptance_gate"]["verdict"] == "UNMEASURED" and "probes.spec_max_acceptance_drop" in got["acceptance_gate"]["reason"]
    got, comp = gate_case("c", [9, 9], [1, 2, 3], spec, None, (GATE, ""))
    assert "no reference with an MTP head" in got["acceptance_gate"]["reason"] and comp is None


def test_console_line_shows_first_drafts_beside_the_reference():
    steps = [(i, i + 1, i < 1) for i in range(5)]
    rec, _ = judge("c", steps, [True] * 5, GATE, "llama.cpp")
    lines = acceptance_lines({"cases": [{"case": "two sequences together, sequence 1", "accepted": 1, "proposed": 9, "acceptance": 1 / 9,
                                         "counts": "x", "acceptance_gate": rec}]})
    assert "  two sequences together, sequence 1: 1/9 = 0.111; first drafts 1/5, reference head llama.cpp 5/5: FAIL (drop 0.80, at most 0.5)" in lines


def test_shipped_thresholds_carry_the_gate_with_its_basis():
    from harness.judge.thresholds import load_thresholds
    from harness.runs.inputs import resolve_thresholds_path

    probes = load_thresholds(resolve_thresholds_path(None)).data["probes"]
    row = probes["spec_max_acceptance_drop"]
    assert row["basis"]["kind"] == "measured" and 0 < row["value"] < 1
    assert row["basis"]["known_good_floor"] < row["value"] < min(b["value"] for b in row["basis"]["known_bad"])
    assert any("spec-drafts-crossed" in b["what"] for b in row["basis"]["known_bad"])
    assert probes["spec_min_reference_accepted"]["value"] >= 1 and "smallest drop" in probes["spec_min_reference_accepted"]["basis"]["why"]


@pytest.mark.parametrize("path,folder", [(CODE_PROMPTS, "harness/"), (CODE_CALIBRATION_PROMPTS, "tests/")])
def test_code_prompt_sets_are_repository_source(path, folder):
    from harness.measure.code_prompts import REPO

    prompts = load_prompt_set(path).prompts
    assert len(prompts) == 6
    for p in prompts:
        src = p.meta["source"]
        assert src.startswith(folder) and p.text.startswith("def ")
        assert (REPO / src.split(":")[0]).is_file()
    # the selection is deterministic: the same function gives the same ids
    ids = [q["id"] for q in code_prompt_set(folder.rstrip("/"))]
    assert len(ids) == 6 and len(set(ids)) == 6
    assert {p.id for p in prompts}.isdisjoint({p.id for p in load_prompt_set(CODE_CALIBRATION_PROMPTS if path == CODE_PROMPTS else CODE_PROMPTS).prompts})
    assert json.loads(path.read_text().splitlines()[0])["id"] == prompts[0].id


def test_an_acceptance_fail_blames_the_head_not_the_rollback():
    """A FAIL by the acceptance gate is a head drafting badly, output lossless: its reproducer's
    likely cause is QMTP-ACCEPT-011's (the head's state, weights, norms), never the token-for-token
    check's rolled-back state (QMTP-SPEC-005's), which the case passed."""
    from harness.errors import Verdict
    from harness.judge.reproducer import Reproducer
    from harness.runs.probe_types import Comparison, ProbeResult
    from harness.runs.probes import probe_failure

    steps = [(0, 1, False), (1, 3, False), (2, 5, False), (3, 7, False), (4, 9, False)]
    _, comp = judge("two sequences together, sequence 1, draft_max 2", steps, [True] * 5, GATE, "llama.cpp")
    case = {"prompt": "code-python", "n_tokens": 48, "chunks": None, "generated": 16}
    comp.case = case
    passed = Comparison("two sequences together, sequence 1, draft_max 2", 16, True, None, None, None, None, case=case)
    line = probe_failure(ProbeResult("speculative", Verdict.FAIL, [passed, comp], bounds="b"),
                         Reproducer("mutant:spec-drafts-crossed", "fixture:trained-qwen35-mtp", "0" * 64), "llama.cpp")
    cause = line.split("likely cause: ", 1)[1]
    assert "rolled back" not in cause and "spec-drafts-crossed" in cause and "hidden state" in cause, cause
    assert "prompt 'code-python', n_tokens 48, chunks whole, 16 generated" in line, line


def test_the_summary_does_not_call_gated_acceptance_report_only():
    """The speculative probe's summary line points to the per-case acceptance; since the first
    drafts are gated against the reference head, it no longer calls all of it report-only."""
    from harness.errors import Verdict
    from harness.runs.probe_types import ProbeResult

    steps = [(i, 2 * i + 1, False) for i in range(5)]
    _, comp = judge("two sequences together, sequence 1, draft_max 2", steps, [True] * 5, GATE, "llama.cpp")
    details = {"cases": [{"case": "two sequences together, sequence 1, draft_max 2", "accepted": 0, "proposed": 10}]}
    s = ProbeResult("speculative", Verdict.FAIL, [comp], details=details).summary()
    assert s.startswith("two sequences together, sequence 1, draft_max 2 acceptance") and "(report-only)" not in s, s
    assert "first drafts gated against the reference head" in s, s
