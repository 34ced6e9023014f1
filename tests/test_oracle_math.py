"""Properties of the float64 oracle (harness/engines/oracle): its pure steps, then the engine on a
tiny random qwen35 / qwen35moe GGUF written here (chunked feeding, activation names, errors).

Every test name contains "oracle" so ``pytest -k oracle`` selects them.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from harness.engines.base import gather
from harness.engines.oracle import Qwen35MoeOracle, Qwen35Oracle, load_oracle
from harness.engines.oracle.qwen35 import (
    causal_attention,
    causal_conv1d,
    gated_delta_rule_chunked,
    gated_delta_rule_recurrent,
    gdn_gate,
    imrope_positions,
    l2norm,
    rmsnorm,
    rope_neox_partial,
    softplus,
    tile_k_heads,
)
from harness.engines.oracle.qwen35moe import moe, moe_route
from harness.errors import EngineError

FAST = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def rel_err(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-300))


def gdn_inputs(seed: int, t: int, h: int, d_k: int, d_v: int, state_scale: float = 1.0):
    """Inputs as the model produces them: L2-normalised q, k; beta in (0, 1); g <= 0."""
    rng = np.random.default_rng(seed)
    q = l2norm(rng.normal(size=(t, h, d_k)), 1e-6)
    k = l2norm(rng.normal(size=(t, h, d_k)), 1e-6)
    v = rng.normal(size=(t, h, d_v))
    g = gdn_gate(rng.normal(size=(t, h)) * 3, rng.normal(size=h), -np.exp(rng.normal(size=h)))
    beta = 1 / (1 + np.exp(-rng.normal(size=(t, h)) * 2))
    s0 = rng.normal(size=(h, d_k, d_v)) * state_scale
    return q, k, v, g, beta, s0


# ---------------------------------------------------------------------------------------------
# Gated delta rule
# ---------------------------------------------------------------------------------------------


@FAST
@given(
    seed=st.integers(0, 2**32 - 1),
    t=st.integers(1, 150),
    h=st.integers(1, 4),
    d_k=st.integers(1, 12),
    d_v=st.integers(1, 12),
    chunk=st.sampled_from([64, 1, 3, 16, 33]),
    zero_state=st.booleans(),
)
def test_oracle_gdn_chunked_equals_recurrent(seed, t, h, d_k, d_v, chunk, zero_state):
    q, k, v, g, beta, s0 = gdn_inputs(seed, t, h, d_k, d_v, 0.0 if zero_state else 1.0)
    o_r, s_r = gated_delta_rule_recurrent(q, k, v, g, beta, s0)
    o_c, s_c = gated_delta_rule_chunked(q, k, v, g, beta, s0, chunk_size=chunk)
    assert o_c.shape == o_r.shape == v.shape and s_c.shape == s_r.shape == s0.shape
    assert rel_err(o_c, o_r) < 1e-10, (seed, t, h, d_k, d_v, chunk)
    assert rel_err(s_c, s_r) < 1e-10, (seed, t, h, d_k, d_v, chunk)


@FAST
@given(seed=st.integers(0, 2**32 - 1), t=st.integers(2, 140), data=st.data())
def test_oracle_gdn_state_carried_across_splits(seed, t, data):
    """Feeding the sequence in pieces, state carried, equals one call (both forms)."""
    q, k, v, g, beta, s0 = gdn_inputs(seed, t, 4, 8, 6)
    cuts = sorted(data.draw(st.sets(st.integers(1, t - 1), max_size=4)))
    bounds = [0, *cuts, t]
    o_whole, s_whole = gated_delta_rule_recurrent(q, k, v, g, beta, s0)
    for rule in (gated_delta_rule_recurrent, gated_delta_rule_chunked):
        s, outs = s0, []
        for a, b in zip(bounds[:-1], bounds[1:]):
            o, s = rule(q[a:b], k[a:b], v[a:b], g[a:b], beta[a:b], s)
            outs.append(o)
        assert rel_err(np.concatenate(outs), o_whole) < 1e-10, (rule.__name__, bounds)
        assert rel_err(s, s_whole) < 1e-10, (rule.__name__, bounds)


@FAST
@given(seed=st.integers(0, 2**32 - 1), t=st.integers(1, 130), chunk=st.sampled_from([64, 5]))
def test_oracle_gdn_beta_zero_only_decays(seed, t, chunk):
    """With beta = 0 nothing is written: S_t = exp(Σg) S_0 and o_t = scale · exp(γ_t) S_0ᵀ q_t."""
    q, k, v, g, beta, s0 = gdn_inputs(seed, t, 3, 5, 4)
    beta = np.zeros_like(beta)
    gamma = np.cumsum(g, axis=0)  # [T, H]
    want_o = np.einsum("th,thk,hkv->thv", np.exp(gamma), q / np.sqrt(5), s0)
    want_s = np.exp(gamma[-1])[:, None, None] * s0
    for o, s in (
        gated_delta_rule_recurrent(q, k, v, g, beta, s0),
        gated_delta_rule_chunked(q, k, v, g, beta, s0, chunk_size=chunk),
    ):
        assert rel_err(s, want_s) < 1e-12
        assert rel_err(o, want_o) < 1e-12


@FAST
@given(
    alpha=st.floats(-60, 60),
    dt_bias=st.floats(-10, 10),
    a_log=st.floats(-6, 2),
)
def test_oracle_gdn_decay_in_unit_interval(alpha, dt_bias, a_log):
    """ssm_a = −exp(A_log) < 0 makes g ≤ 0, so the decay exp(g) is in (0, 1]."""
    g = gdn_gate(np.array([[alpha]]), np.array([dt_bias]), -np.exp(np.array([a_log])))
    decay = np.exp(g)
    assert np.all(g <= 0) and np.all(decay > 0) and np.all(decay <= 1)


def test_oracle_softplus_matches_llamacpp_threshold():
    x = np.array([-50.0, -1.0, 0.0, 1.0, 19.9, 20.0, 20.1, 700.0])
    exact = np.logaddexp(0.0, x)
    got = softplus(x)
    assert np.allclose(got[x <= 20], exact[x <= 20], rtol=1e-15, atol=0)
    assert np.array_equal(got[x > 20], x[x > 20])  # ggml op_softplus / torch threshold=20


def test_oracle_tile_k_heads_is_tiled_not_grouped():
    x = np.arange(2)[None, :, None] * np.ones((1, 2, 3))  # head j holds value j
    assert tile_k_heads(x, 6)[0, :, 0].tolist() == [0, 1, 0, 1, 0, 1]


# ---------------------------------------------------------------------------------------------
# Causal conv
# ---------------------------------------------------------------------------------------------


@FAST
@given(seed=st.integers(0, 2**32 - 1), t=st.integers(1, 20), c=st.integers(1, 6), kw=st.integers(1, 5))
def test_oracle_conv_matches_definition(seed, t, c, kw):
    """y[t, c] = Σ_i w[c, i] · x[t − K + 1 + i, c]; w[:, K−1] multiplies the current token."""
    rng = np.random.default_rng(seed)
    x, w, s0 = rng.normal(size=(t, c)), rng.normal(size=(c, kw)), rng.normal(size=(kw - 1, c))
    y, s1 = causal_conv1d(x, w, s0)
    xs = np.concatenate([s0, x])
    want = np.array([[sum(w[ch, i] * xs[tt + i, ch] for i in range(kw)) for ch in range(c)] for tt in range(t)])
    assert y.shape == x.shape and s1.shape == s0.shape
    assert np.allclose(y, want, rtol=1e-13, atol=1e-13)
    assert np.array_equal(s1, xs[len(xs) - (kw - 1) :])


@FAST
@given(seed=st.integers(0, 2**32 - 1), t=st.integers(2, 30), kw=st.integers(1, 5), data=st.data())
def test_oracle_conv_is_causal(seed, t, kw, data):
    rng = np.random.default_rng(seed)
    x, w = rng.normal(size=(t, 3)), rng.normal(size=(3, kw))
    t0 = data.draw(st.integers(0, t - 2))
    x2 = x.copy()
    x2[t0 + 1 :] += rng.normal(size=x2[t0 + 1 :].shape)
    zeros = np.zeros((kw - 1, 3))
    y1, _ = causal_conv1d(x, w, zeros)
    y2, _ = causal_conv1d(x2, w, zeros)
    assert np.array_equal(y1[: t0 + 1], y2[: t0 + 1])


@FAST
@given(seed=st.integers(0, 2**32 - 1), t=st.integers(1, 40), kw=st.integers(1, 5), data=st.data())
def test_oracle_conv_state_carried_across_splits(seed, t, kw, data):
    rng = np.random.default_rng(seed)
    x, w = rng.normal(size=(t, 4)), rng.normal(size=(4, kw))
    cuts = sorted(data.draw(st.sets(st.integers(1, max(1, t - 1)), max_size=5))) if t > 1 else []
    bounds = [0, *cuts, t]
    y_whole, s_whole = causal_conv1d(x, w, np.zeros((kw - 1, 4)))
    s, ys = np.zeros((kw - 1, 4)), []
    for a, b in zip(bounds[:-1], bounds[1:]):
        y, s = causal_conv1d(x[a:b], w, s)
        ys.append(y)
    assert np.allclose(np.concatenate(ys), y_whole, rtol=1e-14, atol=1e-14)
    assert np.array_equal(s, s_whole)


# ---------------------------------------------------------------------------------------------
# Norms, RoPE, attention
# ---------------------------------------------------------------------------------------------


@FAST
@given(seed=st.integers(0, 2**32 - 1), n=st.integers(1, 64), scale=st.floats(1e-2, 1e3))
def test_oracle_norms(seed, n, scale):
    rng = np.random.default_rng(seed)
    x, w = rng.normal(size=(3, 5, n)) * scale, rng.normal(size=n)
    y = rmsnorm(x, w, 1e-6)
    assert y.shape == x.shape
    assert np.allclose(y, x / np.sqrt((x**2).mean(-1, keepdims=True) + 1e-6) * w, rtol=1e-14, atol=0)
    assert np.allclose(rmsnorm(x, None, 0.0), rmsnorm(3 * x, None, 0.0), rtol=1e-13, atol=1e-13)
    u = l2norm(x, 1e-6)
    assert u.shape == x.shape
    assert np.allclose(np.linalg.norm(u, axis=-1), 1 / np.sqrt(1 + 1e-6 / (x**2).sum(-1)), rtol=1e-13)


@FAST
@given(seed=st.integers(0, 2**32 - 1), pos_q=st.integers(0, 5000), pos_k=st.integers(0, 5000), shift=st.integers(0, 3000))
def test_oracle_rope_relative_position(seed, pos_q, pos_k, shift):
    """A rotation per pair: norms kept, dims ≥ n_rot untouched, q·k depends only on pos_q − pos_k."""
    rng = np.random.default_rng(seed)
    n_rot, sections = 16, [3, 3, 2, 0]
    q, k = rng.normal(size=(1, 2, 24)), rng.normal(size=(1, 2, 24))

    def rot(x, p):
        return rope_neox_partial(x, imrope_positions(np.array([p]), n_rot, sections), n_rot, 1e7)

    rq, rk = rot(q, pos_q), rot(k, pos_k)
    assert rq.shape == q.shape and np.array_equal(rq[..., n_rot:], q[..., n_rot:])
    assert np.allclose(np.linalg.norm(rq, axis=-1), np.linalg.norm(q, axis=-1), rtol=1e-13)
    d1 = np.sum(rq * rk, axis=-1)
    d2 = np.sum(rot(q, pos_q + shift) * rot(k, pos_k + shift), axis=-1)
    assert np.allclose(d1, d2, rtol=1e-9, atol=1e-9)


def test_oracle_imrope_text_is_neox_partial():
    """qwen35's sections [11, 11, 10, 0] with n_rot 64: every pair rotates by the token position."""
    pos = np.arange(7) * 13
    pp = imrope_positions(pos, 64, [11, 11, 10, 0])
    assert np.array_equal(pp, np.repeat(pos[:, None].astype(float), 32, axis=1))
    x = np.random.default_rng(0).normal(size=(7, 3, 256))
    assert np.array_equal(rope_neox_partial(x, pp, 64, 1e7), rope_neox_partial(x, pos, 64, 1e7))
    # pairs whose sector falls in the e stream (position 0 for text) are not rotated
    pp = imrope_positions(pos, 6, [3, 0, 0, 0])  # sectors 0, 1, 2 -> t, e, e
    assert np.array_equal(pp[:, 0], pos.astype(float)) and np.all(pp[:, 1:] == 0)


