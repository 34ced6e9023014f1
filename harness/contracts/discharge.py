"""Discharge: turn contract obligations into recorded RED→GREEN evidence, and compute status.

For each obligation, its bound tests run (in pytest subprocesses, through the harness plugin)

* against each RED subject its contract names (``red``): the candidate ``mutant:NAME``, the
  defective model ``fixture:NAME`` under the GREEN candidate, or the GREEN candidate with a fault
  planted in its output (``--plant NAME``). RED means at least one bound test FAILED BY
  ASSERTION; an error, a crash, a skip or nothing run is not RED; every test passing is
  ``VACUOUS`` (the test cannot see the fault) and the obligation is not discharged;
* against the GREEN subject (the candidate, default ``oracle``, on the obligation's model): every
  bound test must pass (a skip is not a pass).

Both must hold for ``DISCHARGED``. Each obligation's record goes to
``<evidence>/discharge/<contract-id>/<build>/<obligation-id>.json`` (schema ``harness-discharge/v1``) of
the project it belongs to (``harness.contracts.suite``: the repository you run in for a shipped
contract): the harness version with the shipped contracts' versions and sha256, the contract's
version and sha256, the bound node ids with the sha256 of their file and of the
test function's source, the support files (conftest.py, helpers), what the result depends on
(each engine's source files, the models' sha256, thresholds.yaml when the reference ran), both
runs (subject, outcome, assertion message, time, duration, command, the project's git commit).
``<build>`` is the GREEN subject's build (``build_dir``: ``oracle@1a2b3c4d5e6f``, the engine name
and the first 12 hex digits of ``harness.engines.registry.engine_build_id``), so the oracle's
records and each candidate build's live side by side and discharging one never overwrites
another's. Records of the earlier flat layout (``<contract-id>/<obligation-id>.json``) are still
read, for the subject their GREEN run names.

Status is computed, never declared (``status``), per obligation and GREEN subject: UNBOUND (no
tests), BOUND (tests, no passing record), RED-SEEN (RED shown, GREEN not), DISCHARGED,
NOT-APPLICABLE, STALE (anything hashed changed since, or only another build of the subject was
discharged).

NOT-APPLICABLE: an obligation whose bound tests take a fixture that needs a capability
(``NEEDS``: ``subject_acts`` needs ``activations``) the GREEN candidate does not declare cannot
be asked of it: a logits-only engine has no named activations to compare layer by layer. The
discharge then runs nothing for it and records that (``result`` NOT-APPLICABLE, ``not_applicable``:
the capability needed and those the candidate declared), as a record of its build like any other,
so it goes STALE with the engine's build, the bound tests or the contract, and when the candidate
declares the capability (``staleness``). It is not DISCHARGED: nothing was shown. ``check_exit``
(``harness status --check``) is green when every obligation is DISCHARGED or NOT-APPLICABLE and at
least one is DISCHARGED, UNMEASURED (5) when none could be asked.

Speed: the runs of one contract are planned into as few pytest processes as possible (each costs
an import of the stack): every subject sharing a model and plant runs in one session with
``--candidate a,b,c``, every defective fixture under one candidate in one session with
``--model x,y,z``; sessions run in parallel.
"""

from __future__ import annotations

import ast
import datetime
import json
import os
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, Iterable, Sequence

from harness.config import DEFAULT_CANDIDATE, HarnessConfig
from harness.contracts import suite
from harness.contracts.loader import (
    Contract,
    Obligation,
    Red,
    load_contract,
    load_contracts,
    pytest_command,
)
from harness.engines.registry import engine_build_id, engine_source_hashes, resolve_engine
from harness.errors import HarnessError, InvalidInput
from harness.evidence.receipts import harness_info, host_info
from harness.evidence.record import preflight_evidence, record_discharge
from harness.fixtures.resolve import resolve_model
from harness.fschecks import require_writable_dir
from harness.paths import IS_CHECKOUT, SOURCE_ROOT
from harness.provenance import git_state, sha256_bytes, sha256_file, suite_pins
from harness.rundir import scratch_dir

SCHEMA_ID = "harness-discharge/v1"
SESSION_TIMEOUT_S = 1200

UNBOUND, BOUND, RED_SEEN, DISCHARGED, STALE = "UNBOUND", "BOUND", "RED-SEEN", "DISCHARGED", "STALE"
NOT_APPLICABLE = "NOT-APPLICABLE"
STATUSES = (UNBOUND, BOUND, RED_SEEN, DISCHARGED, NOT_APPLICABLE, STALE)
NEEDS = {"subject_acts": "activations", "served": "serve"}
"""Fixtures of the shipped bound tests (tests/contracts/conftest.py) and the candidate capability
each needs: a test that takes one cannot be asked of a candidate without it."""
# outcomes of one side of a discharge
RED, GREEN, VACUOUS, FAIL, ERROR, SKIPPED, NOT_RUN = "RED", "GREEN", "VACUOUS", "FAIL", "ERROR", "SKIPPED", "NOT-RUN"


@dataclass(frozen=True)
class Subject:
    """What one run judges: a candidate engine on a model, optionally with a planted fault."""

    candidate: str
    model: str
    plant: str | None = None

    def __str__(self) -> str:
        return f"{self.candidate}{'+planted:' + self.plant if self.plant else ''} on {self.model}"


