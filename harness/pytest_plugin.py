"""pytest plugin (entry point ``pytest11``): options, markers and engine fixtures.

Options: ``--candidate NAME`` (default ``oracle``), ``--reference NAME`` (default
``llama.cpp``), ``--model SPEC`` (path or ``fixture:NAME``; default: the default model).
Markers: ``parity`` (end-to-end parity tests, ``pytest -m parity``), ``contract`` (tests bound
to contract obligations), ``slow`` (kept out of the default run), ``hf`` (need the
transformers extra). Fixtures: ``harness_model_path``, ``candidate_engine``,
``reference_engine``: bound tests receive their subject only through these.
"""

from __future__ import annotations

import pytest

DEFAULT_CANDIDATE = "oracle"
DEFAULT_REFERENCE = "llama.cpp"


def default_model() -> str:
    """The model used where none is named: the committed trained dense model when present,
    else ``fixture:tiny-qwen35``."""
    from harness.fixtures import trained_fixtures

    return "fixture:trained-qwen35" if "trained-qwen35" in trained_fixtures() else "fixture:tiny-qwen35"


def pytest_addoption(parser: pytest.Parser) -> None:
    g = parser.getgroup("harness", "Qwen3.5 verification harness")
    g.addoption("--candidate", default=None, help=f"candidate engine name (default {DEFAULT_CANDIDATE})")
    g.addoption("--reference", default=None, help=f"reference engine name (default {DEFAULT_REFERENCE})")
    g.addoption("--model", dest="harness_model", default=None, help="model path or fixture:NAME")


def pytest_configure(config: pytest.Config) -> None:
    for line in (
        "parity: end-to-end parity of a candidate against the reference (pytest -m parity)",
        "contract: a test bound to a contract obligation",
        "slow: long-running; kept out of the default run (make test-slow runs them)",
        "hf: needs the transformers extra (pip install -e .[hf]); run with pytest -m hf",
    ):
        config.addinivalue_line("markers", line)


@pytest.fixture(scope="session")
def harness_model_spec(request: pytest.FixtureRequest) -> str:
    return request.config.getoption("harness_model") or default_model()


@pytest.fixture(scope="session")
def harness_model_path(harness_model_spec: str):
    from harness.fixtures import resolve_model

    return resolve_model(harness_model_spec)


@pytest.fixture(scope="session")
def candidate_name(request: pytest.FixtureRequest) -> str:
    return request.config.getoption("candidate") or DEFAULT_CANDIDATE


@pytest.fixture(scope="session")
def reference_name(request: pytest.FixtureRequest) -> str:
    return request.config.getoption("reference") or DEFAULT_REFERENCE


@pytest.fixture(scope="session")
def candidate_engine(candidate_name: str, harness_model_path):
    from harness.engines.registry import resolve_engine

    return resolve_engine(candidate_name, harness_model_path)


@pytest.fixture(scope="session")
def reference_engine(reference_name: str, harness_model_path):
    from harness.engines.registry import resolve_engine

    return resolve_engine(reference_name, harness_model_path)
