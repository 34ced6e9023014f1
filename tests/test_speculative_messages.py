"""What the speculative probe says when it fails (issue 54): the reproducer's context names the
failing case's own prompt, tokens fed, chunks and tokens generated; a first differing token made by
the prefill says so (never ``step None``); report.md fills its prompts cell, says what the
speculative probe found (not "feeding the same tokens another way") and lists only the tolerances
its probes use; an ENGINE-ERROR partway through still writes a receipt keeping the cases already
judged; each case's acceptance is shown with what it counts. Each test failed before its fix.

One probe run (``mutant:spec-position-gap``, ``--only speculative``, about 20 s on 2 shared cores)
serves the report tests."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from harness.engines.base import Speculation
from harness.errors import EngineError, Verdict
from harness.runs.probes import ProbeRequest, run_probes
from harness.runs.spec_given import judge_case, verify_rows
from harness.runs.probe_types import ProbeTolerance

MTP = "fixture:tiny-qwen35-mtp"


@pytest.fixture(scope="module")
def gap(tmp_path_factory):
    """``mutant:spec-position-gap`` (a position gap after a rejection: FAILs the chunked case)
    through ``run_probes`` with evidence and report.md in a temporary ledger."""
    ledger = tmp_path_factory.mktemp("l") / "ledger.jsonl"
    run = run_probes(ProbeRequest(model=MTP, candidate="mutant:spec-position-gap", only=["speculative"], ledger=str(ledger), report=True))
    return run


def test_the_failure_context_names_the_failing_case(gap):
    spec = gap.results[0]
    assert spec.verdict is Verdict.FAIL
    first = spec.first_failure
    assert first.label.startswith("chunked prompt [64, 1, 95]"), first.label
    assert "n_tokens 160, chunks [64, 1, 95], 16 generated" in spec.reproducer, spec.reproducer
    # every case records what it fed: the 3-token prompt case fed 3 tokens whole
    three = next(c for c in spec.comparisons if c.label.startswith("3-token prompt"))
    assert three.case["n_tokens"] == 3 and three.case["chunks"] is None and three.case["generated"] == 16


def test_a_prefill_token_is_named_as_the_prefill_not_step_none():
    plain = [5, 6, 7, 8]
    spec = Speculation([9, 6, 7, 8], [1, 1], [0, 0], np.zeros((4, 10), np.float32))
    c, row = judge_case("case", plain, spec, lambda i: 5.0, 1e-3, None)
    assert not c.ok and "step None" not in c.label and "the prefill, token 0" in c.label, c.label
    assert row["step"] == "prefill"
    base = np.eye(4, 10, dtype=np.float32) * 5
    other = base.copy()
    other[0] = np.roll(other[0], 3)
    v = verify_rows("case", base, Speculation([0, 1, 2, 3], [1, 1], [0, 0], other), 4, ProbeTolerance(0.999, 1e-3))
    assert not v.ok and "step None" not in v.label and "the prefill, token 0" in v.label, v.label


def test_the_report_fills_prompts_says_what_failed_and_lists_only_used_tolerances(gap):
    page = Path(gap.report_path).read_text()
    prov = next(line for line in page.splitlines() if line.startswith("| prompts |"))
    assert "`  `" not in prov and "n/a prompts" not in prov, prov
    assert "Feeding the same tokens another way changes the logits" not in page
    assert "speculative greedy differs from the engine's own plain greedy" in page
    tolerances = page.split("## Tolerances", 1)[1].split("\n## ", 1)[0].split("\n### ", 1)[0]
    assert "determinism" not in tolerances, tolerances
    assert "near-tie" in tolerances and "verify" in tolerances, tolerances


def test_each_case_shows_its_own_acceptance_and_what_it_counts(gap):
    spec = gap.results[0]
    cases = spec.details["cases"]
    assert all("counts" in r and r["proposed"] >= 0 for r in cases)
    assert "acceptance 0/250" not in spec.summary()
    page = Path(gap.report_path).read_text()
    assert "## Speculative acceptance per case" in page
    rows = page.split("## Speculative acceptance per case", 1)[1].split("\n## ", 1)[0]
    assert "chunked prompt \\[64, 1, 95\\], sequence 0, draft\\_max 1" in rows, rows


def test_an_engine_error_partway_keeps_the_judged_cases_in_a_receipt(tmp_path, monkeypatch):
    import harness.runs.probes as probes

    real = probes.probe_speculative

    class Breaks:
        """The candidate, refusing its 6th speculative call (after 4 chunked cases and the two sequences generated
            together: 6 comparisons)."""

        def __init__(self, engine):
            self._e, self.calls = engine, 0

        def __getattr__(self, name):
            return getattr(self._e, name)

        def speculative(self, *a, **k):
            self.calls += 1
            if self.calls == 6:
                raise EngineError("the engine died")
            return self._e.speculative(*a, **k)

    monkeypatch.setattr(probes, "probe_speculative", lambda engine, *a, **k: real(Breaks(engine), *a, **k))
    ledger = tmp_path / "ledger.jsonl"
    run = run_probes(ProbeRequest(model=MTP, candidate="oracle", only=["speculative"], ledger=str(ledger)))
    assert run.verdict is Verdict.ENGINE_ERROR and run.verdict.exit_code == 3
    assert "engine error in: speculative (the engine failed after 6 comparisons, which are kept: the engine died)" in run.message, run.message
    row = json.loads(ledger.read_text().splitlines()[-1])
    receipt = json.loads(Path(run.receipt_path).read_text())
    assert row["verdict"] == "ENGINE-ERROR" and receipt["verdict"] == "ENGINE-ERROR"
    spec = receipt["probes"][0]
    assert spec["verdict"] == "ENGINE-ERROR" and "the engine died" in spec["reason"]
    assert len(spec["comparisons"]) == 6 and all(c["ok"] for c in spec["comparisons"]), [c["label"] for c in spec["comparisons"]]