def red_subject(red: Red, ob: Obligation, candidate: str) -> Subject:
    """The subject that shows ``red`` for ``ob`` when the GREEN candidate is ``candidate``."""
    if red.kind == "mutant":
        return Subject(f"mutant:{red.name}", ob.model)
    if red.kind == "fixture":
        return Subject(candidate, f"fixture:{red.name}")
    return Subject(candidate, ob.model, red.name)


# ---------------------------------------------------------------------------------------------
# Running pytest
# ---------------------------------------------------------------------------------------------


@dataclass
class Session:
    """One pytest process: ``tests`` × ``candidates`` × ``models`` (those the tests use)."""

    candidates: list[str]
    models: list[str]
    plant: str | None
    tests: list[str]


@dataclass
class SessionRun:
    """The outcome of one session: per-item records from the plugin (``--harness-outcomes``)."""

    session: Session
    items: list[dict[str, Any]]
    command: list[str]
    started: str
    duration_s: float
    returncode: int
    output_tail: str
    git: dict[str, Any]


def plan_sessions(requests: Iterable[tuple[Subject, Sequence[str]]]) -> list[Session]:
    """Group ``(subject, tests)`` requests into sessions: subjects sharing a model and plant in
    one session (candidates listed), and sessions left with a single candidate merged across
    models (models listed)."""
    by_model: dict[tuple[str | None, str], tuple[list[str], set[str]]] = {}
    for subj, tests in requests:
        cands, ts = by_model.setdefault((subj.plant, subj.model), ([], set()))
        if subj.candidate not in cands:
            cands.append(subj.candidate)
        ts.update(tests)
    sessions: list[Session] = []
    single: dict[tuple[str | None, str], Session] = {}
    for (plant, model), (cands, ts) in by_model.items():
        if len(cands) == 1:
            s = single.setdefault((plant, cands[0]), Session(cands, [], plant, []))
            s.models.append(model)
            s.tests = sorted(set(s.tests) | ts)
        else:
            sessions.append(Session(cands, [model], plant, sorted(ts)))
    return sessions + list(single.values())


def run_session(root: Path, session: Session, timeout_s: float = SESSION_TIMEOUT_S, project: HarnessConfig | None = None) -> SessionRun:
    """Run one session's tests in a pytest subprocess from ``root``; never raises for test
    failures (they are data). ``project``: whose configuration (command engines) the tests see
    and whose git state the run records (default: the repository at ``root``). Raises
    ``InvalidInput`` when pytest could not run at all."""
    with scratch_dir("discharge-") as d:
        out = d / "outcomes.json"
        args = ["-q", "--harness-outcomes", str(out), "--candidate", ",".join(session.candidates), "--model", ",".join(session.models)]
        if session.plant:
            args += ["--plant", session.plant]
        cmd, env = pytest_command(root, args + list(session.tests), project.source if project else None)
        started = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
        t0 = time.monotonic()
        try:
            proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=timeout_s)
            rc, tail = proc.returncode, "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-20:])
        except subprocess.TimeoutExpired as e:
            rc, tail = -1, f"pytest timed out after {timeout_s:.0f} s: {e}"
        duration = time.monotonic() - t0
        items = json.loads(out.read_text())["items"] if out.exists() else []
    if not items and rc not in (0, 1, 5):
        raise InvalidInput(f"pytest could not run {' '.join(session.tests)} (exit {rc}):\n{tail}")
    shown = ["python", *("OUTCOMES.json" if a == str(out) else "." if a == str(root) else a for a in cmd[1:])]
    return SessionRun(session, items, shown, started, round(duration, 3), rc, tail, git_state(project.base_dir if project else root))


def run_sessions(root: Path, sessions: Sequence[Session], jobs: int | None = None, project: HarnessConfig | None = None) -> list[SessionRun]:
    """Run sessions in parallel (``jobs`` processes, default the CPU count); ``project`` as in
    ``run_session``."""
    jobs = max(1, jobs or os.cpu_count() or 1)
    with ThreadPoolExecutor(max_workers=min(jobs, max(1, len(sessions)))) as pool:
        return list(pool.map(lambda s: run_session(root, s, project=project), sessions))


def _matches(item: dict[str, Any], subject: Subject) -> bool:
    """An item judged ``subject`` if it used (or did not need) that candidate, model and plant."""
    return (
        item["candidate"] in (None, subject.candidate)
        and item["model"] in (None, subject.model)
        and (item["candidate"] is None or item["plant"] == subject.plant)
    )


