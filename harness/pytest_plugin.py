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

In any repository (an engine's): the shipped parity and probe cells (``harness.conformance``) are
parametrized here, one test per candidate × model (``harness_parity_cell``,
``harness_probe_cell``), from the project's ``[tool.harness]`` (``candidate``,
``models``/``model``, ``reference``, ``prompts``, ``thresholds``, ``probes``; ``harness.config``)
unless ``--candidate``/``--model``/``--reference`` say otherwise. ``--harness`` (or
``[tool.harness] pytest = true``) collects that module without a test file importing it
(``--no-harness`` turns the setting off; harness discharge passes it); ``--harness-record`` makes
each cell write its receipt and ledger row, to ``--harness-ledger PATH`` or the project's ledger.
Under pytest-xdist (``pytest -m parity -n 4 --harness-record --harness-ledger PATH``) every worker
appends under the ledger's file lock: one row per test, and the chain stays valid.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from harness.config import (
    DEFAULT_CANDIDATE,
    DEFAULT_REFERENCE,
    HarnessConfig,
    load_config,
)
from harness.errors import InvalidInput


def pytest_addoption(parser: pytest.Parser) -> None:
    g = parser.getgroup("harness", "Qwen3.5 verification harness")
    g.addoption("--candidate", default=None, help=f"candidate engine name (default {DEFAULT_CANDIDATE})")
    g.addoption("--reference", default=None, help=f"reference engine name (default {DEFAULT_REFERENCE})")
    g.addoption("--model", dest="harness_model", default=None, help="model path or fixture:NAME (comma-separated: one run per model)")
    g.addoption("--plant", dest="harness_plant", default=None, help="wrap the candidate in a planted output fault (harness mutants list)")
    g.addoption("--harness-outcomes", dest="harness_outcomes", default=None, metavar="PATH",
                help="write collected items and per-item outcomes as JSON to PATH (used by harness discharge)")
    g.addoption("--harness", dest="harness_cells", action="store_true", default=None,
                help="collect the shipped parity and probe cells (harness.conformance); as [tool.harness] pytest = true")
    g.addoption("--no-harness", dest="harness_cells", action="store_false",
                help="do not collect the shipped cells even if [tool.harness] pytest = true")
    g.addoption("--harness-record", dest="harness_record", action="store_true", default=False,
                help="parity and probe cells write their receipts and ledger rows")
    g.addoption("--harness-ledger", dest="harness_ledger", default=None, metavar="PATH",
                help="the ledger cells record to (default: [tool.harness] ledger, else <evidence>/parity/ledger.jsonl)")


_PROJECT = pytest.StashKey[HarnessConfig]()
_SHIPPED = pytest.StashKey[bool]()
SHIPPED_MODULE = Path(__file__).resolve().parent / "conformance.py"
SHIPPED_NODEID = "harness/conformance.py"
"""The node id the shipped module's cells get when the plugin collects it (``--harness``)."""


def project_config(config: pytest.Config) -> HarnessConfig:
    """The ``[tool.harness]`` of the project pytest runs in (found from its rootdir; read once)."""
    if _PROJECT not in config.stash:
        try:
            config.stash[_PROJECT] = load_config(Path(config.rootpath))
        except InvalidInput as e:
            raise pytest.UsageError(f"harness: INVALID: {e}") from None
    return config.stash[_PROJECT]


def pytest_configure(config: pytest.Config) -> None:
    for line in (
        "parity: end-to-end parity of a candidate against the reference (pytest -m parity)",
        "contract: a test bound to a contract obligation",
        "slow: long-running; kept out of the default run (make test-slow runs them)",
    ):
        config.addinivalue_line("markers", line)
    enabled = config.getoption("harness_cells")
    if enabled is None:
        try:
            enabled = project_config(config).flag("pytest")
        except InvalidInput as e:
            raise pytest.UsageError(f"harness: INVALID: {e}") from None
    config.stash[_SHIPPED] = bool(enabled)


def _names(value: str | None) -> list[str]:
    return [v.strip() for v in (value or "").split(",") if v.strip()]


