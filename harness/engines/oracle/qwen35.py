"""Exact float64 NumPy forward of Qwen3.5 (GGUF arch ``qwen35``): the oracle engine.

Read top to bottom like a model definition: elementwise helpers, norms, the Gated DeltaNet pieces
(causal conv, gated delta rule in recurrent and chunked form), the gated-attention pieces (query /
gate split, IMROPE, causal GQA attention), the SwiGLU FFN, then ``Qwen35Oracle``, which wires them
into the hybrid forward pass of llama.cpp's ``src/models/qwen35.cpp`` and speaks the engine protocol
(``harness/engines/base.py``).

Conventions (all checked against llama.cpp as vendored in llama-cpp-python 0.3.36, see
docs/qwen35-gguf-math.md):

* arrays are position-major: a sequence of ``T`` tokens is ``[T, ...]``; weights are NumPy order
  (reverse of ggml ``ne``), so a ggml ``[n_in, n_out]`` matrix is ``(n_out, n_in)`` and
  ``x @ W.T`` applies it to rows ``x``;
* everything is float64; no step rounds to float32 or float16;
* value heads are tiled over key heads: v-head ``h`` reads k-head ``h % n_k``
  (``ggml_gated_delta_net``: ``iq1 = iv1 % neq1``); attention heads are grouped over KV heads:
  head ``i`` reads KV head ``i // (n_head / n_kv)`` (``ggml_mul_mat`` broadcast ``i02 = i12 / r2``).

A mutant engine (``harness/engines/mutants.py``) plants a fault by subclassing ``Qwen35Oracle``
and overriding one step; the oracle is written so that this needs no copied code:

* every step is called through ``self``: the pure functions are class attributes
  (``self.rmsnorm``, ``self.sigmoid``, ``self.rope`` ...), each layer kind is one method
  (``gated_delta_net``, ``gated_attention``, ``ffn``);
* ``block`` has two hooks: ``mixer`` (which token mixer a layer runs, chosen by ``mixer_kind``)
  and ``residual_input`` (what the attention residual adds the mixer output to);
* every weight is read through one method, ``read_tensor`` (dequantized by
  ``GGUFModel.tensor``, whole or by rows), so a weight fault overrides one method.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any, Collection, Iterator, Sequence

import numpy as np
from scipy.special import expit
from threadpoolctl import ThreadpoolController

from harness.engines.base import MTP_CHAIN, MTP_CONVENTIONS, ChainedDrafts, Drafts, EngineInfo, LogitBlock, validate_chunks
from harness.errors import EngineError

@lru_cache(maxsize=1)
def _blas_controller() -> ThreadpoolController:
    """One ``threadpoolctl.ThreadpoolController`` for the process: it finds the loaded BLAS
    libraries once (``threadpool_limits`` searches them on every call, 0.8 ms: more than a decode
    step's delta rule at small shapes)."""
    return ThreadpoolController()


# ---------------------------------------------------------------------------------------------
# Elementwise
# ---------------------------------------------------------------------------------------------


def sigmoid(x: np.ndarray) -> np.ndarray:
    """Logistic function 1 / (1 + exp(-x)), overflow-free (``scipy.special.expit``). Any shape."""
    return expit(x)


def silu(x: np.ndarray) -> np.ndarray:
    """SiLU x · sigmoid(x). Any shape. Source: ``ggml_silu``; transformers ``ACT2FN["silu"]``."""
    return x * expit(x)


SOFTPLUS_THRESHOLD = 20.0


def softplus(x: np.ndarray) -> np.ndarray:
    """softplus(x) = log(1 + exp(x)), and x itself above 20. Any shape, float64.

    The threshold is the one both references use: ggml-cpu ``unary-ops.cpp`` ``op_softplus``
    (``x > 20 ? x : log(1 + exp(x))``) and torch ``F.softplus`` (threshold=20) in transformers.
    Past it the two differ from the exact value by < 2.1e-9, below float32 resolution at x > 20.
    """
    return np.where(x > SOFTPLUS_THRESHOLD, x, np.log1p(np.exp(np.minimum(x, SOFTPLUS_THRESHOLD))))


# ---------------------------------------------------------------------------------------------
# Norms
# ---------------------------------------------------------------------------------------------


def rmsnorm(x: np.ndarray, weight: np.ndarray | None, eps: float) -> np.ndarray:
    """RMSNorm over the last axis: x / sqrt(mean(x²) + eps) · weight.

    x: [..., n] float64; weight: [n] or None (no scale). The GGUF already stores (1 + w) for the
    shifted norms (``attn_norm``, ``post_attention_norm``, ``attn_q_norm``, ``attn_k_norm``,
    ``output_norm``), so no +1 here. Source: llama.cpp ``llm_graph_context::build_norm``
    (``LLM_NORM_RMS``: ``ggml_rms_norm`` then ``ggml_mul``).
    """
    y = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)
    return y if weight is None else y * weight


def rmsnorm_gated(x: np.ndarray, weight: np.ndarray, z: np.ndarray, eps: float) -> np.ndarray:
    """Gated RMSNorm of the DeltaNet output: rmsnorm(x) · weight · silu(z), over the last axis.

    x, z: [..., d_v]; weight: [d_v] (``ssm_norm``, NOT shifted by +1). Source: llama.cpp
    ``qwen35.cpp`` ``build_norm_gated``; transformers ``Qwen3_5RMSNormGated``.
    """
    return rmsnorm(x, weight, eps) * silu(z)


def l2norm(x: np.ndarray, eps: float) -> np.ndarray:
    """L2 normalisation over the last axis: x / sqrt(sum(x²) + eps). x: [..., n] float64.

    llama.cpp computes it as ``rms_norm(x, eps/n) / sqrt(n)`` (``models.h`` ``build_gdn_l2_norm``),
    which is this expression exactly; its eps is the model's rms eps
    (``attention.layer_norm_rms_epsilon``). transformers ``l2norm`` uses a fixed 1e-6.
    """
    return x / np.sqrt(np.sum(x * x, axis=-1, keepdims=True) + eps)


# ---------------------------------------------------------------------------------------------
# Gated DeltaNet
# ---------------------------------------------------------------------------------------------