def judge(runs: Sequence[SessionRun], tests: Sequence[str], subject: Subject, expect: str) -> dict[str, Any]:
    """The outcome of ``tests`` on ``subject`` across ``runs``.

    ``expect`` RED: RED if any item failed by assertion, else ERROR (an error or crash), VACUOUS
    (something passed), SKIPPED or NOT-RUN. ``expect`` GREEN: GREEN if every item passed (at
    least one ran), else FAIL, ERROR, SKIPPED or NOT-RUN. Returns ``{outcome, message, items,
    run}`` (``run``: the session's command, start, duration, git).
    """
    wanted = set(tests)
    found = [(r, it) for r in runs for it in r.items if it["function"] in wanted and _matches(it, subject)]
    items = [it for _, it in found]
    outcomes = {it["outcome"] for it in items}
    first = lambda o: next((it for it in items if it["outcome"] == o), None)  # noqa: E731
    if not items:
        outcome, msg = NOT_RUN, f"no bound test ran on {subject}"
    elif expect == RED:
        if "failed" in outcomes:
            outcome, msg = RED, first("failed")["message"]
        elif "error" in outcomes:
            it = first("error")
            outcome, msg = ERROR, f"{it['exception']} in {it['phase']} (not an assertion): {it['message']}"
        elif "passed" in outcomes:
            outcome, msg = VACUOUS, f"every bound test passed on {subject}: the tests cannot see this fault"
        else:
            outcome, msg = SKIPPED, first("skipped")["message"]
    else:
        if outcomes == {"passed"}:
            outcome, msg = GREEN, f"{len(items)} bound test item(s) passed"
        elif "failed" in outcomes:
            outcome, msg = FAIL, first("failed")["message"]
        elif "error" in outcomes:
            it = first("error")
            outcome, msg = ERROR, f"{it['exception']} in {it['phase']}: {it['message']}"
        else:
            outcome, msg = SKIPPED, (first("skipped") or {"message": "skipped"})["message"]
    run = found[0][0] if found else None
    return {
        "subject": asdict(subject),
        "outcome": outcome,
        "message": msg,
        "items": [{k: it[k] for k in ("nodeid", "outcome", "exception", "phase", "duration_s", "message")} for it in items],
        "run": None if run is None else {"command": run.command, "started": run.started, "duration_s": run.duration_s,
                                         "returncode": run.returncode, "git": run.git},
    }


# ---------------------------------------------------------------------------------------------
# What an obligation needs of its candidate
# ---------------------------------------------------------------------------------------------


@lru_cache(maxsize=256)
def bound_test_fixtures(path: Path, qualname: str) -> frozenset[str]:
    """The argument names (its fixtures) of the test function ``qualname`` (``Class::test`` or
    ``test``) in ``path``, read with ``ast`` (nothing imported); empty when unparsable."""
    try:
        tree = ast.parse(path.read_text())
    except (OSError, SyntaxError):
        return frozenset()
    body: list[ast.stmt] = tree.body
    for i, name in enumerate(parts := qualname.split("::")):
        node = next((n for n in body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and n.name == name), None)
        if node is None:
            return frozenset()
        if i == len(parts) - 1:
            return frozenset(a.arg for a in node.args.args) if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) else frozenset()
        body = node.body
    return frozenset()


def needed_capabilities(contract: Contract, ob: Obligation) -> list[str]:
    """The candidate capabilities ``ob``'s bound tests need (``NEEDS`` of the fixtures they take), sorted."""
    need = {NEEDS[f] for t in ob.tests for f in bound_test_fixtures(contract.root / t.split("::", 1)[0], t.split("::", 1)[1]) if f in NEEDS}
    return sorted(need)


def needs_activations(contract: Contract, ob: Obligation) -> bool:
    """True when a bound test of ``ob`` takes a fixture that needs the candidate's activations."""
    return "activations" in needed_capabilities(contract, ob)


@lru_cache(maxsize=64)
def candidate_capabilities(candidate: str, model: str) -> tuple[str, ...] | None:
    """The capabilities ``candidate`` declares (``EngineInfo.capabilities``) made on ``model``;
    None when it cannot be made (its tests then run and say why)."""
    try:
        return tuple(resolve_engine(candidate, resolve_model(model)).info.capabilities)
    except HarnessError:
        return None


def missing_capabilities(contract: Contract, ob: Obligation, candidate: str) -> list[str]:
    """The capabilities ``ob``'s bound tests need that ``candidate`` does not declare (``[]``: it
    can be asked, or its capabilities cannot be read)."""
    need = needed_capabilities(contract, ob)
    caps = candidate_capabilities(candidate, ob.model) if need else ()
    return [] if caps is None else [c for c in need if c not in caps]


# ---------------------------------------------------------------------------------------------
# What a result depends on
# ---------------------------------------------------------------------------------------------


def _sha256_or_none(path: Path) -> str | None:
    """sha256 of a file, or None when it cannot be read (a file deleted since is a change)."""
    try:
        return sha256_file(path)
    except InvalidInput:
        return None


def function_source(path: Path, qualname: str) -> str | None:
    """Source of the test function ``qualname`` (``test_x`` or ``Class::test_x``) in ``path``,
    decorators included, via ``ast``; None when absent or unparsable."""
    try:
        text = path.read_text()
        tree = ast.parse(text)
    except (OSError, SyntaxError):
        return None
    body: list[ast.stmt] = tree.body
    parts = qualname.split("::")
    for i, name in enumerate(parts):
        node = next((n for n in body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and n.name == name), None)
        if node is None:
            return None
        if i == len(parts) - 1:
            lines = text.splitlines(keepends=True)
            start = min([d.lineno for d in getattr(node, "decorator_list", [])] + [node.lineno])
            return "".join(lines[start - 1 : node.end_lineno])
        body = node.body
    return None


