"""The trained MTP (nextn) heads (issue 27): committed MTP-only GGUFs, each joined with its trunk on demand.

Runs without torch. Checked here: each head matches its recipe (sha256, size ≤ 10 MiB, the trunk
it was trained on), lints as the legal MTP-only shape, joins its trunk deterministically into a
trunk + MTP file whose trunk tensors are the trunk's own, and in llama.cpp's MTP context (loaded
with ``load_mtp``) drafts the token after next on unseen Python source with an acceptance near the
recorded held-out one, far above what an untrained head gets. The slow test re-runs a recipe
(``pytest -m slow tests/test_trained_mtp.py``, needs the ``hf`` extra, a few minutes each).
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import asdict

import numpy as np
import pytest

from harness.errors import InvalidInput
from harness.fixtures import synthetic as fx
from harness.fixtures.mtp_training import SPECS
from harness.model.gguf_model import GGUFModel
from harness.model.lint import lint_path
from harness.provenance import sha256_file
from helpers import MAX_TRACKED_BYTES

HEADS = {"trained-qwen35-mtp": "trained-qwen35-mtp-head", "trained-qwen35moe-mtp": "trained-qwen35moe-mtp-head"}
MIN_ACCEPTANCE = 0.30  # a trained head; the untrained start (eh_proj = [I/2 | I/2], B = the trunk's last attention layer) drafts 0.13

# Unseen Python source (written for this test), as tests/test_trained_fixtures.py uses.
SOURCE = '''
def parse_pairs(text, sep="="):
    """Split lines of key=value pairs into a dictionary, skipping comments and blank lines."""
    result = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        key, _, value = line.partition(sep)
        result[key.strip()] = value.strip()
    return result


class Stack:
    def __init__(self):
        self.items = []

    def push(self, item):
        self.items.append(item)

    def pop(self):
        if not self.items:
            raise IndexError("pop from empty stack")
        return self.items.pop()
'''

# llama.cpp's MTP context, vLLM convention (row t = (h_t, x_{t+1}) at position t, no sentinel row):
# the trunk context with nextn embeddings on gives h [T, n_embd]; a second context of the MTP type
# (ctx_other = the trunk's) decodes the rows and returns draft logits [T-1, V]. argv: gguf, ids.
_DRAFT = r"""
import ctypes, sys, numpy as np, llama_cpp
from llama_cpp import llama_cpp_ext as ext
toks = [int(t) for t in sys.argv[2].split(",")]
T = len(toks)
llama_cpp.llama_backend_init()
mp = llama_cpp.llama_model_default_params(); mp.load_mtp = True
model = llama_cpp.llama_model_load_from_file(sys.argv[1].encode(), mp)
assert model and llama_cpp.llama_model_n_layer_nextn(model) == 1
d = llama_cpp.llama_model_n_embd(model)
V = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(model))
def params(mtp_of=None):
    p = llama_cpp.llama_context_default_params()
    p.n_ctx = p.n_batch = p.n_ubatch = 512; p.n_threads = p.n_threads_batch = 2
    if mtp_of is not None:
        p.ctx_type = llama_cpp.LLAMA_CONTEXT_TYPE_MTP; p.ctx_other = mtp_of
    return p
ctx = llama_cpp.llama_init_from_model(model, params())
ext.llama_set_embeddings_nextn(ctx, True, False)
b = llama_cpp.llama_batch_init(T, 0, 1); b.n_tokens = T
for i, t in enumerate(toks):
    b.token[i] = t; b.pos[i] = i; b.n_seq_id[i] = 1; b.seq_id[i][0] = 0; b.logits[i] = 1
assert llama_cpp.llama_decode(ctx, b) == 0
h = np.ctypeslib.as_array(ext.llama_get_embeddings_nextn(ctx), shape=(T, d)).copy()
mtp = llama_cpp.llama_init_from_model(model, params(ctx))
n = T - 1
b2 = llama_cpp.llama_batch_init(n, d, 1)
ids = (llama_cpp.llama_token * n)(*toks[1:])
b2.token = ctypes.cast(ids, ctypes.POINTER(llama_cpp.llama_token)); b2.n_tokens = n
for i in range(n):
    b2.pos[i] = i; b2.n_seq_id[i] = 1; b2.seq_id[i][0] = 0; b2.logits[i] = 1