def causal_conv1d(x: np.ndarray, weight: np.ndarray, conv_state: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Depthwise causal convolution with carried state (no bias, no activation).

    x: [T, C] new inputs; weight: [C, K] (``ssm_conv1d``, ggml ``[K, C]``); conv_state:
    [K-1, C], the K-1 inputs before x (zeros at sequence start). Returns (y [T, C],
    new_state [K-1, C] = the last K-1 rows of concat(conv_state, x)).

    y[t, c] = Σ_{i<K} weight[c, i] · xs[t + i, c] with xs = concat(conv_state, x), so
    ``weight[:, K-1]`` multiplies the current token. Source: ggml-cpu ``ops.cpp``
    ``ggml_compute_forward_ssm_conv_f32``; llama.cpp ``delta-net-base.cpp`` ``build_conv_state``.
    """
    k = weight.shape[1]
    xs = np.concatenate([conv_state, x], axis=0)  # [K-1+T, C]
    windows = np.lib.stride_tricks.sliding_window_view(xs, k, axis=0)  # [T, C, K]
    y = np.einsum("tck,ck->tc", windows, weight)
    return y, xs[xs.shape[0] - (k - 1) :].copy()


def gdn_gate(alpha: np.ndarray, dt_bias: np.ndarray, ssm_a: np.ndarray) -> np.ndarray:
    """Log-decay g = ssm_a · softplus(alpha + dt_bias); the per-step decay is exp(g) ∈ (0, 1].

    alpha: [T, H] (``ssm_alpha`` · x); dt_bias: [H] (``ssm_dt.bias``); ssm_a: [H] (= −exp(A_log),
    negative in a well-formed file). Returns g: [T, H]. Source: llama.cpp ``qwen35.cpp``
    (``a_softplus``, ``gate``); transformers ``-A_log.exp() * F.softplus(a + dt_bias)``.
    """
    return softplus(alpha + dt_bias) * ssm_a


def tile_k_heads(x: np.ndarray, n_v: int) -> np.ndarray:
    """Repeat key heads to value heads, tiled: output head h is input head h % n_k.

    x: [T, n_k, d] → [T, n_v, d]. GGUF qwen35 files store value heads in tiled order (the
    converter reorders them); ggml's fused kernel reads ``iq1 = iv1 % neq1`` and the unfused path
    uses ``ggml_repeat_4d`` (also tiling). Source: ggml-cpu ``ops.cpp``
    ``ggml_compute_forward_gated_delta_net_one_chunk``.
    """
    n_k = x.shape[1]
    if n_v % n_k:
        raise ValueError(f"n_v={n_v} is not a multiple of n_k={n_k}")
    return np.tile(x, (1, n_v // n_k, 1))


def gated_delta_rule_recurrent(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    g: np.ndarray,
    beta: np.ndarray,
    state: np.ndarray,
    scale: float | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Gated delta rule, token by token (the definition).

    q, k: [T, H, d_k] (already L2-normalised, one per value head); v: [T, H, d_v]; g, beta: [T, H]
    (log-decay and write strength); state: [H, d_k, d_v] (S_h, the initial state). scale defaults
    to 1/sqrt(d_k). Returns (o [T, H, d_v], final state [H, d_k, d_v]); inputs are not modified.

    Per token t and head h:  S ← exp(g)·S;  δ = β·(v − Sᵀk);  S ← S + k δᵀ;  o = Sᵀ(q·scale).
    Source: ggml-cpu ``ops.cpp`` ``ggml_compute_forward_gated_delta_net_one_chunk`` (it multiplies
    the output by 1/sqrt(S_v) where the unfused graph scales q by 1/sqrt(S_k); S_k == S_v there);
    transformers ``torch_recurrent_gated_delta_rule``.
    """
    t_len, _, d_k = q.shape
    scale = 1.0 / np.sqrt(d_k) if scale is None else scale
    s = state.copy()
    o = np.empty(v.shape, dtype=np.float64)
    for t in range(t_len):
        s *= np.exp(g[t])[:, None, None]
        delta = beta[t][:, None] * (v[t] - np.einsum("hk,hkv->hv", k[t], s))
        s += k[t][:, :, None] * delta[:, None, :]
        o[t] = np.einsum("hk,hkv->hv", q[t] * scale, s)
    return o, s


GDN_CHUNK_SIZE = 64


def gated_delta_rule_chunked(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    g: np.ndarray,
    beta: np.ndarray,
    state: np.ndarray,
    scale: float | None = None,
    chunk_size: int = GDN_CHUNK_SIZE,
) -> tuple[np.ndarray, np.ndarray]:
    """Gated delta rule, chunk-parallel (WY / UT-transform form), equal to the recurrent form.

    Same arguments, shapes and result as ``gated_delta_rule_recurrent``; chunk_size is 64 as in
    transformers ``torch_chunk_gated_delta_rule``, fla ``chunk_gated_delta_rule`` and llama.cpp
    ``delta-net-base.cpp`` ``build_delta_net_chunking``. A short last chunk is processed at its own
    length (padding with zero k, v, β and g would leave the state unchanged, so this is the same).

    Within a chunk with cumulative log-decay γ_t = Σ_{s≤t} g_s and start state S₀, the writes
    u_t = δ_t solve the unit lower-triangular system (I + A) U = βV − β·e^γ·K S₀ with
    A[t, s] = β_t e^{γ_t−γ_s} k_t·k_s (s < t); then
    o_t = e^{γ_t} S₀ᵀq_t + Σ_{s≤t} e^{γ_t−γ_s} (q_t·k_s) u_s and
    S_end = e^{γ_L} S₀ + Σ_s e^{γ_L−γ_s} k_s u_sᵀ.
    Exponents are masked to s ≤ t before ``exp`` so no term overflows (transformers takes the
    ``tril`` before ``exp`` for the same reason).
    """
    t_len, _, d_k = q.shape
    scale = 1.0 / np.sqrt(d_k) if scale is None else scale
    s = state.copy()
    o = np.empty(v.shape, dtype=np.float64)
    for start in range(0, t_len, chunk_size):
        end = min(start + chunk_size, t_len)
        n = end - start
        qc = q[start:end].transpose(1, 0, 2) * scale  # [H, n, d_k]
        kc = k[start:end].transpose(1, 0, 2)  # [H, n, d_k]
        vc = v[start:end].transpose(1, 0, 2)  # [H, n, d_v]
        bc = beta[start:end].T[:, :, None]  # [H, n, 1]
        gamma = np.cumsum(g[start:end].T, axis=1)  # [H, n]
        causal = np.tril(np.ones((n, n), dtype=bool))  # s <= t
        decay = np.where(causal, np.exp(np.where(causal, gamma[:, :, None] - gamma[:, None, :], 0.0)), 0.0)
        a = np.tril(bc * (kc @ kc.transpose(0, 2, 1)) * decay, -1)  # [H, n, n], strictly lower
        rhs = np.concatenate([bc * vc, bc * kc * np.exp(gamma)[:, :, None]], axis=2)
        w = _unit_lower_solve(a, rhs)
        u = w[:, :, : vc.shape[2]] - w[:, :, vc.shape[2] :] @ s  # [H, n, d_v]
        o[start:end] = ((qc * np.exp(gamma)[:, :, None]) @ s + ((qc @ kc.transpose(0, 2, 1)) * decay) @ u).transpose(1, 0, 2)
        k_to_end = kc * np.exp(gamma[:, -1:] - gamma)[:, :, None]  # [H, n, d_k]
        s = np.exp(gamma[:, -1])[:, None, None] * s + k_to_end.transpose(0, 2, 1) @ u
    return o, s


def _unit_lower_solve(a: np.ndarray, rhs: np.ndarray) -> np.ndarray:
    """Solve (I + a) x = rhs by forward substitution; a: [H, n, n] strictly lower, rhs: [H, n, m].

    The row loop is the one transformers writes for (I + A)⁻¹; vectorised across heads.
    """
    x = rhs.copy()
    for i in range(1, a.shape[1]):
        x[:, i] -= np.einsum("hj,hjm->hm", a[:, i, :i], x[:, :i])
    return x


# ---------------------------------------------------------------------------------------------
# Gated attention
# ---------------------------------------------------------------------------------------------


def split_query_gate(q_full: np.ndarray, n_head: int, head_dim: int) -> tuple[np.ndarray, np.ndarray]:
    """Split the joint ``attn_q`` output into query and output gate, interleaved per head.

    q_full: [T, 2·n_head·head_dim], laid out per head as [query (head_dim) | gate (head_dim)].
    Returns (query [T, n_head, head_dim], gate [T, n_head, head_dim]). Source: llama.cpp
    ``qwen35.cpp`` ``build_layer_attn`` (two ``ggml_view_3d`` with row stride 2·head_dim, offsets
    0 and head_dim); transformers ``Qwen3_5Attention`` (``view(..., -1, head_dim*2).chunk(2)``).
    """
    qg = q_full.reshape(q_full.shape[0], n_head, 2 * head_dim)
    return qg[:, :, :head_dim], qg[:, :, head_dim:]


def imrope_positions(pos: np.ndarray, n_rot: int, sections: Sequence[int]) -> np.ndarray:
    """Per rotary pair, the position IMROPE rotates a text token by.

    pos: [T] token positions. Returns [T, n_rot/2] float64. llama.cpp's qwen35 rope type is
    ``LLAMA_ROPE_TYPE_IMROPE`` (``llama-model.cpp``); ggml-cpu ``ops.cpp`` ``ggml_mrope_cache_init``
    gives pair i the sector ``i % sum(sections)`` and takes its position from stream
    t if sector % 3 == 0 and sector < 3·sections[0], h if % 3 == 1 and < 3·sections[1],
    w if % 3 == 2 and < 3·sections[2], else e. For text tokens llama.cpp sets t = h = w = pos and
    e = 0 (``llama-graph.cpp`` ``llm_graph_input_pos::set_input``), so a pair is rotated by pos
    unless it falls in the e stream, where it is not rotated. With sections [11, 11, 10, 0] and
    n_rot = 64 every pair is t/h/w, and IMROPE is exactly NeoX partial rotary.
    """
    sect_dims = int(sum(sections))
    if sect_dims <= 0:
        raise ValueError(f"rope.dimension_sections {list(sections)} sum to 0; IMROPE needs at least one section")
    sector = np.arange(n_rot // 2) % sect_dims
    s0, s1, s2 = int(sections[0]), int(sections[1]), int(sections[2])
    text_stream = (
        ((sector % 3 == 0) & (sector < 3 * s0))
        | ((sector % 3 == 1) & (sector < 3 * s1))
        | ((sector % 3 == 2) & (sector < 3 * s2))
    )
    return np.where(text_stream[None, :], np.asarray(pos, dtype=np.float64)[:, None], 0.0)


def rope_neox_partial(x: np.ndarray, pair_pos: np.ndarray, n_rot: int, freq_base: float) -> np.ndarray:
    """NeoX-style rotary embedding on the first n_rot dims of each head; the rest pass through.

    x: [T, H, D]; pair_pos: [T, n_rot/2] position per pair (``imrope_positions``) or [T].
    Pair i is (i, i + n_rot/2), rotated by angle pos · freq_base^(−2i/n_rot). Source: ggml-cpu
    ``ops.cpp`` ``rotate_pairs`` (n_offset = n_dims/2 for NEOX/MROPE/IMROPE) and
    ``theta_scale = powf(freq_base, -2.0f/n_dims)``; transformers ``apply_rotary_pos_emb`` with
    ``partial_rotary_factor``.
    """
    half = n_rot // 2
    pair_pos = np.asarray(pair_pos, dtype=np.float64)
    if pair_pos.ndim == 1:
        pair_pos = np.repeat(pair_pos[:, None], half, axis=1)
    theta = pair_pos * freq_base ** (-2.0 * np.arange(half) / n_rot)  # [T, half]
    cos, sin = np.cos(theta)[:, None, :], np.sin(theta)[:, None, :]
    x1, x2 = x[..., :half], x[..., half:n_rot]
    return np.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos, x[..., n_rot:]], axis=-1)


