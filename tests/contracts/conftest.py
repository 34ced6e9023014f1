"""Helpers for the tests that contracts bind to (tests/contracts/test_*.py).

Every bound test gets its subject only from the harness plugin's fixtures: the candidate engine
(``candidate_engine``, chosen by ``--candidate``, possibly wrapped by ``--plant``), the model file
(``harness_model_path``, chosen by ``--model``) and, for end-to-end tests, the reference engine.
The fixtures here only derive from those: the model's hyperparameters and weights read from the
file, the candidate's named activations on a fixed probe prompt (cached per session), and each
obligation's tolerance read from its contract, so a test never uses a number its contract does
not state.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import pytest
from contract_helpers import LONG, PROBE_SEED

from harness.model.gguf_model import GGUFModel


@pytest.fixture(scope="session")
def subject_model(harness_model_path) -> GGUFModel:
    """The model file under test, opened with the harness's reader."""
    return GGUFModel(harness_model_path)


@pytest.fixture(scope="session")
def hp(subject_model):
    """The subject model's hyperparameters (``Qwen35HParams``)."""
    return subject_model.hparams


@pytest.fixture(scope="session")
def weight(subject_model) -> Callable[[str], np.ndarray]:
    """``weight(name)``: a tensor of the model file as float64, NumPy order (cached)."""
    cache: dict[str, np.ndarray] = {}

    def get(name: str) -> np.ndarray:
        if name not in cache:
            cache[name] = subject_model.tensor(name)
        return cache[name]

    return get


@pytest.fixture(scope="session")
def probe_tokens(subject_model) -> list[int]:
    """LONG deterministic token ids in the model's vocabulary (seeded; same for every subject)."""
    n_vocab = int(subject_model.tensor_info("token_embd.weight").ne[1])
    return np.random.default_rng(PROBE_SEED).integers(0, n_vocab, LONG).tolist()


@pytest.fixture(scope="session")
def subject_acts(candidate_engine, probe_tokens) -> Callable[..., dict[str, np.ndarray]]:
    """``subject_acts(n, chunks=None)``: the candidate's named activations (float64, llama.cpp
    names) for the first ``n`` probe tokens, optionally fed as ``chunks``; cached per session.
    Skips when the candidate does not expose activations (the obligation is then unmeasured)."""
    cache: dict[tuple, dict[str, np.ndarray]] = {}

    def get(n: int, chunks: Sequence[int] | None = None) -> dict[str, np.ndarray]:
        key = (n, tuple(chunks) if chunks else None)
        if key not in cache:
            if "activations" not in candidate_engine.info.capabilities:
                pytest.skip(f"{candidate_engine.info.name} does not expose activations; this obligation is checked on a candidate that does: pytest tests/contracts --candidate oracle (or llama.cpp, transformers)")
            acts = candidate_engine.activations(probe_tokens[:n], list(chunks) if chunks else None)
            cache[key] = {k: np.asarray(v, dtype=np.float64) for k, v in acts.items()}
        return cache[key]

    return get


@pytest.fixture(scope="session")
def tolerance(request) -> Callable[[str], dict[str, Any]]:
    """``tolerance(obligation_id)``: the obligation's tolerance from contracts/*.yaml."""
    from harness.contracts.loader import load_contracts

    root = Path(request.config.rootpath)
    table = {ob.id: ob.tolerance for c in load_contracts([root / "contracts"], check_tests=False) for ob in c.obligations}

    def get(oid: str) -> dict[str, Any]:
        tol = table.get(oid)
        assert tol, f"contract obligation {oid} has no tolerance in {root / 'contracts'}"
        return tol

    return get


@pytest.fixture(scope="session")
def where(candidate_engine, subject_model) -> str:
    """A reproducer line for failure messages: candidate, model and sha256
    (``harness.judge.reproducer``, the formatter of every failure message)."""
    from harness.judge.reproducer import Reproducer

    return Reproducer(candidate_engine.info.name, Path(subject_model.path).name, subject_model.sha256).where()
