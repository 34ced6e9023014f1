"""The reference engine: llama.cpp via llama-cpp-python, in a worker process."""

from __future__ import annotations

import numpy as np
import pytest

from harness.measure.metrics import cosine
from harness.measure.prompts import load_prompts
from harness.engines.base import gather
from harness.engines.llamacpp import LlamaCppEngine, LlamaCppSettings
from harness.errors import EngineError
from harness.fixtures import synthetic as fx
from helpers import unscaled_twin
from harness.model.gguf_model import GGUFModel, parse_overrides

TOKENS = list(range(30, 130))
GOOD = ["tiny-qwen35", "tiny-qwen35moe", "small-qwen35", "tiny-qwen35-mtp", "tiny-qwen35moe-mtp", "tiny-qwen35-mtp-own-head", "small-qwen35-F16", "small-qwen35-Q8_0", "small-qwen35-Q4_K_M", "state-qwen35",
        *fx.REAL_HEAD_FIXTURES, *fx.LONG_CONTEXT_FIXTURES]
NOT_LOADED_HERE = {
    "mtp-declared-absent": "defective on purpose: llama.cpp must refuse it (test below)",
    "tiny-qwen35-v248k": "a 248,320-row vocab: 100 MB of logits per run; its GGUF is read back in test_fixtures",
    "tiny-qwen35-realvocab": "the real 248,320-row vocab: loaded by llama.cpp and judged by parity in test_real_tokenizer",
    "tiny-qwen35moe-realvocab": "the real 248,320-row vocab: loaded by llama.cpp and judged by parity in test_real_tokenizer",
}


def test_every_synthetic_fixture_is_loaded_or_excused():
    """The fixtures are built from lint's tables; llama.cpp loading them is the independent check,
    so no spec may escape it unnoticed."""
    assert set(GOOD) | set(NOT_LOADED_HERE) == set(fx.SPECS)


@pytest.mark.parametrize("name", GOOD)
def test_every_good_fixture_loads_and_gives_finite_logits(name):
    path = fx.build(name)
    eng = LlamaCppEngine(path)
    logits = gather(eng.logits(TOKENS), len(TOKENS))
    n_vocab = GGUFModel(path).hparams.n_vocab
    assert logits.shape == (len(TOKENS), n_vocab) == (100, eng.n_vocab)
    assert np.isfinite(logits).all()
    assert logits.std() > 0.1  # not a constant: the model computed something


def test_mtp_declared_absent_is_refused_quoting_llama_cpp():
    with pytest.raises(EngineError, match=r"blk\.8\.attn_norm\.weight"):
        gather(LlamaCppEngine(fx.build("mtp-declared-absent")).logits(TOKENS))


def test_mtp_declared_absent_with_remedy_equals_trunk_twin_bit_for_bit(tmp_path):
    remedy = parse_overrides(["qwen35.block_count=int:8", "qwen35.nextn_predict_layers=int:0"])
    fixed = gather(LlamaCppEngine(fx.build("mtp-declared-absent"), remedy).logits(TOKENS))
    twin = gather(LlamaCppEngine(unscaled_twin("tiny-qwen35", tmp_path)).logits(TOKENS))
    assert fixed.dtype == twin.dtype == np.float32
    np.testing.assert_array_equal(fixed, twin)


@pytest.fixture(scope="module")
def long_prompt_tokens():
    eng = LlamaCppEngine(fx.build("tiny-qwen35"))
    toks = eng.tokenize(load_prompts(None)[0].text)
    assert len(toks) >= 512
    return toks


@pytest.mark.parametrize("split", [1, 3, 64, 65, 300])
def test_whole_equals_two_chunks(long_prompt_tokens, split):
    eng = LlamaCppEngine(fx.build("tiny-qwen35"))
    toks = long_prompt_tokens
    whole = gather(eng.logits(toks), len(toks))
    parts = gather(eng.logits(toks, chunks=[split, len(toks) - split]), len(toks))
    cos = cosine(whole, parts)
    assert cos.min() >= 0.99999, (split, int(cos.argmin()), float(cos.min()))


def test_identical_across_two_runs(long_prompt_tokens):
    eng = LlamaCppEngine(fx.build("tiny-qwen35"))
    a = gather(eng.logits(long_prompt_tokens))
    b = gather(eng.logits(long_prompt_tokens))
    np.testing.assert_array_equal(a, b)


def test_blocks_stream_in_order_and_bounded():
    eng = LlamaCppEngine(fx.build("tiny-qwen35"), block_size=32)
    blocks = list(eng.logits(TOKENS))
    assert [s for s, _ in blocks] == [0, 32, 64, 96]
    assert max(b.shape[0] for _, b in blocks) == 32


def test_multi_sequence_rows_match_solo_runs():
    eng = LlamaCppEngine(fx.build("tiny-qwen35"))
    a, b = TOKENS[:40], TOKENS[50:90]
    both = gather(eng.logits_multi([a, b]), 80)
    solo_a = gather(eng.logits(a))
    solo_b = gather(eng.logits(b))
    assert cosine(both[:40], solo_a).min() > 0.9999
    assert cosine(both[40:], solo_b).min() > 0.9999


def test_info_records_numerics_settings():
    eng = LlamaCppEngine(fx.build("tiny-qwen35"), settings=LlamaCppSettings(n_ubatch=7))
    info = eng.info.to_dict()
    assert info["name"] == "llama.cpp"
    assert "0.3.36" in info["version"]
    for key in ("n_ctx", "n_batch", "n_ubatch", "n_threads", "type_k", "type_v", "flash_attn", "use_extra_bufts", "overrides"):
        assert key in info["settings"]
    assert info["settings"]["n_ubatch"] == 7 and info["settings"]["use_extra_bufts"] is False
    assert info["build"]["cpu_features"].startswith("CPU : ")