ATTENTION_SCORE_BYTES = 64 << 20
"""The most bytes one float64 score block ``[H_kv, G, Tq_chunk, Tk]`` of ``causal_attention`` may
take: queries are taken in chunks of ``max(1, ATTENTION_SCORE_BYTES // (8·H·Tk))`` rows, so at 32,768
positions and 4 heads a chunk is 64 queries (64 MiB) where the whole ``[H, T, T]`` would be 32 GiB."""


def causal_attention(
    q: np.ndarray, k: np.ndarray, v: np.ndarray, q_pos: np.ndarray, k_pos: np.ndarray, scale: float
) -> np.ndarray:
    """Causal softmax attention with grouped-query heads, the queries taken in chunks.

    q: [Tq, H, D]; k: [Tk, H_kv, D]; v: [Tk, H_kv, D_v]; q_pos: [Tq], k_pos: [Tk] positions (query
    t sees keys with k_pos ≤ q_pos[t]). Returns [Tq, H, D_v] float64. Query head i uses KV head
    i // (H / H_kv) (ggml ``mul_mat`` broadcast ``i02 = i12 / r2``; flash attention
    ``ik2 = iq2 / rk2``). scale is 1/sqrt(head_dim) for qwen35 (``build_layer_attn`` ``kq_scale``).
    Each query row's softmax is its own, so query chunks of at most ``ATTENTION_SCORE_BYTES`` of
    scores give the unchunked values (each row the same reductions in the same order; tested bit
    for bit in tests/test_oracle_math.py) while memory stays bounded at any length.
    Raises ``ValueError`` when H is not a multiple of H_kv.
    Source: llama.cpp ``llm_graph_context::build_attn``; transformers ``eager_attention_forward``.
    """
    t_q, n_head, _ = q.shape
    n_kv = k.shape[1]
    if n_head % n_kv:
        raise ValueError(f"n_head={n_head} is not a multiple of n_head_kv={n_kv}")
    rows = max(1, ATTENTION_SCORE_BYTES // (8 * n_head * max(1, k.shape[0])))
    if t_q <= rows:
        return attention_rows(q, k, v, q_pos, k_pos, scale)
    out = np.empty((t_q, n_head, v.shape[2]), np.result_type(q, k, v, np.float64))
    for a in range(0, t_q, rows):
        out[a:a + rows] = attention_rows(q[a:a + rows], k, v, q_pos[a:a + rows], k_pos, scale)
    return out


def attention_rows(
    q: np.ndarray, k: np.ndarray, v: np.ndarray, q_pos: np.ndarray, k_pos: np.ndarray, scale: float
) -> np.ndarray:
    """``causal_attention`` for one chunk of queries, holding its whole ``[H_kv, G, Tq, Tk]`` score
    block: shapes, sources and errors as ``causal_attention`` (whose caller checks H % H_kv)."""
    t_q, n_head, d = q.shape
    n_kv = k.shape[1]
    qg = q.reshape(t_q, n_kv, n_head // n_kv, d)  # head i = kv * group + j
    scores = np.einsum("tkgd,skd->kgts", qg, k) * scale  # [H_kv, G, Tq, Tk]
    visible = k_pos[None, :] <= q_pos[:, None]  # [Tq, Tk]
    scores = np.where(visible, scores, -np.inf)
    p = np.exp(scores - scores.max(axis=-1, keepdims=True))
    p /= p.sum(axis=-1, keepdims=True)
    out = np.einsum("kgts,skd->tkgd", p, v)  # [Tq, H_kv, G, D_v]
    return out.reshape(t_q, n_head, v.shape[2])


# ---------------------------------------------------------------------------------------------
# Feed-forward
# ---------------------------------------------------------------------------------------------


def swiglu(x: np.ndarray, w_gate: np.ndarray, w_up: np.ndarray, w_down: np.ndarray) -> np.ndarray:
    """SwiGLU FFN: down(silu(gate · x) ⊙ up · x).

    x: [T, d]; w_gate, w_up: [ff, d] (``ffn_gate``, ``ffn_up``); w_down: [d, ff]. Returns [T, d].
    Source: llama.cpp ``build_ffn`` with ``LLM_FFN_SILU, LLM_FFN_PAR``; transformers
    ``Qwen3_5MLP``.
    """
    return (silu(x @ w_gate.T) * (x @ w_up.T)) @ w_down.T


# ---------------------------------------------------------------------------------------------
# The model
# ---------------------------------------------------------------------------------------------


class _Recorder:
    """Checks every intermediate for non-finite values and keeps the wanted ones.

    ``names`` None keeps nothing (logits only); ``ALL`` keeps everything; otherwise a collection
    of exact activation names (``attn_norm-3``) or bare op names (``attn_norm``: every layer).
    """

    ALL = object()

    def __init__(self, names: Any):
        self.names = names
        self.kept: dict[str, list[np.ndarray]] = {}
        self.last = "(start)"

    def __call__(self, name: str, il: int, x: np.ndarray) -> np.ndarray:
        full = f"{name}-{il}" if il >= 0 else name
        if not np.all(np.isfinite(x)):
            bad = np.argwhere(~np.isfinite(np.asarray(x, dtype=np.float64)))[0]
            where = f"layer {il}" if il >= 0 else "output"
            raise EngineError(
                f"oracle: non-finite value in {full!r} ({where}, op {name}) at index {tuple(int(i) for i in bad)}"
                f"; the last finite op was {self.last!r}"
            )
        self.last = full
        if self.names is not None and (self.names is _Recorder.ALL or full in self.names or name in self.names):
            self.kept.setdefault(full, []).append(np.array(x, copy=True))
        return x

    def result(self) -> dict[str, np.ndarray]:
        return {k: np.concatenate(v, axis=0) for k, v in self.kept.items()}


class Qwen35Oracle:
    """Exact float64 forward of a ``qwen35`` GGUF; an engine named ``oracle``.

    model: a ``harness.model.gguf_model.GGUFModel`` (or a path to one). Weights are dequantized by
    ``gguf.quants`` one layer at a time and released after it, so peak memory is about one layer
    in float64 plus the [T, n_embd] residual stream (the output matrix is read in vocab slices when
    it is large). The prompt is processed layer by layer over the whole sequence; with ``chunks``
    each layer is run piece by piece with its state carried (conv state: the last
    conv_kernel − 1 inputs; recurrent state S per value head; K and V of earlier pieces), so
    pieces equal the whole. MTP (nextn) blocks are not part of the main forward (llama.cpp
    ``qwen35.cpp``: "MTP/NextN layers are loaded as extra decoder blocks but not executed").

    Errors: ``EngineError`` for non-finite intermediates (naming layer and op), out-of-range token
    ids, bad chunk lengths or missing tensors; ``InvalidInput`` from ``GGUFModel`` for bad files.
    """

    # Pure steps, called through self so a mutant can replace one (``rmsnorm = staticmethod(f)``).
    sigmoid = staticmethod(sigmoid)
    silu = staticmethod(silu)
    softplus = staticmethod(softplus)
    rmsnorm = staticmethod(rmsnorm)
    rmsnorm_gated = staticmethod(rmsnorm_gated)
    l2norm = staticmethod(l2norm)
    causal_conv1d = staticmethod(causal_conv1d)
    gdn_gate = staticmethod(gdn_gate)
    tile_k_heads = staticmethod(tile_k_heads)
    gated_delta_rule_recurrent = staticmethod(gated_delta_rule_recurrent)
    gated_delta_rule_chunked = staticmethod(gated_delta_rule_chunked)
    split_query_gate = staticmethod(split_query_gate)
    imrope_positions = staticmethod(imrope_positions)
    rope = staticmethod(rope_neox_partial)
    causal_attention = staticmethod(causal_attention)
    swiglu = staticmethod(swiglu)

    arch = "qwen35"
    gdn_chunk_size = GDN_CHUNK_SIZE
    logit_block = 256
    # The output matrix is dequantized once and kept as float32 (exact: every non-F64 GGUF type
    # dequantizes to float32 values) while it takes at most this many bytes; a larger one is
    # dequantized slice by slice for every block of positions.
    output_cache_bytes = 2 << 30
    # Kept as float64 instead while that takes at most this many bytes (the same values).
    output_cache_f64_bytes = 512 << 20
    # Vocabulary rows per BLAS call of the output projection (one float64 dgemm each).
    output_slice_rows = 16384
    # A session (free-running generation, prefix-reuse sessions) keeps every layer's weights
    # dequantized to float64 while they take at most this many bytes; for a larger model the
    # oracle refuses a session (EngineError: report-only generation is then unmeasured) rather
    # than hold the whole model in float64 (Qwen3.5-0.8B's shapes: 6 GB).
    session_weights_bytes = 1 << 30

    def __init__(self, model: Any):
        from harness.model.gguf_model import GGUFModel

        self.model = model if isinstance(model, GGUFModel) else GGUFModel(model)
        self.hp = self.model.hparams
        if self.hp.arch != self.arch:
            raise EngineError(f"oracle: {type(self).__name__} computes {self.arch!r}, the model is {self.hp.arch!r}")
        self._output_name = "output.weight" if self.model.has_tensor("output.weight") else "token_embd.weight"
        self._output_cache: np.ndarray | None = None
        self._lm_scratch: np.ndarray | None = None

    # -- engine protocol ----------------------------------------------------------------------
    @property
    def info(self) -> EngineInfo:
        return EngineInfo(
            name="oracle",
            version=f"{self.arch}-float64 (numpy {np.__version__})",
            settings={
                "dtype": "float64",
                "gdn_chunk_size": self.gdn_chunk_size,
                "gdn_form": f"chunked for pieces >= {self.gdn_chunk_size} tokens, else recurrent",
                "softplus_threshold": SOFTPLUS_THRESHOLD,
                "model_sha256": self.model.sha256,
                **({"mtp_convention": self.mtp_convention} if self.has_mtp() else {}),
            },
            capabilities=["chunks", "activations", "generate", "serve", "dequantized_weights"] + (["mtp", MTP_CHAIN, "speculative"] if self.has_mtp() else []),
            build={"engine": type(self).__module__ + "." + type(self).__qualname__},
            compute_class="f64",
        )

    @property
    def n_vocab(self) -> int:
        return int(self.model.tensor_info(self._output_name).ne[1])

    logits_first_row = True
    """``logits`` takes ``first_row`` (``harness.engines.base.logits_each``)."""

    def logits(self, tokens: Sequence[int], chunks: Sequence[int] | None = None, first_row: int = 0) -> Iterator[LogitBlock]:
        """Yield ``(start, float32 [B, V])`` logit blocks; row t follows ``tokens[:t+1]``.
        ``first_row``: positions ``first_row`` .. T − 1 alone (the LM head is applied to those
        hidden states only; every position is still run through the layers)."""
        h = self._forward(tokens, chunks, _Recorder(None))
        for start in range(max(0, int(first_row)), h.shape[0], self.logit_block):
            yield start, self.lm_head(h[start : start + self.logit_block], np.float32)

    def activations(
        self, tokens: Sequence[int], chunks: Sequence[int] | None = None, names: Collection[str] | None = None
    ) -> dict[str, np.ndarray]:
        """Intermediate tensors under llama.cpp's graph names, position-major float64 ``[T, ...]``.

        ``names`` limits what is kept (exact names like ``l_out-3`` or op names like ``l_out``);
        None keeps everything, including ``result_output`` [T, V]. Names and contents follow the
        ``cb()`` calls of llama.cpp ``src/models/qwen35.cpp`` (MoE: ``qwen35moe.cpp``); where
        llama.cpp names a tensor twice (``Qcur``, ``Kcur``, ``Vcur``) the value is the last one
        (after RoPE). Shapes: vectors per token are [T, n], per-head tensors [T, heads, dim]
        (llama.cpp's size-1 axes are dropped, e.g. ``beta`` is [T, n_v]); compare across engines
        after reshaping both to [T, -1]. ``attn_output-N`` is the raw delta-rule output
        [T, n_v, d_v] in a DeltaNet layer and the projected output [T, n_embd] in an attention
        layer, as in llama.cpp.
        """
        rec = _Recorder(_Recorder.ALL if names is None else set(names))
        h = self._forward(tokens, chunks, rec)
        if names is None or "result_output" in names:
            rec("result_output", -1, self.lm_head(h, np.float64))
        return rec.result()

    def recorder(self, names: Any = None) -> _Recorder:
        """The ``emit`` callback ``_forward`` uses: checks every intermediate for non-finite
        values, keeps those named by ``names`` (None: nothing)."""
        return _Recorder(names)

    def session(self) -> Any:
        """A fresh ``harness.engines.oracle.session.OracleSession``: one sequence whose state is
        kept between calls (free-running generation, prefix-reuse sessions). Raises
        ``EngineError`` when its weights (``session_bytes``) exceed ``session_weights_bytes``."""
        from harness.engines.oracle.session import OracleSession

        need = self.session_bytes()
        if need > self.session_weights_bytes:
            raise EngineError(f"oracle: a session keeps every layer's weights dequantized to float64 ({need / 2**20:,.0f} MiB for this "
                              f"model, over the oracle's {self.session_weights_bytes / 2**20:,.0f} MiB bound), so this oracle cannot "
                              "generate or keep a session on it; its logits stream layer by layer and are unaffected")
        return OracleSession(self)

    def session_bytes(self) -> int:
        """Bytes a session's weights take: every ``blk.*`` tensor's elements × 8 (float64)."""
        return sum(8 * int(np.prod(self.model.tensor_info(n).ne)) for n in self.model.tensor_names if n.startswith("blk."))

    def generate(self, tokens: Sequence[int], n_tokens: int) -> list[int]:
        """Greedy free-running continuation (capability ``generate``, ``harness.engines.base.Engine``):
        the prompt fed whole, then each argmax fed back one token per call with the state
        carried; returns ``n_tokens`` ids (the oracle has no end-of-generation stop)."""
        from harness.engines.oracle.session import greedy_continue

        return greedy_continue(self.session(), tokens, n_tokens)

    serve_faults: dict[str, Any] = {}
    """The serving scheduler's deviations (none: the correct baseline); a serving mutant sets one
    (``harness.engines.oracle.serving.ServingScheduler``)."""

    def serve(self, scenario: Any) -> Any:
        """Run a ``harness.engines.serving.ServeScenario`` through the oracle's own scheduler
        (capability ``serve``): slots, continuous batching, a prefix cache of states on a 64-token
        grid, abort and continuation (``harness.engines.oracle.serving``). Returns a
        ``ServeResult``; raises ``EngineError`` as ``session`` does."""
        from harness.engines.oracle.serving import ServingScheduler

        return ServingScheduler(self, self.serve_faults).run(scenario)

    # -- forward ------------------------------------------------------------------------------
    def _forward(self, tokens: Sequence[int], chunks: Sequence[int] | None, emit: _Recorder) -> np.ndarray:
        """Run the trunk; returns ``result_norm`` [T, n_embd]."""
        hp = self.hp
        tokens = np.asarray(tokens, dtype=np.int64)
        pieces = validate_chunks(len(tokens), chunks)
        bounds = np.cumsum([0] + pieces)
        with np.errstate(over="raise", invalid="raise", divide="raise", under="ignore"):
            h = emit("model.input_embed", -1, self.embed(tokens))
            for il in range(hp.n_layer):
                kind = "gated delta net" if hp.is_recurrent(il) else "gated attention"
                try:
                    w = self.load_layer(il)
                    state = self.init_state(il, w)
                    for s, e in zip(bounds[:-1], bounds[1:]):
                        h[s:e] = self.block(il, w, h[s:e], state, np.arange(s, e), emit)
                    del w, state
                except FloatingPointError as err:
                    raise EngineError(
                        f"oracle: floating-point {err} in layer {il} ({kind}) after op {emit.last!r}"
                    ) from None
            return self.result_norm(h, emit)

    def result_norm(self, h: np.ndarray, emit: _Recorder) -> np.ndarray:
        """The final RMSNorm (``output_norm``) of the trunk's output h [T, n_embd], recorded as
        ``result_norm``; a floating-point fault is an ``EngineError`` naming output_norm."""
        try:
            return emit("result_norm", -1, self.rmsnorm(h, self.read_tensor("output_norm.weight"), self.hp.rms_eps))
        except FloatingPointError as err:
            raise EngineError(f"oracle: floating-point {err} in output_norm") from None

    def embed(self, tokens: np.ndarray) -> np.ndarray:
        """Rows of ``token_embd`` for ``tokens``: [T, n_embd] float64."""
        n_vocab = int(self.model.tensor_info("token_embd.weight").ne[1])
        if len(tokens) == 0:
            raise EngineError("oracle: no tokens to evaluate")
        if tokens.min() < 0 or tokens.max() >= n_vocab:
            bad = int(tokens[(tokens < 0) | (tokens >= n_vocab)][0])
            raise EngineError(f"oracle: token id {bad} is outside the vocabulary [0, {n_vocab})")
        uniq, inv = np.unique(tokens, return_inverse=True)
        return self.read_tensor("token_embd.weight", uniq)[inv.reshape(-1)]

    def block(
        self, il: int, w: dict[str, np.ndarray], x: np.ndarray, state: dict[str, Any], pos: np.ndarray, emit: _Recorder
    ) -> np.ndarray:
        """One pre-norm residual block on a piece x [T, n_embd] at positions pos [T].

        Hooks a mutant may override: ``mixer`` (the token mixer) and ``residual_input`` (what
        the attention residual adds the mixer output to). Source: llama.cpp ``qwen35.cpp``
        ``build`` (per-layer loop).
        """
        eps = self.hp.rms_eps
        cur = emit("attn_norm", il, self.rmsnorm(x, w["attn_norm"], eps))
        mixed = self.mixer(il, w, cur, state, pos, emit)
        resid = emit("attn_residual", il, mixed + self.residual_input(x, cur))
        post = emit("attn_post_norm", il, self.rmsnorm(resid, w["post_attention_norm"], eps))
        ffn = emit("ffn_out", il, self.ffn(il, w, post, emit))
        out = emit(self.post_ffn_name, il, ffn + resid)
        return emit("l_out", il, out)

    post_ffn_name = "post_ffn"  # qwen35moe.cpp calls the same sum "post_moe"

    def mixer_kind(self, il: int, w: dict[str, np.ndarray]) -> str:
        """``"recurrent"`` (Gated DeltaNet) or ``"attention"`` (gated full attention) for layer il,
        from the file's schedule (llama.cpp ``hparams.is_recurrent(il)``)."""
        return "recurrent" if self.hp.is_recurrent(il) else "attention"

    def mixer(
        self, il: int, w: dict[str, np.ndarray], x: np.ndarray, state: dict[str, Any], pos: np.ndarray, emit: _Recorder
    ) -> np.ndarray:
        """The token mixer of layer il (by ``mixer_kind``) on the normed piece x [T, n_embd]."""
        kind = self.mixer_kind(il, w)
        if kind == "recurrent":
            return self.gated_delta_net(il, w, x, state, emit)
        if kind == "attention":
            return self.gated_attention(il, w, x, state, pos, emit)
        raise EngineError(f"oracle: layer {il}: no token mixer of kind {kind!r}")

    def residual_input(self, x: np.ndarray, normed: np.ndarray) -> np.ndarray:
        """What the attention residual adds the mixer output to: the block input x (not the
        normed ``attn_norm``). x, normed: [T, n_embd]."""
        return x

    def gated_delta_net(
        self, il: int, w: dict[str, np.ndarray], x: np.ndarray, state: dict[str, Any], emit: _Recorder
    ) -> np.ndarray:
        """Gated DeltaNet mixer on x [T, n_embd]; updates ``state`` (conv, ssm) in place.

        Source: llama.cpp ``qwen35.cpp`` ``build_layer_attn_linear``; transformers
        ``Qwen3_5GatedDeltaNet``.
        """
        hp = self.hp
        n_k, n_v, d_k, d_v, eps = hp.ssm_n_group, hp.ssm_dt_rank, hp.ssm_d_state, hp.head_v_dim, hp.rms_eps
        t = x.shape[0]
        mixed = emit("linear_attn_qkv_mixed", il, x @ w["attn_qkv"].T)  # [T, conv_dim]
        z = emit("z", il, x @ w["attn_gate"].T)  # [T, n_v·d_v]
        beta = emit("beta", il, x @ w["ssm_beta"].T)  # [T, n_v]
        beta = emit("beta_sigmoid", il, self.sigmoid(beta))
        alpha = emit("alpha", il, x @ w["ssm_alpha"].T)  # [T, n_v]
        emit("a_softplus", il, self.softplus(alpha + w["ssm_dt.bias"]))
        g = emit("gate", il, self.gdn_gate(alpha, w["ssm_dt.bias"], w["ssm_a"]))  # [T, n_v]
        conv, state["conv"] = self.causal_conv1d(mixed, w["ssm_conv1d"], state["conv"])
        emit("conv_output_raw", il, conv)
        conv = emit("conv_output_silu", il, self.silu(conv))
        q = emit("q_conv", il, conv[:, : n_k * d_k].reshape(t, n_k, d_k))
        k = emit("k_conv", il, conv[:, n_k * d_k : 2 * n_k * d_k].reshape(t, n_k, d_k))
        v = emit("v_conv", il, conv[:, 2 * n_k * d_k :].reshape(t, n_v, d_v))
        q = emit("q_conv_predelta", il, self.l2norm(q, eps))  # n_k heads: llama.cpp's fused path
        k = emit("k_conv_predelta", il, self.l2norm(k, eps))  # does not repeat them
        emit("v_conv_predelta", il, v)
        o, state["ssm"] = self.gated_delta_rule(self.tile_k_heads(q, n_v), self.tile_k_heads(k, n_v), v, g, beta, state["ssm"])
        emit("attn_output", il, o)  # [T, n_v, d_v]; delta-net-base.cpp build_recurrent_attn
        o = self.rmsnorm_gated(o, w["ssm_norm"], z.reshape(t, n_v, d_v), eps)
        final = emit("final_output", il, o.reshape(t, n_v * d_v))
        return emit("linear_attn_out", il, final @ w["ssm_out"].T)

    def gated_delta_rule(self, q, k, v, g, beta, s):
        """The chunked form for pieces of at least one chunk, the recurrent form otherwise.

        Runs with one BLAS thread: both forms are many small matrix products (one per head and
        chunk), where waking a second BLAS thread costs more than it saves (about 20x slower on
        a loaded 2-core machine at Qwen3.5-0.8B's 16 heads x 128 x 128). The values are the same
        bit for bit (``tests/test_oracle_pinned.py``).
        """
        with _blas_controller().limit(limits=1, user_api="blas"):
            if q.shape[0] >= self.gdn_chunk_size:
                return self.gated_delta_rule_chunked(q, k, v, g, beta, s, chunk_size=self.gdn_chunk_size)
            return self.gated_delta_rule_recurrent(q, k, v, g, beta, s)

    def gated_attention(
        self, il: int, w: dict[str, np.ndarray], x: np.ndarray, state: dict[str, Any], pos: np.ndarray, emit: _Recorder
    ) -> np.ndarray:
        """Gated full attention on x [T, n_embd] at positions pos; appends K, V to ``state``.

        Source: llama.cpp ``qwen35.cpp`` ``build_layer_attn``; transformers ``Qwen3_5Attention``.
        """
        hp = self.hp
        n_head, n_kv, hd, eps = hp.n_head, hp.n_head_kv, hp.head_dim, hp.rms_eps
        t = x.shape[0]
        if "attn_qkv" in w:  # fused projection (llama.cpp create_tensor_qkv accepts either)
            qkv = x @ w["attn_qkv"].T + w.get("attn_qkv.bias", 0.0)
            q_full, k, v = np.split(qkv, [2 * n_head * hd, 2 * n_head * hd + n_kv * hd], axis=1)
        else:
            q_full = x @ w["attn_q"].T + w.get("attn_q.bias", 0.0)
            k = x @ w["attn_k"].T + w.get("attn_k.bias", 0.0)
            v = x @ w["attn_v"].T + w.get("attn_v.bias", 0.0)
        emit("Qcur_full", il, q_full)
        q, gate = self.split_query_gate(q_full, n_head, hd)
        q = emit("Qcur_normed", il, self.rmsnorm(q, w["attn_q_norm"], eps))
        k = emit("Kcur_normed", il, self.rmsnorm(k.reshape(t, n_kv, hd), w["attn_k_norm"], eps))
        gate = emit("gate_reshaped", il, gate.reshape(t, n_head * hd))
        v = v.reshape(t, n_kv, hd)
        pair_pos = self.imrope_positions(pos, hp.n_rot, hp.rope_sections)
        q = emit("Qcur", il, self.rope(q, pair_pos, hp.n_rot, hp.rope_freq_base))
        k = emit("Kcur", il, self.rope(k, pair_pos, hp.n_rot, hp.rope_freq_base))
        emit("Vcur", il, v)
        state["k"].append(k)
        state["v"].append(v)
        state["pos"].append(pos)
        attn = self.causal_attention(
            q, np.concatenate(state["k"]), np.concatenate(state["v"]), pos, np.concatenate(state["pos"]), 1.0 / np.sqrt(hd)
        )
        attn = emit("attn_pregate", il, attn.reshape(t, n_head * hd))
        gate = emit("gate_sigmoid", il, self.sigmoid(gate))
        attn = emit("attn_gated", il, attn * gate)
        return emit("attn_output", il, attn @ w["attn_output"].T)

    def ffn(self, il: int, w: dict[str, np.ndarray], x: np.ndarray, emit: _Recorder) -> np.ndarray:
        """Dense SwiGLU FFN (qwen35). Source: llama.cpp ``qwen35.cpp`` ``build_layer_ffn``."""
        return self.swiglu(x, w["ffn_gate"], w["ffn_up"], w["ffn_down"])

    # -- the MTP (nextn) draft head ------------------------------------------------------------
    mtp_convention = "llama.cpp"  # or "vllm" (harness.engines.base.MTP_CONVENTIONS)

    def has_mtp(self) -> bool:
        """True when the file holds an MTP block the head can run (``blk.N.nextn.eh_proj``, N = n_layer)."""
        return self.hp.n_layer_nextn >= 1 and self.model.has_tensor(f"blk.{self.hp.n_layer}.nextn.eh_proj.weight")

    def mtp_layer(self) -> int:
        """The block index of the MTP head: ``n_layer`` (the first block after the trunk). Raises
        ``EngineError`` when the file has no nextn block."""
        il = self.hp.n_layer
        if not self.has_mtp():
            raise EngineError(f"oracle: the model has no MTP (nextn) block: blk.{il}.nextn.eh_proj is absent "
                              f"(nextn_predict_layers {self.hp.n_layer_nextn})")
        return il

    def mtp_weights(self, il: int) -> dict[str, np.ndarray]:
        """The MTP block's tensors (``load_layer``) without its vocabulary-sized ones
        (``nextn.embed_tokens``, ``nextn.shared_head_head``), which are read by rows or sliced."""
        prefix = f"blk.{il}."
        w = _LayerWeights(il)
        for name in self.model.tensor_names:
            if name.startswith(prefix) and not name.startswith((prefix + "nextn.embed_tokens", prefix + "nextn.shared_head_head")):
                w[name[len(prefix) :].removesuffix(".weight")] = self.read_tensor(name)
        return w

    def mtp_embed(self, il: int, tokens: np.ndarray) -> np.ndarray:
        """E[x] [R, n_embd]: rows of ``blk.N.nextn.embed_tokens`` when the file has it, else of
        ``token_embd`` (llama.cpp ``graph_mtp``, ``mtp_tok_embd``)."""
        name = f"blk.{il}.nextn.embed_tokens.weight"
        if not self.model.has_tensor(name):
            return self.embed(tokens)
        uniq, inv = np.unique(tokens, return_inverse=True)
        return self.read_tensor(name, uniq)[inv.reshape(-1)]

    def mtp_rows(self, h: np.ndarray, tokens: np.ndarray, convention: str) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
        """The head's input rows for one sequence of T tokens with trunk hidden states h [T, n_embd]:
        ``(hidden [R, n_embd], tokens [R], positions [R], first_draft_row)``. ``vllm``: R = T − 1,
        row t = (h_t, x_{t+1}) at position t. ``llama.cpp``: R = T, row p = (h_{p−1}, x_p) at
        position p, with h_{−1} = 0 (the sentinel row 0 is not a draft: ``first_draft_row`` 1).
        Either way the draft rows, in order, predict tokens[2:]."""
        if convention == "vllm":
            return h[:-1], tokens[1:], np.arange(len(tokens) - 1), 0
        if convention == "llama.cpp":
            return np.vstack([np.zeros((1, h.shape[1])), h[:-1]]), tokens, np.arange(len(tokens)), 1
        raise EngineError(f"oracle: unknown MTP convention {convention!r} (one of {', '.join(MTP_CONVENTIONS)})")

    def mtp_hidden(self, h_prenorm: np.ndarray, h_normed: np.ndarray) -> np.ndarray:
        """What the head is fed as h_t: the trunk's state after ``output_norm`` (``h_nextn``,
        llama.cpp ``t_h_nextn``), not the raw last-layer output. A hook for mutants."""
        return h_normed

    def mtp_concat(self, e_norm: np.ndarray, h_norm: np.ndarray) -> np.ndarray:
        """[enorm(E[x]); hnorm(h)] [R, 2·n_embd]: embedding first, hidden second (llama.cpp
        ``ggml_concat(e_norm, h_norm)``; vLLM ``qwen3_5_mtp.py``). A hook for mutants."""
        return np.concatenate([e_norm, h_norm], axis=1)

    def mtp_head_norm(self, x: np.ndarray, il: int, w: dict[str, np.ndarray]) -> np.ndarray:
        """The head norm: ``nextn.shared_head_norm`` when the file has it, else ``output_norm``
        (llama.cpp ``graph_mtp`` falls back the same way). A hook for mutants."""
        weight = w["nextn.shared_head_norm"] if "nextn.shared_head_norm" in w else self.read_tensor("output_norm.weight")
        return self.rmsnorm(x, weight, self.hp.rms_eps)

    def mtp_state(self, il: int, w: dict[str, np.ndarray], state: dict[str, Any] | None) -> dict[str, Any]:
        """The head's KV state before the next piece of rows: the one carried from the previous
        piece (None: a fresh sequence). A hook for mutants (a KV not primed by chunked prefill)."""
        return self.init_state(il, w) if state is None else state

    def mtp_forward(self, h: np.ndarray, tokens: np.ndarray, pieces: Sequence[int], convention: str,
                    emit: _Recorder, keep: list | None = None) -> tuple[np.ndarray, int]:
        """The head over one sequence, fed in the trunk's pieces: returns ``(g [R, n_embd], first
        draft row)``, g = head_norm(B(u)) with u = eh_proj · [enorm(E[x]); hnorm(h)] and B the
        block's gated attention over its own KV (rows s ≤ r) and FFN. The rows of a trunk piece
        [s, e) are the rows whose inputs it completes (``vllm``: rows s−1 … e−2; ``llama.cpp``:
        rows s … e−1), so a chunked prefill fills the head's KV piece by piece as engines do.
        Named tensors as llama.cpp's ``graph_mtp`` (``mtp_enorm-N``, ``mtp_concat-N`` ...
        ``h_nextn``). ``keep``: when given, the head's K/V state after the last piece is appended
        to it (``draft_chain`` attends to its first rows). Source: llama.cpp
        ``src/models/qwen35.cpp`` ``graph_mtp``."""
        il, eps = self.mtp_layer(), self.hp.rms_eps
        w = self.mtp_weights(il)
        hid, x, pos, first = self.mtp_rows(h, tokens, convention)
        shift = 1 if convention == "vllm" else 0  # row r is complete once the trunk has seen token r + shift
        bounds = np.cumsum([0] + list(pieces))
        out = np.empty((len(x), self.hp.n_embd))
        state = None
        with np.errstate(over="raise", invalid="raise", divide="raise", under="ignore"):
            try:
                for s, e in zip(bounds[:-1], bounds[1:]):
                    r0, r1 = max(0, s - shift), max(0, min(len(x), e - shift))
                    if r1 <= r0:
                        continue
                    state = self.mtp_state(il, w, state)
                    e_tok = emit("mtp_tok_embd", il, self.mtp_embed(il, x[r0:r1]))
                    h_norm = emit("mtp_hnorm", il, self.rmsnorm(hid[r0:r1], w["nextn.hnorm"], eps))
                    e_norm = emit("mtp_enorm", il, self.rmsnorm(e_tok, w["nextn.enorm"], eps))
                    cat = emit("mtp_concat", il, self.mtp_concat(e_norm, h_norm))
                    u = emit("mtp_eh_proj", il, cat @ w["nextn.eh_proj"].T)
                    b = self.block(il, w, u, state, pos[r0:r1], emit)
                    out[r0:r1] = emit("h_nextn", -1, self.mtp_head_norm(b, il, w))
            except FloatingPointError as err:
                raise EngineError(f"oracle: floating-point {err} in the MTP block {il} after op {emit.last!r}") from None
        if keep is not None:
            keep.append(state)
        return out, first

    def mtp_logits(self, g: np.ndarray, il: int, dtype: Any = np.float32) -> np.ndarray:
        """D = W · g [R, V]: W is ``blk.N.nextn.shared_head_head`` when the file has it, else the
        trunk's LM head (``lm_head``)."""
        name = f"blk.{il}.nextn.shared_head_head.weight"
        if not self.model.has_tensor(name):
            return self.lm_head(g, dtype)
        with np.errstate(over="raise", invalid="raise"):
            out = g @ self.read_tensor(name).T
        if not np.isfinite(out).all():
            raise EngineError("oracle: non-finite draft logits in 'result_output' (nextn.shared_head_head)")
        return out.astype(dtype)

    def draft(self, tokens: Sequence[int], chunks: Sequence[int] | None = None, names: Collection[str] | None = None) -> Drafts:
        """Teacher-forced draft logits of the MTP head (capability ``mtp``, ``harness.engines.base.Engine``):
        ``Drafts.logits`` float32 [T−1, V], row t the head's logits for tokens[t+2] from the trunk's
        state after tokens[:t+1] and the embedding of tokens[t+1]; ``Drafts.hidden`` float32
        [T, n_embd], the h_t it was fed; ``Drafts.activations``: the head's named tensors in
        ``names`` (None: none). Rows follow ``mtp_convention``. Raises ``EngineError`` (no MTP
        block, fewer than 2 tokens, non-finite values)."""
        toks = np.asarray(tokens, dtype=np.int64)
        if len(toks) < 2:
            raise EngineError("oracle: draft logits need at least 2 tokens (row t predicts tokens[t+2])")
        pieces = validate_chunks(len(toks), chunks)
        last = f"l_out-{self.hp.n_layer - 1}"
        rec = _Recorder(set(names or ()) | {last})
        h_normed = self._forward(toks, pieces, rec)
        h = self.mtp_hidden(np.concatenate(rec.kept[last], axis=0), h_normed)
        g, first = self.mtp_forward(h, toks, pieces, self.mtp_convention, rec)
        logits = self.mtp_logits(g[first:], self.mtp_layer())
        acts = {} if names is None else {k: v for k, v in rec.result().items() if k in names or k.rsplit("-", 1)[0] in names}
        return Drafts(logits, h.astype(np.float32), acts)

    def draft_multi(self, sequences: Sequence[Sequence[int]]) -> list[Drafts]:
        """``draft`` of several sequences decoded together (capabilities ``mtp`` and
        ``multi_seq``): the oracle keeps one state per sequence, so each equals its solo run."""
        return [self.draft(q) for q in sequences]

    def mtp_chain_hidden(self, g: np.ndarray, h_step1: np.ndarray) -> np.ndarray:
        """What step 2 of a chained draft is fed as its hidden state: g, step 1's output (after
        the head norm: llama.cpp's ``draft-mtp`` driver chains the MTP context's ``t_h_nextn``),
        not ``h_step1``, the trunk's state step 1 was fed. A hook for mutants (vLLM PR #36531)."""
        return g

    def draft_chain(self, tokens: Sequence[int], draft_tokens: Sequence[int] | None = None) -> ChainedDrafts:
        """Teacher-forced drafts at depth 1 and 2 (capability ``mtp_chain``;
        ``harness.engines.base.ChainedDrafts``), the prompt fed whole: depth 1 is ``draft``'s;
        for draft row t (head row r at position r, ``mtp_rows``) step 2 is the row
        (``mtp_chain_hidden(g_r, h_r)``, d_t) at position r + 1 over the head's K/V rows ≤ r and
        itself. ``draft_tokens``: d_t for each of the T − 1 rows (None: argmax of depth 1's row t,
        ties to the lowest id). Raises ``EngineError`` (no MTP block, fewer than 2 tokens, a
        ``draft_tokens`` of another length or outside the vocabulary, non-finite values)."""
        toks = np.asarray(tokens, dtype=np.int64)
        if len(toks) < 2:
            raise EngineError("oracle: draft logits need at least 2 tokens (row t predicts tokens[t+2])")
        last = f"l_out-{self.hp.n_layer - 1}"
        rec = _Recorder({last})
        h_normed = self._forward(toks, [len(toks)], rec)
        h = self.mtp_hidden(np.concatenate(rec.kept[last], axis=0), h_normed)
        keep: list = []
        g, first = self.mtp_forward(h, toks, [len(toks)], self.mtp_convention, rec, keep)
        il = self.mtp_layer()
        d1 = self.mtp_logits(g[first:], il)
        d = np.argmax(d1, axis=1) if draft_tokens is None else np.asarray(draft_tokens, np.int64)
        if d.shape != (len(toks) - 1,) or (d.size and (d.min() < 0 or d.max() >= self.hp.n_vocab)):
            raise EngineError(f"oracle: draft_tokens must be {len(toks) - 1} ids in [0, {self.hp.n_vocab})")
        hid = self.mtp_rows(h, toks, self.mtp_convention)[0]
        g2 = self._chain_rows(il, keep[0], g[first:], hid[first:], d, first)
        return ChainedDrafts(d1, self.mtp_logits(g2, il), d)

    def _chain_rows(self, il: int, kv: dict[str, Any], g: np.ndarray, hid: np.ndarray, d: np.ndarray, first: int) -> np.ndarray:
        """Step 2's outputs [R, n_embd]: row t is (``mtp_chain_hidden(g[t], hid[t])``, d[t]) at head
        position first + t + 1 over ``kv``'s rows ≤ first + t (the head's K/V after the teacher-
        forced rows), each alone: no step-2 row sees another's."""
        w, eps = self.mtp_weights(il), self.hp.rms_eps
        k, v, pos = (np.concatenate(kv[x], axis=0) for x in ("k", "v", "pos"))
        x = self.mtp_chain_hidden(g, hid)
        e = self.rmsnorm(self.mtp_embed(il, d), w["nextn.enorm"], eps)
        u = self.mtp_concat(e, self.rmsnorm(x, w["nextn.hnorm"], eps)) @ w["nextn.eh_proj"].T
        out = np.empty_like(g)
        with np.errstate(over="raise", invalid="raise", divide="raise", under="ignore"):
            try:
                for t in range(len(d)):
                    n = first + t + 1
                    state = {"k": [k[:n]], "v": [v[:n]], "pos": [pos[:n]]}
                    b = self.block(il, w, u[t : t + 1], state, np.array([n]), _Recorder(None))
                    out[t] = self.mtp_head_norm(b, il, w)[0]
            except FloatingPointError as err:
                raise EngineError(f"oracle: floating-point {err} in the MTP block {il} (chained drafts)") from None
        return out

    # -- speculative decoding (harness.engines.oracle.speculative) ----------------------------
    spec_decoder: Any = None  # the SpecDecoder class; None: the correct one (mutants plant theirs)

    def _spec_class(self) -> type:
        from harness.engines.oracle.speculative import SpecDecoder

        return self.spec_decoder or SpecDecoder

    def speculative(self, tokens: Sequence[int], n_tokens: int, *, draft_max: int, chunks: Sequence[int] | None = None,
                    session: dict[str, Any] | None = None, given: Sequence[int] | None = None) -> Any:
        """Speculative greedy continuation with drafts from the MTP head (capability
        ``speculative``, ``harness.engines.base.Engine``): returns a ``Speculation`` (the ids and
        the accepted/rejected drafts per step). ``session``: ``{"id", "parent", "after"}``: the
        decoder's state after the prompt and every generated token but the last is kept under
        ``id``; with ``parent`` it starts from that session's state, ``after`` its length.
        ``given``: drafts the harness gives instead of the head's (``speculate``; the returned
        ``Speculation.logits`` holds the verify rows either way). Raises ``EngineError`` (no MTP
        block, draft_max < 1, an unknown session or length, given drafts refused)."""
        from harness.engines.oracle.speculative import fork_decoder, new_decoder, speculate

        toks = [int(t) for t in tokens]
        self._spec_sessions: dict[str, Any] = getattr(self, "_spec_sessions", {})
        parent = (session or {}).get("parent")
        if parent is not None:
            if parent not in self._spec_sessions:
                raise EngineError(f"oracle: no session {parent!r}")
            dec = fork_decoder(self._spec_sessions[parent])
            after = int((session or {}).get("after", len(dec.history)))
            if after != len(dec.history):
                raise EngineError(f"oracle: session {parent!r} keeps its state after {len(dec.history)} tokens, not {after}")
        else:
            dec = new_decoder(self, self._spec_class())
        out = speculate(dec, toks, int(n_tokens), int(draft_max), chunks, given=given)
        if session and session.get("id"):
            self._spec_sessions[str(session["id"])] = dec
        return out

    def speculative_multi(self, sequences: Sequence[Sequence[int]], n_tokens: int, *, draft_max: int) -> list[Any]:
        """``speculative`` of several sequences generated together: the oracle keeps one decoder
        per sequence, so each equals its solo run."""
        return [self.speculative(q, n_tokens, draft_max=draft_max) for q in sequences]

    def drop_sessions(self) -> None:
        """Free the speculative sessions kept (``speculative(..., session=...)``)."""
        self._spec_sessions = {}

    # -- weights and state --------------------------------------------------------------------
    def read_tensor(self, name: str, rows: np.ndarray | slice | None = None, dtype: Any = np.float64) -> np.ndarray:
        """Tensor ``name`` dequantized in NumPy order, as float64 (``dtype``: float32 only where
        that is exact, as for the output matrix); with ``rows``, only those rows (indices or a
        slice of the first NumPy axis). The one path by which the oracle reads weights
        (``GGUFModel.tensor``). Raises ``KeyError`` for an absent tensor."""
        return self.model.tensor(name, dtype, rows=rows)

    def load_layer(self, il: int) -> dict[str, np.ndarray]:
        """All ``blk.{il}.*`` tensors dequantized to float64, keyed without ``blk.{il}.`` and
        ``.weight`` (``attn_qkv``, ``ssm_dt.bias``, ``ssm_a`` ...)."""
        prefix = f"blk.{il}."
        w = _LayerWeights(il)
        for name in self.model.tensor_names:
            if name.startswith(prefix):
                w[name[len(prefix) :].removesuffix(".weight")] = self.read_tensor(name)
        return w

    def init_state(self, il: int, w: dict[str, np.ndarray]) -> dict[str, Any]:
        """Fresh per-sequence state of layer il (zeros / empty at sequence start)."""
        hp = self.hp
        if hp.is_recurrent(il):
            return {
                "conv": np.zeros((w["ssm_conv1d"].shape[1] - 1, w["ssm_conv1d"].shape[0])),
                "ssm": np.zeros((hp.ssm_dt_rank, hp.ssm_d_state, hp.head_v_dim)),
            }
        return {"k": [], "v": [], "pos": []}

    def lm_head(self, h: np.ndarray, dtype: Any = np.float32) -> np.ndarray:
        """Logits ``result_output`` [B, V] as ``dtype`` for result_norm rows h [B, n_embd] float64.

        The output projection (``output``, or ``token_embd`` when tied) in float64, one BLAS dgemm
        per slice of ``output_slice_rows`` vocabulary rows into a reused float64 scratch, each
        slice checked for non-finite values and rounded to ``dtype`` as it is stored. Every
        logit is the same float64 dot product over n_embd as in ``h @ W.T`` (slicing the
        vocabulary does not change a row's reduction, and the rows of h are not split), so the
        result equals ``(h @ W.T).astype(dtype)`` bit for bit: ``tests/test_oracle_math.py``
        checks that, ``tests/test_oracle_pinned.py`` the whole oracle. The matrix is dequantized
        once per engine (``_output_weights``). Source: llama.cpp ``qwen35.cpp`` (``build_lora_mm``
        with ``model.output``). Raises ``EngineError`` on a non-finite logit.
        """
        v, n = self.n_vocab, h.shape[0]
        cache = self._output_weights()
        step = min(v, self.output_slice_rows)
        if self._lm_scratch is None or self._lm_scratch.shape[0] < n or self._lm_scratch.shape[1] < step:
            self._lm_scratch = np.empty((max(n, self.logit_block), step))
        out = np.empty((n, v), dtype=dtype)
        with np.errstate(over="raise", invalid="raise"):
            for r0 in range(0, v, step):
                r1 = min(v, r0 + step)
                w = cache[r0:r1] if cache is not None else self.read_tensor(self._output_name, slice(r0, r1), np.float32)
                part = self._lm_scratch[:n, : r1 - r0] if r1 - r0 == step else np.empty((n, r1 - r0))
                np.matmul(h, w.astype(np.float64, copy=False).T, out=part)
                if not np.isfinite(part).all():
                    raise EngineError("oracle: non-finite logits in 'result_output' (output projection)")
                out[:, r0:r1] = part
        return out

    def _output_weights(self) -> np.ndarray | None:
        """The output matrix [V, n_embd] dequantized once, as float64 while that takes at most
        ``output_cache_f64_bytes`` (every slice of every call is then used as it is, not widened
        again: free-running generation calls this once per token) or for an F64 tensor, else as
        float32 (exact: the values are float32), or None when it is larger than ``output_cache_bytes`` (then ``lm_head`` reads it
        slice by slice). Read through ``read_tensor`` in slices, so dequantization's temporaries
        stay small."""
        if self._output_cache is None:
            info = self.model.tensor_info(self._output_name)
            v, d = int(info.ne[1]), int(info.ne[0])
            dtype = np.float64 if info.type == "F64" or v * d * 8 <= self.output_cache_f64_bytes else np.float32
            if v * d * np.dtype(dtype).itemsize > self.output_cache_bytes:
                return None
            cache = np.empty((v, d), dtype=dtype)
            for r0 in range(0, v, self.output_slice_rows):
                r1 = min(v, r0 + self.output_slice_rows)
                cache[r0:r1] = self.read_tensor(self._output_name, slice(r0, r1), dtype)
            self._output_cache = cache
        return self._output_cache


class _LayerWeights(dict):
    """A layer's tensors; a missing one is an ``EngineError`` naming the GGUF tensor."""

    def __init__(self, il: int):
        super().__init__()
        self.il = il

    def __missing__(self, key: str) -> np.ndarray:
        raise EngineError(f"oracle: tensor blk.{self.il}.{key} is missing from the model")