ctypes.memmove(b2.embd, h[:n].astype(np.float32).ctypes.data, n * d * 4)
assert llama_cpp.llama_decode(mtp, b2) == 0
draft = np.ctypeslib.as_array(llama_cpp.llama_get_logits(mtp), shape=(n, V))
assert np.isfinite(draft).all()
print("ACCEPT", float((draft[:-1].argmax(1) == np.asarray(toks[2:])).mean()))
"""


def recipe(head: str) -> dict:
    return json.loads(fx.mtp_heads()[head].with_suffix(".recipe.json").read_text())


@pytest.fixture(scope="module")
def source_tokens() -> list[int]:
    from harness.engines.llamacpp import LlamaCppEngine

    toks = LlamaCppEngine(fx.build("tiny-qwen35")).tokenize(SOURCE)
    assert len(toks) >= 64
    return toks


@pytest.mark.parametrize("head", sorted(HEADS.values()))
def test_head_matches_its_recipe(head):
    path = fx.build(head)
    r = recipe(head)
    assert r["name"] == head and r["spec"] == json.loads(json.dumps(asdict(SPECS[head])))  # the recipe is the current spec
    assert sha256_file(path) == r["gguf_sha256"] and path.stat().st_size == r["gguf_bytes"] <= MAX_TRACKED_BYTES
    assert r["trunk"]["sha256"] == sha256_file(fx.build(r["trunk"]["name"])), "the head was trained on another trunk"
    res = r["results"]
    assert res["heldout_implied_acceptance"] >= MIN_ACCEPTANCE and res["heldout_rows"] > 10_000
    assert 0 < res["heldout_trunk_top1_accuracy"] < 1


@pytest.mark.parametrize("head", sorted(HEADS.values()))
def test_head_is_the_legal_mtp_only_shape(head):
    report = lint_path(str(fx.build(head)), [])
    assert [(f.code, f.severity) for f in report.findings] == [("QL202", "info")] and report.exit_code == 0
    line = next(s for s in report.info if s.startswith("file shape:"))
    assert line.startswith("file shape: MTP only") and line.endswith("head norm = blk.8.nextn.shared_head_norm.weight")
    m = GGUFModel(fx.build(head))
    assert {n for n in m.tensor_names if not n.startswith("blk.8.")} == {"token_embd.weight", "output_norm.weight", "output.weight"}


@pytest.mark.parametrize("name", sorted(HEADS))
def test_trunk_plus_head_is_deterministic_and_keeps_the_trunk(name, tmp_path):
    trunk_name, head_name = fx.TRAINED_MTP[name]
    trunk, head = fx.build(trunk_name), fx.build(head_name)
    a = fx.join_trunk_and_head(trunk, head, tmp_path / "a.gguf", name)
    assert sha256_file(a) == sha256_file(fx.build(name))  # the cached fixture is these bytes
    m, t, h = GGUFModel(a), GGUFModel(trunk), GGUFModel(head)
    assert set(m.tensor_names) == set(t.tensor_names) | set(h.tensor_names)
    for n in t.tensor_names:
        np.testing.assert_array_equal(m.tensor(n), t.tensor(n), err_msg=n)
    for n in h.tensor_names:
        np.testing.assert_array_equal(m.tensor(n), h.tensor(n), err_msg=n)
    assert m.hparams.n_layer == t.hparams.n_layer and m.hparams.n_layer_nextn == 1
    report = lint_path(str(a), [])
    assert report.findings == [], report.render()
    assert next(s for s in report.info if s.startswith("file shape:")).startswith("file shape: trunk + MTP")


def test_join_refuses_a_head_of_another_trunk(tmp_path):
    with pytest.raises(InvalidInput, match="trained-qwen35moe.gguf"):
        fx.join_trunk_and_head(fx.build("trained-qwen35moe"), fx.build("trained-qwen35-mtp-head"), tmp_path / "x.gguf", "x")


@pytest.mark.parametrize("name", sorted(HEADS))
def test_trained_head_drafts_in_llamacpp(name, source_tokens):
    """llama.cpp's own MTP context on the trunk + MTP fixture: draft argmax == x_{t+2} on unseen
    source at least MIN_ACCEPTANCE (held-out acceptance in the recipe, measured by our torch head)."""
    proc = subprocess.run([sys.executable, "-c", _DRAFT, str(fx.build(name)), ",".join(map(str, source_tokens))],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    got = float(proc.stdout.split("ACCEPT")[-1])
    assert got >= MIN_ACCEPTANCE, f"{name}: llama.cpp implied acceptance {got:.3f} on unseen source"


@pytest.mark.slow
@pytest.mark.hf
@pytest.mark.parametrize("head", sorted(HEADS.values()))
def test_retraining_reaches_the_recorded_acceptance(head, tmp_path):
    """Re-run the committed recipe; a different Python has a different stdlib corpus, reported as a skip."""
    from harness.fixtures.mtp_training import train
    from harness.fixtures.training import stdlib_corpus

    r = recipe(head)
    if stdlib_corpus().sha256 != r["corpus"]["files_sha256"]:
        pytest.skip("stdlib corpus differs from the recipe's")
    new = train(head, out_dir=tmp_path, log=lambda *a: None)
    assert new["results"]["heldout_implied_acceptance"] >= r["results"]["heldout_implied_acceptance"] - 0.02


def test_a_trunk_plus_mtp_fixture_without_its_committed_head_is_one_invalid_line():
    if "trained-qwen35moe-mtp-head" in fx.mtp_heads():  # once committed, HEADS above must list it
        assert "trained-qwen35moe-mtp" in HEADS
        return
    assert "trained-qwen35moe-mtp" not in fx.fixture_names()
    with pytest.raises(InvalidInput, match="needs the committed 'trained-qwen35moe' and 'trained-qwen35moe-mtp-head'; missing: trained-qwen35moe-mtp-head"):
        fx.build("trained-qwen35moe-mtp")