def test_hashes(root: Path, tests: Sequence[str]) -> tuple[list[dict[str, Any]], dict[str, str | None]]:
    """Per bound test: file, file sha256, function-source sha256; and the support files the
    tests load (every conftest.py from the test's folder up to ``root``, and the non-test
    modules beside it)."""
    out, support = [], {}
    for t in tests:
        rel, func = t.split("::", 1)
        path = root / rel
        src = function_source(path, func)
        out.append({"nodeid": t, "file": rel, "file_sha256": _sha256_or_none(path),
                    "function_sha256": sha256_bytes(src.encode()) if src is not None else None})
        folder = path.parent
        for p in sorted(folder.glob("*.py")):
            if not p.name.startswith("test_"):
                support[p.relative_to(root).as_posix()] = _sha256_or_none(p)
        while folder != root and root in folder.parents:
            folder = folder.parent
            if (folder / "conftest.py").exists():
                support[(folder / "conftest.py").relative_to(root).as_posix()] = _sha256_or_none(folder / "conftest.py")
    return out, dict(sorted(support.items()))


def model_sha256(spec: str) -> str | None:
    """sha256 of the model ``spec`` names (fixtures and defective fixtures are built if needed);
    None when it cannot be resolved."""
    try:
        return _sha256_or_none(resolve_model(spec))
    except HarnessError:
        return None


def _depends(root: Path, subjects: Sequence[Subject], reference: str | None, uses_candidate: bool = True) -> dict[str, Any]:
    engines: dict[str, Any] = {}
    for s in subjects if uses_candidate else ():
        engines[s.candidate] = engine_source_hashes(s.candidate)
        if s.plant:
            engines[f"planted:{s.plant}"] = engine_source_hashes(f"planted:{s.plant}")
    if reference:
        engines[reference] = engine_source_hashes(reference)
    models = {m: model_sha256(m) for m in sorted({s.model for s in subjects})}
    thr = root / "thresholds.yaml"
    thresholds = {"path": "thresholds.yaml", "sha256": _sha256_or_none(thr)} if reference and thr.exists() else None
    return {"engines": engines, "models": models, "thresholds": thresholds}


# ---------------------------------------------------------------------------------------------
# Discharge
# ---------------------------------------------------------------------------------------------


@dataclass
class ObligationResult:
    """One obligation's discharge: ``result`` DISCHARGED, NOT-APPLICABLE, VACUOUS, NOT-RED or GREEN-FAILED;
    ``record`` the evidence written (or that would be)."""

    contract: str
    obligation: str
    result: str
    red: list[dict[str, Any]]
    green: dict[str, Any]
    record: dict[str, Any]
    path: Path | None = None
    receipt: Path | None = None
    """The discharge receipt that binds this record (``record_discharge``), None when not written."""


def _rel(path: Path, root: Path) -> str:
    try:
        return path.resolve().relative_to(root.resolve()).as_posix()
    except ValueError:
        return str(path)


def _result(reds: list[dict[str, Any]], green: dict[str, Any]) -> str:
    if any(r["outcome"] == VACUOUS for r in reds):
        return VACUOUS
    if not reds or any(r["outcome"] != RED for r in reds):
        return "NOT-RED"
    return DISCHARGED if green["outcome"] == GREEN else "GREEN-FAILED"


@lru_cache(maxsize=1)
def harness_pins() -> dict[str, Any]:
    """The record's ``harness`` field: the harness version, the shipped contracts' versions and
    the suite's sha256 (``harness.provenance.suite_pins``), and the harness checkout's git commit and whether
    it had uncommitted changes when it runs from one (None from an installed wheel)."""
    pins = dict(suite_pins())
    git = git_state(SOURCE_ROOT) if IS_CHECKOUT else {"commit": None, "dirty": None}
    pins.update(git_commit=git["commit"], git_dirty=git["dirty"])
    return pins


def default_evidence_dir(contract: Contract) -> Path:
    """``<evidence>/discharge`` of the project the contract's evidence belongs to: the current
    project for a shipped contract, else the repository holding it (``suite.discharge_dir``;
    ``<repo>/evidence/discharge`` unless ``[tool.harness] evidence`` says otherwise)."""
    return suite.discharge_dir(contract.root)


BUILD_PREFIX_HEX = 12
"""Hex digits of the build id in a record folder's name."""


def build_dir(candidate: str, build_id: str | None = None) -> str:
    """The folder name of ``candidate``'s records at ``build_id`` (default: its build now):
    ``NAME@BUILD12`` with every character outside ``[A-Za-z0-9._-]`` of the name as ``-``
    (``command:mine`` → ``command-mine@…``). Raises ``InvalidInput`` for a malformed engine table."""
    slug = "".join(c if c.isalnum() or c in "._-" else "-" for c in candidate)
    return f"{slug}@{(build_id or engine_build_id(candidate))[:BUILD_PREFIX_HEX]}"


def record_bytes(record: dict[str, Any]) -> bytes:
    """A discharge record as its file holds it (indented JSON, UTF-8, one final newline): the
    bytes whose sha256 the discharge receipt names."""
    return (json.dumps(record, indent=1, ensure_ascii=False) + "\n").encode("utf-8")


