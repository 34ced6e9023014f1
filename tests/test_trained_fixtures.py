"""The committed trained fixtures (issue 4): real-text models as the harness's default real input.

Runs without torch: the GGUFs and their recipes are committed under ``harness/data/fixtures``.
Checked here: each file matches its recipe (sha256, size), lints clean, loads in llama.cpp with
finite, confident logits, and agrees with the float64 oracle; ``trained-qwen35-256`` really has
every matmul input width a multiple of 256, and its quantized ladder is built by llama.cpp with
real K-quants. The slow test re-runs a recipe's training (needs the ``hf`` extra).
"""

from __future__ import annotations

import json
from dataclasses import asdict

import numpy as np
import pytest

from harness.measure.metrics import cosine, kl_divergence, reference_margin
from harness.engines.base import gather
from harness.engines.llamacpp import LlamaCppEngine
from harness.engines.registry import resolve_engine
from harness.fixtures import synthetic as fx
from harness.fixtures.resolve import resolve_model
from harness.fixtures.training import SPECS, TrainSpec
from harness.model.gguf_model import GGUFModel
from harness.model.lint import lint_path
from harness.provenance import sha256_file

TRAINED = ["trained-qwen35", "trained-qwen35moe", "trained-qwen35-256", "trained-qwen35-heldout", "trained-real-heads-qwen35"]
MIN_TOP1_PROB = 0.45  # issue 4: "aim for ≥ 0.45" mean top-1 probability on held-out text
MAX_BYTES = 8 * 2**20  # "a few MB" each
ORACLE_MIN_COSINE = 0.99999
ARGMAX_MARGIN = 1e-3

# A piece of Python source the models never trained on (written for this test).
SOURCE = '''
def moving_average(values, window):
    """Return the simple moving average of values over a sliding window."""
    if window <= 0:
        raise ValueError("window must be positive")
    result = []
    total = 0.0
    for i, value in enumerate(values):
        total += value
        if i >= window:
            total -= values[i - window]
        if i >= window - 1:
            result.append(total / window)
    return result


class Counter:
    def __init__(self, start=0):
        self.count = start

    def increment(self, step=1):
        self.count += step
        return self.count
'''


def recipe(name: str) -> dict:
    return json.loads(fx.trained_fixtures()[name].with_suffix(".recipe.json").read_text())


@pytest.mark.parametrize("name", TRAINED)
def test_recipe_is_the_current_training_spec(name):
    """``harness.fixtures.training.SPECS`` must still produce what is committed (else retrain and
    commit); the committed recipes name rope settings as transformers does, read as llama.cpp's."""
    assert TrainSpec.from_recipe(recipe(name)["spec"]) == SPECS[name]


def test_old_recipe_names_read_as_llamacpp_names():
    old = {**asdict(SPECS["trained-qwen35-256"]), "partial_rotary_factor": 0.25, "mrope_section": [4, 2, 2], "rope_theta": 5e6}
    for k in ("n_rot", "rope_sections", "rope_freq_base"):
        del old[k]
    spec = TrainSpec.from_recipe(old)
    assert (spec.n_rot, spec.rope_sections, spec.rope_freq_base) == (16, (4, 2, 2, 0), 5e6)
    assert TrainSpec.from_recipe(json.loads(json.dumps(asdict(spec)))) == spec  # new recipes round-trip


@pytest.fixture(scope="module")
def source_tokens() -> list[int]:
    toks = LlamaCppEngine(fx.build("tiny-qwen35")).tokenize(SOURCE)
    assert len(toks) >= 64
    return toks


def test_all_trained_fixtures_are_committed_with_recipes():
    committed = fx.trained_fixtures()
    for name in TRAINED:
        assert name in committed, f"{name}.gguf missing from {fx.TRAINED_DIR}"
        assert committed[name].with_suffix(".recipe.json").is_file(), f"{name}.recipe.json missing"


@pytest.mark.parametrize("name", TRAINED)
def test_fixture_matches_its_recipe(name):
    path = fx.build(name)
    r = recipe(name)
    assert r["name"] == name
    assert sha256_file(path) == r["gguf_sha256"], f"{path} differs from its recipe's sha256"
    assert path.stat().st_size == r["gguf_bytes"] <= MAX_BYTES
    for field in ("files_sha256", "python_version", "train_tokens", "heldout_tokens", "source"):
        assert r["corpus"][field], field
    assert r["steps"] > 0 and isinstance(r["seed"], int)
    res = r["results"]
    assert res["final_train_loss"] < 2.0 and res["heldout_loss_nats_per_token"] < 2.5
    assert res["heldout_mean_top1_prob"] >= MIN_TOP1_PROB, f"{name}: model not confident enough"
    m = GGUFModel(path)
    assert m.arch == r["arch"] and m.file_type.removeprefix("ALL_") == r["quant"]


@pytest.mark.parametrize("name", TRAINED)
def test_fixture_lints_clean(name):
    report = lint_path(resolve_model(f"fixture:{name}"))
    assert report.exit_code == 0 and not report.warnings, [f.__dict__ for f in report.findings]


