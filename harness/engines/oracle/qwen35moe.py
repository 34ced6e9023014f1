"""Exact float64 NumPy forward of Qwen3.5-MoE (GGUF arch ``qwen35moe``).

The trunk (Gated DeltaNet and gated-attention layers, norms, residuals) is the one in
``qwen35.py``; only the FFN differs: a softmax router over ``expert_count`` experts, the top
``expert_used_count`` re-normalised to sum 1, SwiGLU experts, plus a shared SwiGLU expert scaled by
a per-token sigmoid gate. Source: llama.cpp ``src/models/qwen35moe.cpp`` ``build_layer_ffn`` and
``src/llama-graph.cpp`` ``build_moe_ffn`` (called with ``LLM_FFN_SILU``, ``norm_w = true``,
``LLAMA_EXPERT_GATING_FUNC_TYPE_SOFTMAX``; qwen35moe loads no ``expert_weights_scale``, so no
scale); transformers ``models/qwen3_5_moe/modeling_qwen3_5_moe.py`` ``Qwen3_5MoeSparseMoeBlock``.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from harness.engines.oracle.qwen35 import Qwen35Oracle, _Recorder, sigmoid, silu, swiglu

# llama.cpp clamps the sum of the selected weights from below before dividing (build_moe_ffn:
# "clamp to smallest number representable by F16"); only reachable with thousands of experts.
MOE_WEIGHTS_SUM_MIN = 6.103515625e-5


def moe_route(
    x: np.ndarray, router: np.ndarray, n_expert_used: int, norm_w: bool = True
) -> dict[str, np.ndarray]:
    """Softmax router with top-k selection.

    x: [T, d]; router: [E, d] (``ffn_gate_inp``). Returns llama.cpp's names:
    ``ffn_moe_logits`` [T, E], ``ffn_moe_probs`` [T, E] (softmax over all E), ``ffn_moe_topk``
    [T, k] int64 (expert ids, most probable first), ``ffn_moe_weights`` [T, k] (their probs) and,
    with norm_w, ``ffn_moe_weights_norm`` [T, k] (divided by their sum). The entry ``weights`` is
    the one the experts are mixed with. Source: llama.cpp ``llama-graph.cpp`` ``build_moe_ffn``.
    """
    logits = x @ router.T
    p = np.exp(logits - logits.max(axis=1, keepdims=True))
    probs = p / p.sum(axis=1, keepdims=True)
    topk = np.argsort(-probs, axis=1, kind="stable")[:, :n_expert_used]
    weights = np.take_along_axis(probs, topk, axis=1)
    out = {"ffn_moe_logits": logits, "ffn_moe_probs": probs, "ffn_moe_topk": topk, "ffn_moe_weights": weights}
    if norm_w:
        weights = weights / np.maximum(weights.sum(axis=1, keepdims=True), MOE_WEIGHTS_SUM_MIN)
        out["ffn_moe_weights_norm"] = weights
    out["weights"] = weights
    return out


def moe_experts(
    x: np.ndarray,
    topk: np.ndarray,
    weights: np.ndarray,
    gate_exps: np.ndarray,
    up_exps: np.ndarray,
    down_exps: np.ndarray,
    max_block_elems: int = 1 << 24,
) -> np.ndarray:
    """Weighted sum of the selected SwiGLU experts: Σ_j weights[t, j] · expert_{topk[t, j]}(x_t).

    x: [T, d]; topk, weights: [T, k]; gate_exps, up_exps: [E, ff, d] (``ffn_gate_exps``,
    ``ffn_up_exps``); down_exps: [E, d, ff]. Returns [T, d]. Vectorised across experts: each block
    of tokens runs through all E experts as one matmul (so blocks hold at most max_block_elems of
    [tokens, E, ff]); only the selected outputs are mixed, so unselected experts never touch the
    result. Source: llama.cpp ``build_moe_ffn`` (``ffn_moe_up``/``gate``/``down``/``weighted``).
    """
    n_exp, ff, d = gate_exps.shape
    out = np.empty((x.shape[0], down_exps.shape[1]))
    step = max(1, max_block_elems // (n_exp * ff))
    for s in range(0, x.shape[0], step):
        xb = x[s : s + step]  # [B, d]
        gate = (xb @ gate_exps.reshape(n_exp * ff, d).T).reshape(-1, n_exp, ff)
        up = (xb @ up_exps.reshape(n_exp * ff, d).T).reshape(-1, n_exp, ff)
        act = (silu(gate) * up).transpose(1, 0, 2)  # [E, B, ff]
        y = (act @ down_exps.transpose(0, 2, 1)).transpose(1, 0, 2)  # [B, E, d]
        sel = np.take_along_axis(y, topk[s : s + step, :, None], axis=1)  # [B, k, d]
        out[s : s + step] = np.einsum("bk,bkd->bd", weights[s : s + step], sel)
    return out


def moe(
    x: np.ndarray,
    router: np.ndarray,
    gate_exps: np.ndarray,
    up_exps: np.ndarray,
    down_exps: np.ndarray,
    n_expert_used: int,
    shared: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None = None,
    norm_w: bool = True,
) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """The qwen35moe FFN: routed experts plus the sigmoid-gated shared expert.

    x: [T, d]; router [E, d]; gate_exps, up_exps [E, ff, d]; down_exps [E, d, ff]; shared:
    (ffn_gate_shexp [ff_s, d], ffn_up_shexp [ff_s, d], ffn_down_shexp [d, ff_s],
    ffn_gate_inp_shexp [d]) or None. norm_w re-normalises the top-k weights (llama.cpp passes true
    for qwen35moe; engines that leave it off are a known bug class). Returns (ffn_out [T, d],
    intermediates under llama.cpp's names: those of ``moe_route`` plus ``ffn_moe_out``,
    ``ffn_shexp``, ``shared_expert_gate`` [T, 1], ``shared_expert_gate_sigmoid`` [T, 1],
    ``ffn_shexp_gated``). Source: llama.cpp ``qwen35moe.cpp`` ``build_layer_ffn``.
    """
    parts = moe_route(x, router, n_expert_used, norm_w)
    out = moe_experts(x, parts["ffn_moe_topk"], parts.pop("weights"), gate_exps, up_exps, down_exps)
    parts["ffn_moe_out"] = out
    if shared is not None:
        w_gate, w_up, w_down, w_gate_inp = shared
        parts["ffn_shexp"] = swiglu(x, w_gate, w_up, w_down)
        parts["shared_expert_gate"] = x @ w_gate_inp.reshape(-1, 1)  # one scalar per token
        parts["shared_expert_gate_sigmoid"] = sigmoid(parts["shared_expert_gate"])
        parts["ffn_shexp_gated"] = parts["ffn_shexp"] * parts["shared_expert_gate_sigmoid"]
        out = out + parts["ffn_shexp_gated"]
    return out, parts


class Qwen35MoeOracle(Qwen35Oracle):
    """Exact float64 forward of a ``qwen35moe`` GGUF: the qwen35 trunk with the MoE FFN."""

    arch = "qwen35moe"
    post_ffn_name = "post_moe"
    moe = staticmethod(moe)
    moe_norm_w = True

    def ffn(self, il: int, w: dict[str, np.ndarray], x: np.ndarray, emit: _Recorder) -> np.ndarray:
        """Routed + shared experts. ``ffn_gate_up_exps`` (merged, gate rows first) is accepted in
        place of ``ffn_gate_exps``/``ffn_up_exps`` as llama.cpp ``create_tensor_gate_up_exps`` does."""
        if "ffn_gate_up_exps" in w:
            gate_exps, up_exps = np.split(w["ffn_gate_up_exps"], 2, axis=1)
        else:
            gate_exps, up_exps = w["ffn_gate_exps"], w["ffn_up_exps"]
        shared: Any = None
        if "ffn_up_shexp" in w:
            shared = (w["ffn_gate_shexp"], w["ffn_up_shexp"], w["ffn_down_shexp"], w["ffn_gate_inp_shexp"])
        out, parts = self.moe(
            x, w["ffn_gate_inp"], gate_exps, up_exps, w["ffn_down_exps"], self.hp.n_expert_used, shared, self.moe_norm_w
        )
        for name, value in parts.items():
            emit(name, il, value)
        return out
