"""pytest plugin (entry point ``pytest11``): options, markers and engine fixtures.

Options: ``--candidate NAME`` (default ``oracle``), ``--reference NAME`` (default
``llama.cpp``), ``--model SPEC`` (path or ``fixture:NAME``; default: the default model).
Markers: ``parity`` (end-to-end parity tests, ``pytest -m parity``), ``contract`` (tests bound
to contract obligations), ``slow`` (kept out of the default run), ``hf`` (need the
transformers extra). Fixtures: ``harness_model_path``, ``candidate_engine``,
``reference_engine``: bound tests receive their subject only through these.

For contract discharge (``harness.contracts.discharge``): ``--candidate`` and ``--model`` take
comma-separated lists, and every test that uses the candidate (or the model) then runs once per
entry (session-scoped parametrization, ids ``c=NAME`` / ``m=SPEC``); ``--plant NAME`` wraps the
candidate in a planted output fault (``harness.engines.mutants.PLANTS``); ``fixture:NAME`` also
names the defective fixtures of ``harness.fixtures.defects``; ``--harness-outcomes PATH`` writes every
collected and run item (outcome, exception type, assertion message, subject) as JSON.

The harness modules (engines, fixtures: NumPy, gguf, the oracle) are imported inside the fixtures
that need them, on purpose: pytest loads this entry point in every test process of the
environment, also in projects and runs that never ask for an engine.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from harness.config import DEFAULT_CANDIDATE, DEFAULT_REFERENCE


def pytest_addoption(parser: pytest.Parser) -> None:
    g = parser.getgroup("harness", "Qwen3.5 verification harness")
    g.addoption("--candidate", default=None, help=f"candidate engine name (default {DEFAULT_CANDIDATE})")
    g.addoption("--reference", default=None, help=f"reference engine name (default {DEFAULT_REFERENCE})")
    g.addoption("--model", dest="harness_model", default=None, help="model path or fixture:NAME (comma-separated: one run per model)")
    g.addoption("--plant", dest="harness_plant", default=None, help="wrap the candidate in a planted output fault (harness mutants list)")
    g.addoption("--harness-outcomes", dest="harness_outcomes", default=None, metavar="PATH",
                help="write collected items and per-item outcomes as JSON to PATH (used by harness discharge)")


def pytest_configure(config: pytest.Config) -> None:
    for line in (
        "parity: end-to-end parity of a candidate against the reference (pytest -m parity)",
        "contract: a test bound to a contract obligation",
        "slow: long-running; kept out of the default run (make test-slow runs them)",
    ):
        config.addinivalue_line("markers", line)


def _names(value: str | None) -> list[str]:
    return [v.strip() for v in (value or "").split(",") if v.strip()]


def candidate_names(config: pytest.Config) -> list[str]:
    """The candidates named by ``--candidate`` (default ``[DEFAULT_CANDIDATE]``)."""
    return _names(config.getoption("candidate")) or [DEFAULT_CANDIDATE]


def model_specs(config: pytest.Config) -> list[str]:
    """The models named by ``--model`` (default ``[default_model()]``)."""
    # deferred: see the module docstring
    from harness.fixtures.resolve import default_model

    return _names(config.getoption("harness_model")) or [default_model()]


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """With several candidates or models, run each test that uses them once per entry."""
    for argname, names, prefix in (
        ("candidate_name", candidate_names(metafunc.config), "c="),
        ("harness_model_spec", model_specs(metafunc.config), "m="),
    ):
        if len(names) > 1 and argname in metafunc.fixturenames:
            metafunc.parametrize(argname, names, scope="session", ids=[prefix + n for n in names])


@pytest.fixture(scope="session")
def harness_model_spec(request: pytest.FixtureRequest) -> str:
    return model_specs(request.config)[0]


@pytest.fixture(scope="session")
def harness_model_path(harness_model_spec: str):
    # deferred: see the module docstring
    from harness.fixtures.resolve import resolve_model

    return resolve_model(harness_model_spec)


@pytest.fixture(scope="session")
def candidate_name(request: pytest.FixtureRequest) -> str:
    return candidate_names(request.config)[0]


@pytest.fixture(scope="session")
def reference_name(request: pytest.FixtureRequest) -> str:
    return request.config.getoption("reference") or DEFAULT_REFERENCE


@pytest.fixture(scope="session")
def candidate_engine(request: pytest.FixtureRequest, candidate_name: str, harness_model_path):
    # deferred: see the module docstring
    from harness.engines.mutants import PlantedEngine
    from harness.engines.registry import resolve_engine

    engine = resolve_engine(candidate_name, harness_model_path)
    plant = request.config.getoption("harness_plant")
    if plant:
        engine = PlantedEngine(engine, plant)
    return engine


@pytest.fixture(scope="session")
def reference_engine(reference_name: str, harness_model_path):
    # deferred: see the module docstring
    from harness.engines.registry import resolve_engine

    return resolve_engine(reference_name, harness_model_path)


# -- outcomes for harness discharge ----------------------------------------------------------
_OUTCOMES = pytest.StashKey[dict]()
_MESSAGE_CHARS = 4000


def _subject_of(item: pytest.Item) -> dict:
    """Which candidate / model / plant an item ran against (None where it uses none)."""
    config, names = item.config, set(getattr(item, "fixturenames", ()))
    params = getattr(getattr(item, "callspec", None), "params", {})
    uses_candidate = "candidate_name" in names
    uses_model = "harness_model_spec" in names
    return {
        "candidate": params.get("candidate_name", candidate_names(config)[0]) if uses_candidate else None,
        "model": params.get("harness_model_spec", model_specs(config)[0]) if uses_model else None,
        "plant": config.getoption("harness_plant") if uses_candidate else None,
        "reference": (config.getoption("reference") or DEFAULT_REFERENCE) if "reference_name" in names else None,
    }


def pytest_collection_finish(session: pytest.Session) -> None:
    if not session.config.getoption("harness_outcomes"):
        return
    session.config.stash[_OUTCOMES] = {
        "collected": [
            {"nodeid": it.nodeid, "function": it.nodeid.split("[", 1)[0], "markers": sorted({m.name for m in it.iter_markers()})}
            for it in session.items
        ],
        "items": {},
    }


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    outcome = yield
    store = item.config.stash.get(_OUTCOMES, None)
    if store is None:
        return
    report = outcome.get_result()
    rec = store["items"].setdefault(item.nodeid, {
        "nodeid": item.nodeid, "function": item.nodeid.split("[", 1)[0], **_subject_of(item),
        "outcome": "passed", "phase": None, "exception": None, "message": "", "duration_s": 0.0,
    })
    rec["duration_s"] = round(rec["duration_s"] + float(getattr(report, "duration", 0.0)), 6)
    if rec["outcome"] != "passed":
        return  # keep the first thing that went wrong
    if report.skipped:
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        rec.update(outcome="skipped", phase=call.when, message=str(reason)[:_MESSAGE_CHARS])
    elif report.failed:
        exc = call.excinfo
        assertion = call.when == "call" and exc is not None and exc.errisinstance(AssertionError)
        rec.update(
            outcome="failed" if assertion else "error",
            phase=call.when,
            exception=exc.typename if exc is not None else None,
            message=(exc.exconly() if exc is not None else str(report.longrepr))[:_MESSAGE_CHARS],
        )


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    path = session.config.getoption("harness_outcomes")
    store = session.config.stash.get(_OUTCOMES, None)
    if not path or store is None:
        return
    doc = {"exitstatus": int(exitstatus), "finished": time.time(), "collected": store["collected"], "items": list(store["items"].values())}
    Path(path).write_text(json.dumps(doc, indent=1))