@FAST
@given(seed=st.integers(0, 2**32 - 1), t=st.integers(1, 12), n_kv=st.sampled_from([1, 2]), group=st.sampled_from([1, 2, 3]))
def test_oracle_attention_causal_grouped(seed, t, n_kv, group):
    rng = np.random.default_rng(seed)
    n_head, d = n_kv * group, 4
    q, k, v = rng.normal(size=(t, n_head, d)), rng.normal(size=(t, n_kv, d)), rng.normal(size=(t, n_kv, 5))
    pos = np.arange(t)
    out = causal_attention(q, k, v, pos, pos, 0.5)
    assert out.shape == (t, n_head, 5)
    for i in range(n_head):  # reference: head i reads kv head i // group, keys at positions <= t
        j = i // group
        for tt in range(t):
            s = k[: tt + 1, j] @ q[tt, i] * 0.5
            p = np.exp(s - s.max())
            assert np.allclose(out[tt, i], (p / p.sum()) @ v[: tt + 1, j], rtol=1e-12, atol=1e-12)


@FAST
@given(seed=st.integers(0, 2**32 - 1), t=st.integers(2, 40), n_kv=st.sampled_from([1, 2]), group=st.sampled_from([1, 2]))
def test_oracle_attention_chunked_queries_equal_unchunked(seed, t, n_kv, group):
    """Queries taken a few rows at a time (a score budget of 1-3 rows) give the values of the
    whole [H, T, T] score matrix bit for bit: each row's softmax and products are its own. A
    prefix of keys already cached (Tk > Tq, later query positions) as the oracle's decode has."""
    from harness.engines.oracle import qwen35

    rng = np.random.default_rng(seed)
    n_head, d, past = n_kv * group, 8, int(rng.integers(0, 5))
    q, k, v = rng.normal(size=(t, n_head, d)), rng.normal(size=(past + t, n_kv, d)), rng.normal(size=(past + t, n_kv, 6))
    q_pos, k_pos = np.arange(past, past + t), np.arange(past + t)
    whole = qwen35.attention_rows(q, k, v, q_pos, k_pos, 0.35)
    rows = int(rng.integers(1, 4))
    old = qwen35.ATTENTION_SCORE_BYTES
    qwen35.ATTENTION_SCORE_BYTES = 8 * n_head * (past + t) * rows
    try:
        chunked = causal_attention(q, k, v, q_pos, k_pos, 0.35)
    finally:
        qwen35.ATTENTION_SCORE_BYTES = old
    assert chunked.shape == whole.shape == (t, n_head, 6)
    assert np.array_equal(chunked, whole)