def discharge_verdict(results: Sequence["ObligationResult"]) -> str:
    """The discharge receipt's verdict: DISCHARGED, FAIL or UNMEASURED, as ``discharge_exit``'s
    0, 1 and 5."""
    return {0: DISCHARGED, 5: "UNMEASURED"}.get(discharge_exit(results), "FAIL")


def discharge_receipt(contract: Contract, candidate: str, build: str, evidence_dir: Path, results: Sequence["ObligationResult"],
                      documents: dict[Path, bytes], argv: Sequence[str], project_root: Path) -> dict[str, Any]:
    """The ``harness-discharge-receipt/v1`` receipt of one discharge (schema
    ``harness/schemas/discharge-receipt.schema.json``): the contract, the GREEN subject and its
    build folder, each selected obligation's result with its record's path under
    ``evidence_dir`` and the sha256 of the bytes in ``documents`` (null for an UNBOUND one), the
    counts per result and the verdict (``discharge_verdict``)."""
    by_path = {p: sha256_bytes(b) for p, b in documents.items()}
    obligations, counts = [], {}
    for r in results:
        counts[r.result] = counts.get(r.result, 0) + 1
        obligations.append({"id": r.obligation, "result": r.result,
                            "record": None if r.path is None else r.path.relative_to(evidence_dir).as_posix(),
                            "sha256": None if r.path is None else by_path[r.path]})
    verdict = discharge_verdict(results)
    done = counts.get(DISCHARGED, 0)
    return {
        "schema": "harness-discharge-receipt/v1",
        "kind": "discharge",
        "host": host_info(),
        "harness": harness_info(SOURCE_ROOT),
        "command": [str(a) for a in argv],
        "contract": {"id": contract.id, "version": contract.version, "sha256": contract.sha256, "path": _rel(contract.path, project_root)},
        "candidate": candidate,
        "build": build,
        "evidence_dir": _rel(evidence_dir, project_root),
        "obligations": obligations,
        "counts": counts,
        "verdict": verdict,
        "message": f"{contract.id} for {candidate}: {done}/{len(results)} obligations DISCHARGED"
                   + "".join(f", {n} {k}" for k, n in sorted(counts.items()) if k != DISCHARGED),
    }


def discharge_record(contract: Contract, ob: Obligation, runs: Sequence[SessionRun], candidate: str) -> tuple[dict[str, Any], list[dict[str, Any]], dict[str, Any]]:
    """The ``harness-discharge/v1`` record of one bound obligation from the finished pytest
    ``runs``: each RED subject's and the GREEN candidate's judgement, the result, and the hashes of
    everything the result depends on (contract, obligation, bound tests and support files,
    engines' sources, models, thresholds when the reference ran). Returns (record, the RED
    judgements, the GREEN judgement)."""
    root = contract.root
    reds = []
    for r in ob.reds:
        j = judge(runs, ob.tests, red_subject(r, ob, candidate), RED)
        reds.append({"shown_by": str(r), **j})
    green = judge(runs, ob.tests, Subject(candidate, ob.model), GREEN)
    mine = [it for run in runs for it in run.items if it["function"] in ob.tests]
    used_reference = next((it["reference"] for it in mine if it.get("reference")), None)
    uses_candidate = any(it["candidate"] is not None for it in mine)  # model-only tests do not depend on an engine
    subjects = [red_subject(r, ob, candidate) for r in ob.reds] + [Subject(candidate, ob.model)]
    tests, support = test_hashes(root, ob.tests)
    record = {
        "schema": SCHEMA_ID,
        "result": _result(reds, green),
        "recorded_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "harness": harness_pins(),
        "contract": {"id": contract.id, "version": contract.version, "path": _rel(contract.path, root), "sha256": contract.sha256,
                     "shipped": suite.is_shipped(root)},
        "obligation": {"id": ob.id, "kind": ob.kind, "property": ob.property, "model": ob.model, "sha256": ob.sha256},
        "tests": tests,
        "support_files": support,
        "depends_on": _depends(root, subjects, used_reference, uses_candidate),
        "red": reds,
        "green": {"shown_by": candidate, **green},
        "build": {"candidate": candidate, "id": engine_build_id(candidate)},
    }
    return record, reds, green


def not_applicable_record(contract: Contract, ob: Obligation, candidate: str, missing: Sequence[str]) -> tuple[dict[str, Any], list[dict[str, Any]], dict[str, Any]]:
    """The ``harness-discharge/v1`` record of an obligation ``candidate`` cannot be asked (its bound
    tests need the capabilities ``missing``): ``result`` NOT-APPLICABLE, no RED run, a GREEN side
    that ran nothing and says why, ``not_applicable`` (``needs``, the capabilities the candidate
    declared), and the hashes of the contract, bound tests, the candidate's sources and the model,
    so it goes STALE as a discharged record would. Returns (record, [], the GREEN side)."""
    caps = candidate_capabilities(candidate, ob.model) or ()
    why = (f"{candidate} does not declare the {', '.join(missing)} capability its bound tests need "
           f"({', '.join(ob.tests)}); declared: {', '.join(caps) or 'none'}")
    green = {"shown_by": candidate, "subject": asdict(Subject(candidate, ob.model)), "outcome": NOT_APPLICABLE, "message": why,
             "items": [], "run": None}
    tests, support = test_hashes(contract.root, ob.tests)
    record = {
        "schema": SCHEMA_ID,
        "result": NOT_APPLICABLE,
        "recorded_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "harness": harness_pins(),
        "contract": {"id": contract.id, "version": contract.version, "path": _rel(contract.path, contract.root), "sha256": contract.sha256,
                     "shipped": suite.is_shipped(contract.root)},
        "obligation": {"id": ob.id, "kind": ob.kind, "property": ob.property, "model": ob.model, "sha256": ob.sha256},
        "tests": tests,
        "support_files": support,
        "depends_on": _depends(contract.root, [Subject(candidate, ob.model)], None),
        "red": [],
        "green": green,
        "not_applicable": {"needs": list(missing), "capabilities": list(caps)},
        "build": {"candidate": candidate, "id": engine_build_id(candidate)},
    }
    return record, [], green


