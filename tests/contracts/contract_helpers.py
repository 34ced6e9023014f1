"""Plain helpers of the bound tests (comparisons with messages that name the failing case)."""

from __future__ import annotations

import numpy as np

PROBE_SEED = 20261129
SHORT = 12  # < 64: the oracle's token-by-token delta rule
LONG = 72  # >= 64: the chunk-parallel delta rule (one full chunk and a partial one)
PIECES = (5, 9, 27, 31)  # LONG fed as consecutive calls, each under one chunk
MTP_RUN = ("pytest tests/contracts/test_mtp.py tests/contracts/test_speculative.py --candidate oracle --model fixture:tiny-qwen35-mtp "
           "(or: harness discharge contracts/qwen35-mtp-v1.yaml)")
# the command that runs the MTP and speculative obligations: the oracle declares 'mtp' and 'speculative' only on a model with a nextn block


def rel_err(got: np.ndarray, want: np.ndarray) -> float:
    """max |got − want| / max |want| (inf on a shape mismatch or non-finite values)."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    if got.shape != want.shape or not (np.isfinite(got).all() and np.isfinite(want).all()):
        return float("inf")
    scale = float(np.max(np.abs(want))) if want.size else 0.0
    return float(np.max(np.abs(got - want))) / max(scale, 1e-300) if got.size else 0.0


def worst_position(got: np.ndarray, want: np.ndarray) -> int:
    """The position (first axis) with the largest |got − want|."""
    d = np.abs(np.asarray(got, np.float64) - np.asarray(want, np.float64)).reshape(np.shape(got)[0], -1)
    return int(np.argmax(d.max(axis=1)))


def assert_close(what: str, got: np.ndarray, want: np.ndarray, rel: float, where: str, cause: str) -> None:
    """Assert ``rel_err(got, want) <= rel``; the message names the tensor, the worst position,
    the subject and the likely cause."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape, f"{what}: shape {got.shape}, expected {want.shape} ({where}); likely cause: {cause}"
    err = rel_err(got, want)
    assert err <= rel, (
        f"{what}: max relative error {err:.3g} > {rel:g} at position {worst_position(got, want)} ({where}); likely cause: {cause}"
    )


def ran_layers(acts: dict[str, np.ndarray], hp, op: str, recurrent: bool) -> list[int]:
    """Trunk layers in which the candidate ran the mixer whose output activation is ``op``
    (``linear_attn_out`` for Gated DeltaNet, ``attn_gated`` for full attention). Which layers
    should run which mixer is QHF-INV-001's business; the per-op obligations check the op where it
    ran, and fail by assertion when the file schedules such layers but the candidate ran none."""
    layers = [il for il in range(hp.n_layer) if f"{op}-{il}" in acts]
    kind = "Gated DeltaNet" if recurrent else "full attention"
    scheduled = [il for il in range(hp.n_layer) if hp.is_recurrent(il) == recurrent]
    assert layers or not scheduled, f"the candidate ran no {kind} layer ({op}-N missing) although the file schedules layers {scheduled}"
    return layers


def recurrent_layers(acts: dict[str, np.ndarray], hp) -> list[int]:
    """Layers in which the candidate ran Gated DeltaNet (see ``ran_layers``)."""
    return ran_layers(acts, hp, "linear_attn_out", True)


def attention_layers(acts: dict[str, np.ndarray], hp) -> list[int]:
    """Layers in which the candidate ran full attention (see ``ran_layers``)."""
    return ran_layers(acts, hp, "attn_gated", False)


def need(acts: dict[str, np.ndarray], *names: str) -> list[np.ndarray]:
    """The named activations; a missing one fails the test by assertion naming it."""
    missing = [n for n in names if n not in acts]
    assert not missing, f"the candidate does not expose {missing} (llama.cpp graph names, see docs/engine-protocol.md)"
    return [acts[n] for n in names]