def test_oracle_attention_memory_bounded_by_score_budget():
    """At 2,048 positions and 4 heads the whole float64 score matrix is 128 MiB; with the default
    64 MiB budget lowered to 1 MiB the call's peak traced allocation stays under 8 MiB (q, k, v,
    output: 1 MiB together), where the unchunked rows' peak is over 128 MiB."""
    import tracemalloc

    from harness.engines.oracle import qwen35

    rng = np.random.default_rng(0)
    t = 2048
    q, k, v = rng.normal(size=(t, 4, 8)), rng.normal(size=(t, 2, 8)), rng.normal(size=(t, 2, 8))
    pos = np.arange(t)
    old = qwen35.ATTENTION_SCORE_BYTES
    qwen35.ATTENTION_SCORE_BYTES = 1 << 20
    tracemalloc.start()
    try:
        chunked = causal_attention(q, k, v, pos, pos, 0.35)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
        qwen35.ATTENTION_SCORE_BYTES = old
    assert peak < 8 << 20, peak
    tracemalloc.start()
    try:
        whole = qwen35.attention_rows(q, k, v, pos, pos, 0.35)
        _, peak_whole = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak_whole > 128 << 20
    assert np.array_equal(chunked, whole)


# ---------------------------------------------------------------------------------------------
# MoE
# ---------------------------------------------------------------------------------------------