def check_exit(rows: Sequence["StatusRow"]) -> int:
    """The exit code of ``harness status --check`` over ``rows``: 0 when every obligation is
    DISCHARGED or NOT-APPLICABLE and at least one is DISCHARGED; 5 (UNMEASURED) when none is
    DISCHARGED and nothing else is wrong (every obligation NOT-APPLICABLE: nothing the candidate
    could be asked was shown); else 1."""
    if any(r.status not in (DISCHARGED, NOT_APPLICABLE) for r in rows):
        return 1
    return 0 if any(r.status == DISCHARGED for r in rows) else 5


def discharge_exit(results: Sequence["ObligationResult"]) -> int:
    """The exit code of ``harness discharge``: as ``check_exit``, over the results."""
    if not results or any(r.result not in (DISCHARGED, NOT_APPLICABLE) for r in results):
        return 1
    return 0 if any(r.result == DISCHARGED for r in results) else 5


def discharge(
    path: str | os.PathLike,
    candidate: str = DEFAULT_CANDIDATE,
    obligation_ids: Sequence[str] = (),
    evidence_dir: str | os.PathLike | None = None,
    jobs: int | None = None,
    write: bool = True,
    ledger: str | os.PathLike | None = None,
    argv: Sequence[str] | None = None,
) -> list[ObligationResult]:
    """Discharge the obligations of the contract at ``path`` (all, or ``obligation_ids``).

    The contract is validated first (schema, ids, oracle functions, reds, test collection). RED
    subjects come from each obligation's ``red``; GREEN is ``candidate`` on the obligation's
    model. ``path`` is a contract file or id (``harness.contracts.suite``). With ``write`` the
    discharge goes through the evidence door (``harness.evidence.record.record_discharge``): each
    record is written atomically to ``evidence_dir/<contract>/<build>/<obligation>.json``
    (``build_dir(candidate)``; default ``evidence_dir``: ``default_evidence_dir``, the project's
    ``evidence/discharge``), with a discharge receipt naming each record's sha256 and its row in
    ``ledger`` (default: the project's ledger), LEDGER.md and the reports index; the ledger and
    the folders are checked writable before any test session runs. ``argv``: the command line
    the receipt records.
    Raises ``InvalidInput`` (exit 2) for an invalid contract, an unknown obligation id or
    evidence that cannot be written.
    """
    contract = load_contract(path)
    root = contract.root
    project = suite.project_config(root)
    obs = [contract.obligation(o) for o in obligation_ids] if obligation_ids else list(contract.obligations)
    missing = {ob.id: missing_capabilities(contract, ob, candidate) for ob in obs if ob.tests}
    requests: list[tuple[Subject, Sequence[str]]] = []
    for ob in (ob for ob in obs if ob.tests and not missing[ob.id]):
        requests += [(red_subject(r, ob, candidate), ob.tests) for r in ob.reds]
        requests.append((Subject(candidate, ob.model), ob.tests))
    out_dir = Path(evidence_dir) if evidence_dir else default_evidence_dir(contract)
    evidence = None
    if write:
        require_writable_dir(out_dir, "discharge evidence folder")  # before any test session is spent
        evidence = preflight_evidence(ledger if ledger is not None else project.ledger)
    runs = run_sessions(root, plan_sessions(requests), jobs, project) if requests else []
    results, documents = [], {}
    build = build_dir(candidate)
    for ob in obs:
        if not ob.tests:
            results.append(ObligationResult(contract.id, ob.id, UNBOUND, [], {}, {}))
            continue
        if missing[ob.id]:
            record, reds, green = not_applicable_record(contract, ob, candidate, missing[ob.id])
        else:
            record, reds, green = discharge_record(contract, ob, runs, candidate)
        where = out_dir / contract.id / build / f"{ob.id}.json" if write else None
        if where is not None:
            documents[where] = record_bytes(record)
        results.append(ObligationResult(contract.id, ob.id, record["result"], reds, green, record, where))
    if evidence is not None:
        argv = list(argv) if argv is not None else ["harness", "discharge", str(path), "--candidate", candidate]
        _record(evidence, discharge_receipt(contract, candidate, build, out_dir, results, documents, argv, project.base_dir),
                documents, results)
    return results