def candidate_names(config: pytest.Config) -> list[str]:
    """The candidates named by ``--candidate``, else ``[tool.harness] candidate`` (a name or a
    list), else ``[DEFAULT_CANDIDATE]``."""
    return _names(config.getoption("candidate")) or project_config(config).names("candidate") or [DEFAULT_CANDIDATE]


def model_specs(config: pytest.Config) -> list[str]:
    """The models named by ``--model``, else ``[tool.harness] models`` / ``model``, else
    ``[default_model()]``."""
    # deferred: see the module docstring
    from harness.fixtures.resolve import default_model

    return _names(config.getoption("harness_model")) or project_config(config).model_specs() or [default_model()]


@dataclass(frozen=True)
class Cell:
    """One parity or probe cell: a candidate engine on a model (``fixture:NAME`` or a path)."""

    candidate: str
    model: str

    def __str__(self) -> str:
        return f"{self.candidate}@{self.model}"


@dataclass(frozen=True)
class CellSettings:
    """What every cell of a session shares: the reference (``reference_given``: named by the user
    rather than the default), prompt and thresholds files (None: the shipped ones), the probes to
    run (empty: all), whether to record evidence and to which ledger."""

    reference: str
    reference_given: bool
    prompts: Path | None
    thresholds: Path | None
    probes: tuple[str, ...]
    record: bool
    ledger: Path


def cell_settings(config: pytest.Config) -> CellSettings:
    """The ``CellSettings`` of this session (options over ``[tool.harness]``; the probe cell checks
    the probe names). Raises ``InvalidInput`` for a malformed config value."""
    cfg = project_config(config)
    reference = config.getoption("reference") or cfg.get("reference")
    probes = tuple(cfg.names("probes"))
    ledger = config.getoption("harness_ledger")
    return CellSettings(reference or DEFAULT_REFERENCE, bool(reference), cfg.path("prompts"), cfg.path("thresholds"), probes,
                        bool(config.getoption("harness_record")), Path(ledger).resolve() if ledger else cfg.ledger)


def cells(config: pytest.Config) -> list[Cell]:
    """Every candidate × model of this session."""
    return [Cell(c, m) for c in candidate_names(config) for m in model_specs(config)]


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """With several candidates or models, run each test that uses them once per entry; the
    shipped cells (``harness_parity_cell``, ``harness_probe_cell``) run once per candidate × model."""
    for argname, names, prefix in (
        ("candidate_name", candidate_names(metafunc.config), "c="),
        ("harness_model_spec", model_specs(metafunc.config), "m="),
    ):
        if len(names) > 1 and argname in metafunc.fixturenames:
            metafunc.parametrize(argname, names, scope="session", ids=[prefix + n for n in names])
    for argname in ("harness_parity_cell", "harness_probe_cell"):
        if argname in metafunc.fixturenames:
            todo = cells(metafunc.config)
            metafunc.parametrize(argname, todo, ids=[str(c) for c in todo])


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    """With ``--harness`` (or ``[tool.harness] pytest = true``) the shipped module's cells join the
    session as ``harness/conformance.py::...`` (before ``-m``/``-k`` select among them); a cell a
    repository's own test module already imported (``from harness.conformance import *``) runs
    once, under the repository's name."""
    if not config.stash.get(_SHIPPED, False):
        return
    module = pytest.Module.from_parent(session, path=SHIPPED_MODULE, nodeid=SHIPPED_NODEID)
    key = lambda it: (getattr(it, "function", None), getattr(getattr(it, "callspec", None), "id", None))  # noqa: E731
    have = {key(it) for it in items}
    shipped = list(session.genitems(module))
    items.extend(it for it in shipped if key(it) not in have)
    twice = [it for it in shipped if key(it) in have]
    if twice:
        config.hook.pytest_deselected(items=twice)


@pytest.fixture(scope="session")
def harness_settings(request: pytest.FixtureRequest) -> CellSettings:
    """The session's ``CellSettings`` (see ``cell_settings``)."""
    return cell_settings(request.config)


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