@FAST
@given(seed=st.integers(0, 2**32 - 1), t=st.integers(1, 9), n_exp=st.integers(2, 6), data=st.data())
def test_oracle_moe_matches_per_token_loop(seed, t, n_exp, data):
    k_used = data.draw(st.integers(1, n_exp))
    rng = np.random.default_rng(seed)
    d, ff = 5, 3
    x, router = rng.normal(size=(t, d)), rng.normal(size=(n_exp, d))
    ge, ue, de = rng.normal(size=(n_exp, ff, d)), rng.normal(size=(n_exp, ff, d)), rng.normal(size=(n_exp, d, ff))
    sh = (rng.normal(size=(4, d)), rng.normal(size=(4, d)), rng.normal(size=(d, 4)), rng.normal(size=d))
    out, parts = moe(x, router, ge, ue, de, k_used, sh)
    route = moe_route(x, router, k_used)
    assert np.allclose(route["weights"].sum(1), 1.0, rtol=1e-14)
    assert np.allclose(moe_route(x, router, k_used, norm_w=False)["weights"], route["ffn_moe_weights"])

    def silu(z):
        return z / (1 + np.exp(-z))

    for tt in range(t):
        p = np.exp(x[tt] @ router.T)
        p /= p.sum()
        top = np.argsort(-p)[:k_used]
        assert set(top) == set(parts["ffn_moe_topk"][tt])
        want = sum(p[e] / p[top].sum() * (de[e] @ (silu(ge[e] @ x[tt]) * (ue[e] @ x[tt]))) for e in top)
        shared = sh[2] @ (silu(sh[0] @ x[tt]) * (sh[1] @ x[tt])) / (1 + np.exp(-(sh[3] @ x[tt])))
        assert np.allclose(out[tt], want + shared, rtol=1e-12, atol=1e-12)