def _record(evidence: Any, receipt: dict[str, Any], documents: dict[Path, bytes], results: Sequence[ObligationResult]) -> None:
    """The discharge through the evidence door (``record_discharge``), each result told its receipt."""
    recorded = record_discharge(evidence, receipt, documents)
    for r in results:
        r.receipt = recorded.receipt_path


# ---------------------------------------------------------------------------------------------
# Status
# ---------------------------------------------------------------------------------------------


def staleness(record: dict[str, Any], contract: Contract) -> list[str]:
    """What changed since ``record`` was written (empty when nothing did): the contract, a
    bound test's file or function, a support file, an engine's source, a model, thresholds.yaml,
    or the obligation's test list."""
    root, why = contract.root, []
    if record.get("contract", {}).get("sha256") != contract.sha256:
        why.append(f"contract {contract.path.name} changed")
    ob = next((o for o in contract.obligations if o.id == record.get("obligation", {}).get("id")), None)
    if ob is not None and sorted(ob.tests) != sorted(t["nodeid"] for t in record.get("tests", [])):
        why.append("bound tests changed")
    for t in record.get("tests", []):
        path = root / t["file"]
        if _sha256_or_none(path) != t["file_sha256"]:
            src = function_source(path, t["nodeid"].split("::", 1)[1])
            fn = sha256_bytes(src.encode()) if src is not None else None
            why.append(f"test {t['nodeid']} changed" if fn != t["function_sha256"] else f"test file {t['file']} changed")
    for f, sha in record.get("support_files", {}).items():
        if _sha256_or_none(root / f) != sha:
            why.append(f"support file {f} changed")
    deps = record.get("depends_on", {})
    for name, files in deps.get("engines", {}).items():
        now = engine_source_hashes(name)
        changed = [f for f, sha in files.items() if now.get(f) != sha]
        if changed:
            why.append(f"engine {name} source changed: {', '.join(changed)}")
    for spec, sha in deps.get("models", {}).items():
        if model_sha256(spec) != sha:
            why.append(f"model {spec} changed")
    thr = deps.get("thresholds")
    if thr and _sha256_or_none(root / thr["path"]) != thr["sha256"]:
        why.append("thresholds.yaml changed")
    na = record.get("not_applicable")
    if isinstance(na, dict) and ob is not None:
        caps = candidate_capabilities(str(_green_subject(record)), ob.model) or ()
        now = [c for c in na.get("needs") or [] if c in caps]
        if now:
            why.append(f"{_green_subject(record)} now declares the {', '.join(now)} capability: discharge it")
    return why


@dataclass
class StatusRow:
    """The computed status of one obligation for one GREEN subject (``candidate``; None when
    nothing was discharged); ``detail`` says why, ``evidence`` is the record's path."""

    contract: str
    obligation: str
    status: str
    detail: str
    evidence: str | None
    candidate: str | None = None


def _read_record(path: Path) -> dict[str, Any] | str:
    """A record's JSON object, or why it cannot be used."""
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        return f"unreadable record: {e}"
    if not isinstance(record, dict) or record.get("schema") != SCHEMA_ID:
        return f"record schema {record.get('schema') if isinstance(record, dict) else None!r} is not {SCHEMA_ID}"
    return record


def _green_subject(record: dict[str, Any]) -> str | None:
    green = record.get("green")
    return green.get("shown_by") if isinstance(green, dict) else None


def record_paths(evidence_dir: Path, contract_id: str, ob_id: str, candidate: str) -> tuple[Path | None, list[Path]]:
    """``(the record of candidate's current build or None, records of its other builds)`` for
    one obligation, the flat layout's record counted as another build when its GREEN run was
    ``candidate`` (module docstring)."""
    folder = evidence_dir / contract_id
    here = build_dir(candidate)  # hashes the engine's sources: once
    current = folder / here / f"{ob_id}.json"
    slug = here.split("@", 1)[0]
    others = [p for p in sorted(folder.glob(f"{slug}@*/{ob_id}.json")) if p != current] if folder.is_dir() else []
    flat = folder / f"{ob_id}.json"
    if flat.is_file():
        rec = _read_record(flat)
        if isinstance(rec, dict) and _green_subject(rec) == candidate:
            others.append(flat)
    return (current if current.is_file() else None), others


def recorded_subjects(evidence_dir: Path, contract_id: str) -> list[str]:
    """The GREEN subjects that have records for ``contract_id`` (either layout), sorted."""
    folder = evidence_dir / contract_id
    found: set[str] = set()
    for path in sorted(folder.glob("*/*.json")) + sorted(folder.glob("*.json")) if folder.is_dir() else []:
        rec = _read_record(path)
        if isinstance(rec, dict) and _green_subject(rec):
            found.add(str(_green_subject(rec)))
    return sorted(found)


