"""First-divergence localization against the oracle."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from harness import fixtures as fx
from harness.engines.registry import resolve_engine
from harness.errors import Verdict
from harness.gguf_model import GGUFModel
from harness.localize import LocalizeRequest, localize_activations, run_localize


@pytest.fixture(scope="module")
def tiny():
    path = fx.build("tiny-qwen35")
    oracle = resolve_engine("oracle", path)
    toks = list(range(40, 140))
    return GGUFModel(path).hparams, oracle.activations(toks)


def test_llamacpp_localizes_clean_on_f32_and_compares_every_layer():
    loc = run_localize(LocalizeRequest(model="fixture:tiny-qwen35", candidate="llama.cpp"))
    assert loc.verdict is Verdict.PASS and loc.first is None
    assert loc.compared > 150
    layers = {e["layer"]: e for e in loc.per_layer}
    assert set(layers) == set(range(8)) | {-1}
    assert all(e["compared"] >= 15 for k, e in layers.items() if k >= 0)
    assert max(e["max_nmse"] for e in loc.per_layer) < 1e-6


def test_planted_fault_is_localized_to_its_layer_and_tensor(tiny):
    hp, acts = tiny
    cand = {k: v.copy() for k, v in acts.items()}
    cand["gate-5"][30:] *= 1.5  # planted in layer 5's DeltaNet decay from position 30 on
    for k in ("l_out-6", "l_out-7", "result_norm"):  # and, as a real fault would, downstream
        cand[k] = cand[k] * 1.1
    loc = localize_activations(hp, acts, cand, 1e-4, 0.999, "planted")
    assert loc.verdict is Verdict.FAIL
    assert (loc.first.name, loc.first.layer, loc.first.layer_type, loc.first.position) == ("gate-5", 5, "DeltaNet", 30)


def test_nothing_comparable_is_unmeasured(tiny):
    hp, acts = tiny
    loc = localize_activations(hp, acts, {"unrelated": np.zeros(3)}, 1e-4, 0.999)
    assert loc.verdict is Verdict.UNMEASURED and loc.compared == 0


def test_cli_localize_llamacpp_prints_counts():
    r = subprocess.run([sys.executable, "-m", "harness", "localize", "--candidate", "llama.cpp", "--model", "fixture:tiny-qwen35", "--max-tokens", "40"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "tensors compared" in r.stdout and "no tensor over the bounds" in r.stdout