@pytest.mark.parametrize("name", TRAINED)
def test_fixture_gives_finite_confident_logits_in_llamacpp(name, source_tokens):
    eng = LlamaCppEngine(fx.build(name))
    logits = gather(eng.logits(source_tokens), len(source_tokens))
    assert logits.shape == (len(source_tokens), eng.n_vocab) and np.isfinite(logits).all()
    # trained, not random: on unseen Python source the next token is mostly predicted
    hits = (logits[:-1].argmax(1) == np.asarray(source_tokens[1:])).mean()
    assert hits > 0.4, f"{name}: top-1 accuracy {hits:.2f} on unseen source"


@pytest.mark.parametrize("name", ["trained-qwen35", "trained-qwen35moe"])
def test_oracle_matches_llamacpp_on_trained_fixture(name, source_tokens):
    path = fx.build(name)
    a = gather(resolve_engine("llama.cpp", path).logits(source_tokens))
    b = gather(resolve_engine("oracle", path).logits(source_tokens))
    cos = cosine(a, b)
    where = f"{name} sha256={sha256_file(path)[:12]} n={len(source_tokens)}"
    assert cos.min() >= ORACLE_MIN_COSINE, f"{where}: min cosine {cos.min():.8f} at {int(cos.argmin())}"
    decisive = reference_margin(a) > ARGMAX_MARGIN
    differ = np.flatnonzero(decisive & (a.argmax(1) != b.argmax(1)))
    assert differ.size == 0, f"{where}: argmax differs at {differ[:10].tolist()}"
    assert float(np.mean(kl_divergence(a, b))) < 1e-6


def test_256_fixture_has_every_matmul_input_width_a_multiple_of_256():
    m = GGUFModel(fx.build("trained-qwen35-256"))
    h = m.hparams
    assert h.n_embd % 256 == 0 and h.n_ff % 256 == 0
    assert h.ssm_d_inner % 256 == 0 and (h.n_head * h.head_dim) % 256 == 0
    assert any(not r for r in h.recurrent[: h.n_layer]), "needs a full-attention layer"
    for name in m.tensor_names:
        ne = m.tensor_info(name).ne
        if len(ne) >= 2 and not name.endswith("ssm_conv1d.weight"):  # the conv kernel is no matmul
            assert ne[0] % 256 == 0, f"{name}: input width {ne[0]}"


# (llama.cpp tensor type the matmul weights must have, sanity floor on min cosine vs the F16 base).
# Measured at commit time over the test sources and the shipped prompts (1,707 positions): min
# cosine Q8_0 0.9984, Q6_K 0.9943, Q4_K_M 0.9139. The floors only catch a broken ladder;
# per-quant thresholds are measured later from the ledger.
LADDER = {
    "trained-qwen35-256-Q8_0": ("Q8_0", 0.995),
    "trained-qwen35-256-Q6_K": ("Q6_K", 0.98),
    "trained-qwen35-256-Q4_K_M": ("Q4_K", 0.85),
}


@pytest.mark.parametrize("name", sorted(LADDER))
def test_256_quant_ladder_uses_real_quant_types(name, source_tokens):
    qtype, floor = LADDER[name]
    path = fx.build(name)
    m = GGUFModel(path)
    types = {m.tensor_info(n).type for n in m.tensor_names if n.endswith(("ffn_up.weight", "attn_qkv.weight"))}
    assert qtype in types, f"{name}: matmul weights are {sorted(types)}, expected {qtype} (no fallback)"
    base = gather(LlamaCppEngine(fx.build("trained-qwen35-256")).logits(source_tokens))
    quant = gather(LlamaCppEngine(path).logits(source_tokens))
    assert np.isfinite(quant).all()
    assert cosine(base, quant).min() >= floor


@pytest.mark.slow
@pytest.mark.hf
@pytest.mark.parametrize("name", TRAINED)
def test_retraining_reaches_the_recorded_loss(name, tmp_path):
    """Re-run the committed recipe (same spec, seed, steps) and check the held-out loss reaches
    the recorded bound. A different Python has a different stdlib corpus: then the corpus hash
    differs and the recorded loss is not a bound for it, which is reported as a skip."""
    from harness.fixtures.training import stdlib_corpus, train_spec

    r = recipe(name)
    if stdlib_corpus().sha256 != r["corpus"]["files_sha256"]:
        pytest.skip(f"stdlib corpus differs from the recipe's (Python {r['corpus']['python_version']})")
    new = train_spec(TrainSpec.from_recipe(r["spec"]), tmp_path, log=lambda *a: None)
    assert new["steps"] == r["steps"]
    rec, got = r["results"], new["results"]
    assert got["heldout_loss_nats_per_token"] <= rec["heldout_loss_nats_per_token"] + 0.05
    assert got["heldout_mean_top1_prob"] >= MIN_TOP1_PROB
