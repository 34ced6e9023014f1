"""Fixtures are deterministic, well formed, and load in llama.cpp."""

from __future__ import annotations

import numpy as np
import pytest

from harness.fixtures import synthetic as fx
from harness.fixtures.resolve import resolve_model
from harness.model.gguf_model import GGUFModel
from harness.provenance import sha256_file


def test_same_seed_same_sha256(tmp_path):
    spec = fx.SPECS["tiny-qwen35"]
    a = fx.build_fixture(spec, tmp_path / "a.gguf")
    b = fx.build_fixture(spec, tmp_path / "b.gguf")
    assert sha256_file(a) == sha256_file(b)
    # and the cached copy is the same bytes
    assert sha256_file(fx.build("tiny-qwen35")) == sha256_file(a)


def test_other_seed_other_bytes(tmp_path):
    from dataclasses import replace

    spec = fx.SPECS["tiny-qwen35"]
    a = fx.build_fixture(spec, tmp_path / "a.gguf")
    b = fx.build_fixture(replace(spec, seed=spec.seed + 100), tmp_path / "b.gguf")
    assert sha256_file(a) != sha256_file(b)


def test_quantized_ladder_is_deterministic(tmp_path):
    src = fx.build("small-qwen35")
    a = fx.quantize(src, tmp_path / "a.gguf", "Q4_K_M")
    b = fx.quantize(src, tmp_path / "b.gguf", "Q4_K_M")
    assert sha256_file(a) == sha256_file(b) == sha256_file(fx.build("small-qwen35-Q4_K_M"))


def test_quantized_ladder_really_uses_k_quants():
    m = GGUFModel(fx.build("small-qwen35-Q4_K_M"))
    types = {m.tensor_info(n).type for n in m.tensor_names}
    assert "Q4_K" in types, types
    assert m.tensor_info("blk.0.ssm_a").type == "F32"  # SSM scalars stay F32
    m8 = GGUFModel(fx.build("small-qwen35-Q8_0"))
    assert m8.tensor_info("blk.0.attn_qkv.weight").type == "Q8_0"


def test_tiny_hparams_match_the_issue():
    h = GGUFModel(fx.build("tiny-qwen35")).hparams
    assert (h.n_layer, h.n_embd, h.n_ff, h.n_head, h.n_head_kv, h.head_dim, h.n_rot) == (8, 64, 128, 4, 2, 32, 8)
    assert h.rope_sections == (2, 1, 1, 0)
    assert [i for i in range(h.n_layer) if not h.is_recurrent(i)] == [3, 7]
    assert (h.ssm_n_group, h.ssm_dt_rank, h.ssm_d_state, h.head_v_dim, h.ssm_d_conv) == (2, 4, 32, 32, 4)
    assert h.n_ff == 128 and h.n_vocab == 515


def test_tiny_weights_exercise_the_math():
    m = GGUFModel(fx.build("tiny-qwen35"))
    decays = []
    for il in range(8):
        if not m.hparams.is_recurrent(il):
            continue
        a = m.tensor(f"blk.{il}.ssm_a")
        assert (a < 0).all()
        assert np.abs(m.tensor(f"blk.{il}.ssm_dt.bias")).min() > 0
        decays += list(np.exp(a * np.log1p(np.exp(m.tensor(f"blk.{il}.ssm_dt.bias")))))
    assert min(decays) < 0.1 and max(decays) > 0.9  # from near 0 to near 1
    norm = m.tensor("blk.0.attn_norm.weight")
    assert 0.9 < norm.mean() < 1.1 and norm.std() > 0.1  # spread around 1
    qkv = m.tensor("blk.0.attn_qkv.weight")
    v = qkv[2 * 2 * 32 :].reshape(4, 32, 64)
    assert not np.allclose(v[0], v[1])  # distinct heads


def test_moe_fixture_shapes():
    m = GGUFModel(fx.build("tiny-qwen35moe"))
    h = m.hparams
    assert (h.n_expert, h.n_expert_used) == (4, 2)
    assert m.tensor_info("blk.0.ffn_gate_exps.weight").ne == (64, h.n_ff_exp, 4)
    assert m.tensor_info("blk.0.ffn_down_exps.weight").ne == (h.n_ff_exp, 64, 4)
    assert m.tensor_info("blk.0.ffn_gate_inp_shexp.weight").ne == (64,)


def test_mtp_fixtures_share_the_trunk():
    base = GGUFModel(fx.build("tiny-qwen35"))
    mtp = GGUFModel(fx.build("tiny-qwen35-mtp"))
    absent = GGUFModel(fx.build("mtp-declared-absent"))
    assert mtp.hparams.n_layer_all == 9 and mtp.hparams.n_layer_nextn == 1
    assert any(n.startswith("blk.8.nextn.") for n in mtp.tensor_names)
    assert not any(n.startswith("blk.8.") for n in absent.tensor_names)
    assert absent.hparams.n_layer_all == 9
    for name in ("blk.0.attn_qkv.weight", "blk.7.attn_q.weight", "output.weight"):
        np.testing.assert_array_equal(base.tensor(name), absent.tensor(name))
        np.testing.assert_array_equal(base.tensor(name), mtp.tensor(name))


def test_v248k_fixture_has_the_real_vocab():
    m = GGUFModel(fx.build("tiny-qwen35-v248k"))
    assert m.hparams.n_vocab == 248_320
    assert m.tensor_info("token_embd.weight").ne == (64, 248_320)


def test_fixture_names_resolve_and_unknown_is_invalid():
    from harness.errors import InvalidInput

    assert resolve_model("fixture:tiny-qwen35") == fx.build("tiny-qwen35")
    with pytest.raises(InvalidInput, match="unknown fixture 'nope'.*tiny-qwen35"):
        resolve_model("fixture:nope")