def _judged(contract: Contract, ob: Obligation, path: Path, candidate: str | None) -> StatusRow:
    """The status one record gives (stale, discharged, RED-SEEN or just bound)."""
    record = _read_record(path)
    if isinstance(record, str):
        return StatusRow(contract.id, ob.id, BOUND, record, str(path), candidate)
    why = staleness(record, contract)
    if why:
        return StatusRow(contract.id, ob.id, STALE, "; ".join(why), str(path), candidate)
    result = record.get("result")
    if result == NOT_APPLICABLE and isinstance(record.get("not_applicable"), dict):
        return StatusRow(contract.id, ob.id, NOT_APPLICABLE, f"{record['recorded_at']}: {record['green'].get('message', '')}", str(path), candidate)
    if result == DISCHARGED and all(r.get("outcome") == RED for r in record.get("red", [])) and record.get("green", {}).get("outcome") == GREEN:
        return StatusRow(contract.id, ob.id, DISCHARGED, f"{record['recorded_at']}: RED on {', '.join(r['shown_by'] for r in record['red'])}, GREEN on {record['green']['shown_by']}", str(path), candidate)
    if record.get("red") and all(r.get("outcome") == RED for r in record["red"]):
        return StatusRow(contract.id, ob.id, RED_SEEN, f"GREEN {record.get('green', {}).get('outcome')}: {record.get('green', {}).get('message', '')[:200]}", str(path), candidate)
    return StatusRow(contract.id, ob.id, BOUND, f"last discharge {result}", str(path), candidate)


def obligation_status(contract: Contract, ob: Obligation, evidence_dir: Path, candidate: str | None = None) -> StatusRow:
    """Status of one obligation for the GREEN subject ``candidate`` (default ``oracle``) from its
    record at the candidate's current build, else STALE when only other builds (or a flat-layout
    record) exist, else BOUND; and always against the current files."""
    cand = candidate or DEFAULT_CANDIDATE
    if not ob.tests:
        return StatusRow(contract.id, ob.id, UNBOUND, "no tests bound", None, candidate)
    current, others = record_paths(evidence_dir, contract.id, ob.id, cand)
    if current is not None:
        return _judged(contract, ob, current, cand)
    flat = [p for p in others if p.parent.name == contract.id]
    if flat:  # the flat layout's record: judged as it always was (its engine hashes say whether it is current)
        return _judged(contract, ob, flat[0], cand)
    if others:
        recorded = ", ".join(p.parent.name.split("@", 1)[1] for p in others)
        return StatusRow(contract.id, ob.id, STALE, f"discharged for other builds of {cand} ({recorded}), not for its build now "
                         f"({build_dir(cand).split('@', 1)[1]}); run harness discharge {contract.id} --candidate {cand}", str(others[-1]), cand)
    return StatusRow(contract.id, ob.id, BOUND, f"never discharged for {cand}", None, candidate)


def status(paths: Sequence[str | os.PathLike], evidence_dir: str | os.PathLike | None = None,
           candidates: Sequence[str] = ()) -> tuple[list[StatusRow], list[dict[str, Any]]]:
    """Computed status of every obligation of the contracts at ``paths`` for each GREEN subject in
    ``candidates`` (default: every subject that has records for the contract, else one row per
    obligation with no subject) and coverage per contract (``{contract, version, obligations,
    counts per status, discharged_fraction}``, counted over the rows). Contracts are
    schema-validated (tests are not re-collected). Raises ``InvalidInput``."""
    contracts = load_contracts(paths, check_tests=False)
    rows, coverage = [], []
    for c in contracts:
        ev = Path(evidence_dir) if evidence_dir else default_evidence_dir(c)
        subjects: list[str | None] = list(candidates) or list(recorded_subjects(ev, c.id)) or [None]
        cr = [obligation_status(c, ob, ev, s) for s in subjects for ob in c.obligations]
        rows += cr
        counts = {s: sum(1 for r in cr if r.status == s) for s in STATUSES}
        applicable = len(cr) - counts[NOT_APPLICABLE]
        coverage.append({"contract": c.id, "version": c.version, "obligations": len(cr), **counts,
                         "discharged_fraction": counts[DISCHARGED] / applicable if applicable else 0.0})
    return rows, coverage


# ---------------------------------------------------------------------------------------------
# The mutant matrix
# ---------------------------------------------------------------------------------------------


def mutant_matrix(contracts: Sequence[Contract], mutants: Sequence[str], jobs: int | None = None, split: int = 2) -> dict[str, dict[str, str]]:
    """``{mutant: {obligation: RED | GREEN | ERROR | SKIPPED | VACUOUS...}}``: every bound test
    of ``contracts`` run on every ``mutant:NAME`` on each obligation's model (one session per
    model and per ``split`` share of the mutants). RED: a bound test failed by assertion; GREEN:
    all passed."""
    by_model: dict[str, set[str]] = {}
    for c in contracts:
        for ob in c.obligations:
            by_model.setdefault(ob.model, set()).update(ob.tests)
    cands = [f"mutant:{m}" for m in mutants]
    sessions = []
    for model, tests in by_model.items():
        n = split if len(tests) > 4 else 1  # a model with a few tests is not worth a second import
        sessions += [Session(cands[i::n], [model], None, sorted(tests)) for i in range(n) if cands[i::n]]
    root = contracts[0].root
    runs = run_sessions(root, sessions, jobs, suite.project_config(root))
    out: dict[str, dict[str, str]] = {}
    for m in mutants:
        row = out.setdefault(m, {})
        for c in contracts:
            for ob in c.obligations:
                j = judge(runs, ob.tests, Subject(f"mutant:{m}", ob.model), RED)
                row[ob.id] = {RED: "RED", VACUOUS: "GREEN"}.get(j["outcome"], j["outcome"])
    return out