# ---------------------------------------------------------------------------------------------
# The engine on a tiny random GGUF
# ---------------------------------------------------------------------------------------------

TINY = dict(d=32, ff=48, n_layer=4, interval=2, n_head=4, n_kv=2, head_dim=16, n_rot=8, sections=[2, 1, 1, 0],
            conv=4, d_state=8, n_k=2, n_v=4, vocab=64, n_exp=4, n_used=2, ff_exp=16, ff_sh=24)


def write_tiny_gguf(path, arch: str, seed: int = 0, patch: dict | None = None) -> str:
    """A random qwen35 / qwen35moe GGUF in llama.cpp's layout (n_v > n_k so head tiling shows)."""
    import gguf

    c, rng = TINY, np.random.default_rng(seed)
    d, hd = c["d"], c["head_dim"]
    key_dim, val_dim = c["n_k"] * c["d_state"], c["n_v"] * c["d_state"]
    w = gguf.GGUFWriter(str(path), arch)
    for key, val in [("block_count", c["n_layer"]), ("embedding_length", d), ("feed_forward_length", c["ff"]),
                     ("attention.head_count", c["n_head"]), ("attention.head_count_kv", c["n_kv"]),
                     ("attention.key_length", hd), ("attention.value_length", hd),
                     ("rope.dimension_count", c["n_rot"]), ("ssm.conv_kernel", c["conv"]),
                     ("ssm.state_size", c["d_state"]), ("ssm.group_count", c["n_k"]),
                     ("ssm.time_step_rank", c["n_v"]), ("ssm.inner_size", val_dim),
                     ("full_attention_interval", c["interval"]), ("context_length", 4096)]:
        w.add_uint32(f"{arch}.{key}", val)
    if arch == "qwen35moe":
        for key, val in [("expert_count", c["n_exp"]), ("expert_used_count", c["n_used"]),
                         ("expert_feed_forward_length", c["ff_exp"]), ("expert_shared_feed_forward_length", c["ff_sh"])]:
            w.add_uint32(f"{arch}.{key}", val)
    w.add_float32(f"{arch}.rope.freq_base", 1e7)
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)
    w.add_array(f"{arch}.rope.dimension_sections", c["sections"])

    def mat(*shape, s=None):  # NumPy order: (n_out, n_in)
        return (rng.normal(size=shape) * (s if s is not None else shape[-1] ** -0.5)).astype(np.float32)

    def norm(n):
        return (1 + 0.1 * rng.normal(size=n)).astype(np.float32)

    tensors = {"token_embd.weight": mat(c["vocab"], d, s=1.0), "output_norm.weight": norm(d),
               "output.weight": mat(c["vocab"], d)}
    for il in range(c["n_layer"]):
        p = f"blk.{il}."
        tensors[p + "attn_norm.weight"] = norm(d)
        tensors[p + "post_attention_norm.weight"] = norm(d)
        if (il + 1) % c["interval"]:
            tensors.update({p + "attn_qkv.weight": mat(2 * key_dim + val_dim, d), p + "attn_gate.weight": mat(val_dim, d),
                            p + "ssm_conv1d.weight": mat(2 * key_dim + val_dim, c["conv"], s=0.5),
                            p + "ssm_dt.bias": mat(c["n_v"], s=1.0), p + "ssm_a": -np.exp(mat(c["n_v"], s=1.0)),
                            p + "ssm_beta.weight": mat(c["n_v"], d), p + "ssm_alpha.weight": mat(c["n_v"], d),
                            p + "ssm_norm.weight": norm(c["d_state"]), p + "ssm_out.weight": mat(d, val_dim)})
        else:
            tensors.update({p + "attn_q.weight": mat(2 * c["n_head"] * hd, d), p + "attn_k.weight": mat(c["n_kv"] * hd, d),
                            p + "attn_v.weight": mat(c["n_kv"] * hd, d), p + "attn_q_norm.weight": norm(hd),
                            p + "attn_k_norm.weight": norm(hd), p + "attn_output.weight": mat(d, c["n_head"] * hd)})
        if arch == "qwen35":
            tensors.update({p + "ffn_gate.weight": mat(c["ff"], d), p + "ffn_up.weight": mat(c["ff"], d),
                            p + "ffn_down.weight": mat(d, c["ff"])})
        else:
            e, fe, fs = c["n_exp"], c["ff_exp"], c["ff_sh"]
            tensors.update({p + "ffn_gate_inp.weight": mat(e, d), p + "ffn_gate_exps.weight": mat(e, fe, d),
                            p + "ffn_up_exps.weight": mat(e, fe, d), p + "ffn_down_exps.weight": mat(e, d, fe),
                            p + "ffn_gate_inp_shexp.weight": mat(d), p + "ffn_gate_shexp.weight": mat(fs, d),
                            p + "ffn_up_shexp.weight": mat(fs, d), p + "ffn_down_shexp.weight": mat(d, fs)})
    tensors.update(patch or {})
    for name, arr in tensors.items():
        w.add_tensor(name, np.ascontiguousarray(arr, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


@pytest.fixture(scope="module", params=["qwen35", "qwen35moe"])
def tiny_oracle(request, tmp_path_factory):
    path = write_tiny_gguf(tmp_path_factory.mktemp("oracle") / f"tiny-{request.param}.gguf", request.param)
    return load_oracle(path)


PROMPT = np.random.default_rng(1).integers(0, TINY["vocab"], size=80).tolist()


def test_oracle_engine_kind_and_info(tiny_oracle):
    want = Qwen35MoeOracle if tiny_oracle.hp.arch == "qwen35moe" else Qwen35Oracle
    assert type(tiny_oracle) is want
    assert tiny_oracle.info.name == "oracle" and "chunks" in tiny_oracle.info.capabilities
    assert tiny_oracle.n_vocab == TINY["vocab"]


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(data=st.data())
def test_oracle_engine_chunks_equal_whole(tiny_oracle, data):
    """Random chunkings (crossing the 64-token chunked/recurrent switch) give the whole-prompt
    logits: conv state, recurrent state and KV are carried across pieces."""
    cuts = sorted(data.draw(st.sets(st.integers(1, len(PROMPT) - 1), min_size=1, max_size=5)))
    chunks = np.diff([0, *cuts, len(PROMPT)]).tolist()
    whole = _whole(tiny_oracle)
    pieces = tiny_oracle.activations(PROMPT, chunks, names={"result_output", "l_out"})
    for name, value in whole.items():
        assert rel_err(pieces[name], value) < 1e-10, (name, chunks)


_WHOLE: dict = {}


def _whole(oracle):
    key = oracle.hp.arch
    if key not in _WHOLE:
        _WHOLE[key] = oracle.activations(PROMPT, names={"result_output", "l_out"})
    return _WHOLE[key]


def test_oracle_engine_logit_blocks(tiny_oracle):
    logits = gather(tiny_oracle.logits(PROMPT), len(PROMPT))
    assert logits.dtype == np.float32 and logits.shape == (len(PROMPT), TINY["vocab"])
    assert np.allclose(logits, _whole(tiny_oracle)["result_output"], rtol=1e-6, atol=1e-6)
    one = gather(tiny_oracle.logits(PROMPT[:1]), 1)
    assert np.allclose(one[0], logits[0], rtol=1e-6, atol=1e-6)  # causal: row 0 sees only token 0


def test_oracle_engine_activation_names(tiny_oracle):
    t, c = 5, TINY
    acts = tiny_oracle.activations(PROMPT[:t])
    moe = tiny_oracle.hp.arch == "qwen35moe"
    expect = {"model.input_embed": (t, c["d"]), "result_norm": (t, c["d"]), "result_output": (t, c["vocab"])}
    for il in range(c["n_layer"]):
        expect.update({f"attn_norm-{il}": (t, c["d"]), f"attn_residual-{il}": (t, c["d"]),
                       f"attn_post_norm-{il}": (t, c["d"]), f"ffn_out-{il}": (t, c["d"]), f"l_out-{il}": (t, c["d"]),
                       f"{'post_moe' if moe else 'post_ffn'}-{il}": (t, c["d"])})
        if (il + 1) % c["interval"]:
            expect.update({f"linear_attn_out-{il}": (t, c["d"]), f"z-{il}": (t, c["n_v"] * c["d_state"]),
                           f"beta_sigmoid-{il}": (t, c["n_v"]), f"gate-{il}": (t, c["n_v"]),
                           f"conv_output_silu-{il}": (t, 2 * c["n_k"] * c["d_state"] + c["n_v"] * c["d_state"]),
                           f"attn_output-{il}": (t, c["n_v"], c["d_state"]),
                           f"final_output-{il}": (t, c["n_v"] * c["d_state"])})
        else:
            expect.update({f"attn_output-{il}": (t, c["d"]), f"attn_gated-{il}": (t, c["n_head"] * c["head_dim"]),
                           f"Qcur-{il}": (t, c["n_head"], c["head_dim"]), f"Kcur-{il}": (t, c["n_kv"], c["head_dim"])})
        if moe:
            expect.update({f"ffn_moe_topk-{il}": (t, c["n_used"]), f"ffn_moe_probs-{il}": (t, c["n_exp"]),
                           f"shared_expert_gate_sigmoid-{il}": (t, 1)})
    for name, shape in expect.items():
        assert acts[name].shape == shape, name
    assert np.allclose(acts["l_out-3"], acts["ffn_out-3"] + acts["attn_residual-3"], rtol=1e-14)
    assert np.allclose(acts["attn_residual-0"], acts["linear_attn_out-0"] + acts["model.input_embed"], rtol=1e-14)
    assert np.all(acts["gate-0"] <= 0) and np.all((acts["beta_sigmoid-0"] > 0) & (acts["beta_sigmoid-0"] < 1))


def test_oracle_engine_nonfinite_names_layer_and_op(tmp_path):
    """A positive ssm_a makes exp(g) overflow; the error names layer 2 and the op, not a NaN."""
    path = write_tiny_gguf(tmp_path / "bad.gguf", "qwen35", patch={"blk.2.ssm_a": np.full(4, 1e30, np.float32)})
    with pytest.raises(EngineError, match=r"layer 2 .*gate-2|layer 2"):
        gather(load_oracle(path).logits(PROMPT[:3]))
    path = write_tiny_gguf(tmp_path / "inf.gguf", "qwen35", patch={"blk.1.attn_k.weight": np.full((32, 32), np.inf, np.float32)})
    with pytest.raises(EngineError, match=r"layer 1"):
        gather(load_oracle(path).logits(PROMPT[:3]))


def test_oracle_engine_rejects_bad_tokens_and_chunks(tiny_oracle):
    with pytest.raises(EngineError, match="outside the vocabulary"):
        gather(tiny_oracle.logits([0, TINY["vocab"]]))
    with pytest.raises(EngineError, match="sum to"):
        gather(tiny_oracle.logits([0, 1, 2], chunks=[1, 1]))


class _HeadOnly(Qwen35Oracle):
    """Just the oracle's output projection, over a given [V, d] float32 matrix."""

    def __init__(self, w: np.ndarray, cached: bool):
        self._w, self._output_name, self._lm_scratch = w, "output.weight", None
        self._output_cache = w if cached else None

    def _output_weights(self):
        return self._output_cache

    @property
    def n_vocab(self) -> int:
        return self._w.shape[0]

    def read_tensor(self, name, rows=None, dtype=np.float64):
        return self._w[rows].astype(dtype)


@pytest.mark.parametrize("cached", [True, False])
@pytest.mark.parametrize("d", [64, 96])
def test_oracle_lm_head_equals_plain_matmul_bit_for_bit(cached, d):
    """The sliced float64 output projection gives exactly (h @ W.T) rounded once, for 1-row,
    few-row and full blocks, with the vocabulary cut into 16,384-row slices and a short last one."""
    rng = np.random.default_rng(d)
    w = rng.standard_normal((40_000, d), dtype=np.float32)
    head = _HeadOnly(w, cached)
    for m in (1, 2, 3, 17, 256):
        h = rng.standard_normal((m, d))
        plain = h @ w.astype(np.float64).T
        got64 = head.lm_head(h, np.float64)
        got32 = head.lm_head(h, np.float32)
        assert got64.dtype == np.float64 and got32.dtype == np.float32
        assert np.array_equal(got64, plain), (m, int((got64 != plain).sum()))
        assert np.array_equal(got32, plain.astype(np.float32)), m
    h[0, 0] = np.inf
    with pytest.raises(EngineError, match="non-finite logits"):
        head.lm_head(h)
