"""The parity and probe cells an engine's repository runs with ``pytest -m parity``.

Shipped with the harness so that any repository can run them. Each test is one cell:

* ``test_parity[CANDIDATE@MODEL]``: the candidate against the reference on the prompt set, gated
  by thresholds.yaml, through the same path as ``harness parity``
  (``harness.runs.parity.run_parity``): PASS passes; FAIL (the message names the prompt and
  position), UNMEASURED, NOT-COMPARABLE, ENGINE-ERROR and INVALID fail;
* ``test_probes[CANDIDATE@MODEL]``: the self-consistency probes of ``harness probe``
  (``harness.runs.probes.run_probes``): split, decode, ubatch, multiseq, determinism, long, or
  ``[tool.harness] probes``; fails when a measured probe fails or a required one (split, decode,
  determinism) could not be measured.

Every failure message ends with the command that reproduces it; a run the harness refused or an
engine that failed is reported as the CLI reports it (``harness: VERDICT: message`` and the
engine's last stderr lines: the missing engine file, the Python traceback of the engine), with
no exception chain (``_refused``). The cells come from the
project's ``[tool.harness]`` (``candidate``, ``models``/``model``, ``reference``, ``prompts``,
``thresholds``, ``probes``), overridden by ``--candidate``, ``--model``, ``--reference``; the
plugin (``harness.pytest_plugin``) parametrizes them. With ``--harness-record`` each cell writes its
receipt and ledger row (``--harness-ledger PATH``, default the project's ledger), so CI and
sign-off share one evidence trail.

A repository runs them either from a test module that imports them (``harness init`` writes
``tests/test_qwen35_parity.py``: ``from harness.conformance import *``) or with
``[tool.harness] pytest = true`` / ``pytest --harness``, which make the plugin collect this
module itself.
"""

from __future__ import annotations

import shlex
from typing import Any, Callable

import pytest

from harness import display
from harness.runs.parity import ParityRequest, run_parity
from harness.runs.probes import ProbeRequest, run_probes
from harness.errors import HarnessError, Verdict

__all__ = ["test_parity", "test_probes"]


def reproducer(command: str, cell: Any, settings: Any, *extra: str) -> str:
    """The ``harness`` command line that re-runs ``cell`` (shell-quoted)."""
    args = ["harness", command, "--candidate", cell.candidate, "--model", cell.model]
    if settings.reference_given:
        args += ["--reference", settings.reference]
    for opt, value in (("--prompts", settings.prompts), ("--thresholds", settings.thresholds)):
        if value is not None:
            args += [opt, str(value)]
    return shlex.join([*args, *extra])


def _run(run: Callable[[Any], Any], req: Any) -> tuple[Any, HarnessError | None]:
    """``(run(req), None)``, or ``(None, error)`` when the harness refused or an engine failed:
    the cell fails outside the ``except`` block, so pytest shows no "During handling of the above
    exception" chain."""
    try:
        return run(req), None
    except HarnessError as e:
        return None, e


def _refused(what: str, e: HarnessError, again: str) -> str:
    """The failure text of a cell the harness could not judge: ``what VERDICT: message``, the
    engine's last stderr lines (``EngineError.stderr_tail``, escaped: ``display.lines``) when
    there are any, and the reproduce line."""
    head, _, rest = what.partition(" ")
    lines = [f"{head} {e.verdict.value}: {rest}: {display.plain(e)}"]
    tail = getattr(e, "stderr_tail", "")
    if tail:
        lines += ["engine stderr (last lines):", *("  " + ln for ln in display.lines(tail).splitlines())]
    return "\n".join([*lines, f"reproduce: {again}"])


def _argv(request: pytest.FixtureRequest) -> list[str]:
    return ["pytest", request.node.nodeid, "--harness-record"]


def _request_fields(cell, s, request) -> dict:
    """What a parity and a probe request of one cell share: model, candidate, the session's
    reference, prompts, thresholds and ledger, the pytest command line, whether to record."""
    return dict(model=cell.model, candidate=cell.candidate, reference=s.reference,
                prompts=None if s.prompts is None else str(s.prompts),
                thresholds=None if s.thresholds is None else str(s.thresholds),
                ledger=str(s.ledger), argv=_argv(request), write_evidence=s.record)


@pytest.mark.parity
def test_parity(harness_parity_cell, harness_settings, request):
    """One parity cell: the cell's candidate against the reference on the cell's model."""
    s, cell = harness_settings, harness_parity_cell
    again = reproducer("parity", cell, s)
    req = ParityRequest(**_request_fields(cell, s, request))
    outcome, error = _run(run_parity, req)
    if error is not None:
        pytest.fail(_refused(f"parity {cell.candidate} vs {s.reference} on {cell.model}", error, again), pytrace=False)
    result = outcome.result
    if result.verdict is not Verdict.PASS:
        lines = [f"parity {result.verdict.value}: {cell.candidate} vs {s.reference} on {cell.model} "
                 f"(sha256 {outcome.receipt['model']['sha256'][:12]}): {result.message}"]
        failing = [p for p in result.per_prompt if p["failing_positions"]]
        for p in failing[:5]:
            lines.append(f"  prompt {p['id']!r}: {p['failing_positions']} of {p['positions']} positions fail, "
                         f"first at position {p['first_failing_position']}, min cosine {p['min_cosine']:.6f}")
        lines.append(f"reproduce: {again}")
        where = result.gate.get("first_failing") or result.gate.get("max_kld_where")
        if result.verdict is Verdict.FAIL and where and "activations" in result.candidate_info.get("capabilities", []):
            lines.append(f"localize:  {reproducer('localize', cell, s, '--prompt', where['prompt'])}")
        if outcome.receipt_path:
            lines.append(f"receipt:   {outcome.receipt_path}")
        pytest.fail("\n".join(lines), pytrace=False)


@pytest.mark.parity
def test_probes(harness_probe_cell, harness_settings, request):
    """One probe cell: the self-consistency probes of the cell's candidate on the cell's model."""
    s, cell = harness_settings, harness_probe_cell
    extra = [a for name in s.probes for a in ("--only", name)] if s.probes else []
    again = reproducer("probe", cell, s, *extra)
    req = ProbeRequest(only=list(s.probes), **_request_fields(cell, s, request))
    run, error = _run(run_probes, req)
    if error is not None:
        pytest.fail(_refused(f"probes {cell.candidate} on {cell.model}", error, again), pytrace=False)
    if run.verdict is not Verdict.PASS:
        lines = [f"probes {run.verdict.value}: {cell.candidate} on {cell.model} "
                 f"(sha256 {run.receipt['model']['sha256'][:12]}): {run.message}"]
        lines += [f"  {r.reproducer or f'{r.name} {r.verdict.value}: {r.summary()}'}" for r in run.results if r.verdict is not Verdict.PASS]
        lines.append(f"reproduce: {again}")
        if run.receipt_path:
            lines.append(f"receipt:   {run.receipt_path}")
        pytest.fail("\n".join(lines), pytrace=False)