def test_ubatch_size_changes_little(long_prompt_tokens):
    toks = long_prompt_tokens[:200]
    a = gather(LlamaCppEngine(fx.build("tiny-qwen35")).logits(toks))
    b = gather(LlamaCppEngine(fx.build("tiny-qwen35"), settings=LlamaCppSettings(n_ubatch=7)).logits(toks))
    assert cosine(a, b).min() >= 0.99999


def test_ggml_abort_becomes_engine_error(tmp_path):
    """A wrongly typed SSM tensor loads, then ggml aborts in the first forward: the harness
    reports ENGINE-ERROR with the signal, and keeps running."""

    def ssm_conv_f16(meta, tensors):
        tensors["blk.0.ssm_conv1d.weight"] = tensors["blk.0.ssm_conv1d.weight"].astype(np.float16)

    path = fx.build_fixture(fx.SPECS["tiny-qwen35"], tmp_path / "abort.gguf", ssm_conv_f16)
    with pytest.raises(EngineError, match="SIGABRT") as ei:
        gather(LlamaCppEngine(path).logits(TOKENS[:8]))
    assert ei.value.exit_code == 3
    assert "GGML_ASSERT" in str(ei.value) or "GGML_ASSERT" in ei.value.stderr_tail
    # the harness process is alive and the next model runs
    assert np.isfinite(gather(LlamaCppEngine(fx.build("tiny-qwen35")).logits(TOKENS[:8]))).all()


def test_tokenizer_round_trips_text():
    eng = LlamaCppEngine(fx.build("tiny-qwen35"))
    text = "Grüße aus Köln! the cat sat on the mat."
    toks = eng.tokenize(text)
    vocab = GGUFModel(fx.build("tiny-qwen35")).tokens
    b2u = fx.bytes_to_unicode()
    u2b = {v: k for k, v in b2u.items()}
    decoded = bytes(u2b[c] for t in toks for c in vocab[t]).decode("utf-8")
    assert decoded == text
    assert len(toks) < len(text.encode())  # merges applied



def test_the_reference_tokenizes_and_describes_itself_in_one_worker_run(monkeypatch):
    """A reference's tokenize run also loads the model for its ``info`` (one process start and
    one load, not two); the description is the one a separate info run gives, and a
    tokenizer-only engine still loads the vocabulary alone."""
    path = fx.build("tiny-qwen35")
    runs: list[dict] = []
    real = LlamaCppEngine._run

    def counting(self, request, workdir):
        runs.append(request)
        return real(self, request, workdir)

    monkeypatch.setattr(LlamaCppEngine, "_run", counting)
    ref = LlamaCppEngine(path)
    texts = ["the cat sat", "on the mat"]
    toks = ref.tokenize_many(texts)
    info, n_vocab = ref.info.to_dict(), ref.n_vocab
    assert [r["op"] for r in runs] == ["tokenize"] and runs[0]["with_info"] is True

    alone = LlamaCppEngine(path)
    assert alone.info.to_dict() == info and alone.n_vocab == n_vocab == GGUFModel(path).hparams.n_vocab
    assert [r["op"] for r in runs[1:]] == ["info"]
    assert LlamaCppEngine(path, tokenizer_only=True).tokenize_many(texts) == toks
    assert runs[-1] == {"op": "tokenize", "texts": texts, "with_info": False, "add_special": False, "parse_special": False}
    assert ref.tokenize_many(texts) == toks and runs[-1]["with_info"] is False  # described already: vocabulary only

def test_llamacpp_activations_match_the_oracle_by_name():
    """llama.cpp's own intermediate tensors (cb_eval) join across ubatches and agree with the
    oracle's activations of the same name."""
    from harness.engines.registry import resolve_engine

    path = fx.build("tiny-qwen35")
    toks = TOKENS[:70]
    ll = LlamaCppEngine(path, settings=LlamaCppSettings(n_ubatch=32))  # 3 ubatches
    a = ll.activations(toks)
    b = resolve_engine("oracle", path).activations(toks)
    for name in ("l_out-0", "l_out-7", "attn_output-3", "linear_attn_out-0", "conv_output_silu-1", "z-2", "result_norm"):
        x, y = a[name].reshape(70, -1), b[name].reshape(70, -1)
        assert x.shape == y.shape, name
        assert cosine(y, x).min() > 0.9999, name
    assert ll.last_ops["l_out-0"] == "ADD"
    common = set(a) & set(b)
    assert len(common) > 150


def _child_pids() -> set[int]:
    from pathlib import Path

    out: set[int] = set()
    for task in Path("/proc/self/task").glob("*"):
        try:
            out |= {int(c) for c in (task / "children").read_text().split()}
        except OSError:
            pass
    return out


def test_logits_stream_while_the_worker_runs_and_an_abandoned_stream_ends_it():
    """Blocks come through the pipe while the worker is alive (logits move once, no file), and a
    consumer that stops early leaves no worker behind."""
    before = _child_pids()
    eng = LlamaCppEngine(fx.build("tiny-qwen35"), block_size=8)
    it = eng.logits(TOKENS)
    start, block = next(it)
    assert start == 0 and block.shape == (8, eng.n_vocab) and block.dtype == np.float32
    assert _child_pids() - before, "the worker should still be streaming"
    it.close()
    assert not (_child_pids() - before)
    assert "n_tokens" not in eng.timings  # only finished decoding runs are counted
    gather(eng.logits(TOKENS[:20]))
    assert eng.timings["n_tokens"] == 20 and eng.timings["decode_s"] > 0 and eng.timings["load_s"] > 0
