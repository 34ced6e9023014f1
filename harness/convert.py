"""transformers Qwen3.5 checkpoints ⇄ qwen35 / qwen35moe GGUF, by one table of tensor mappings.

Follows llama.cpp's converter (``convert_hf_to_gguf.py`` → ``conversion/qwen.py``: classes
``Qwen3NextModel``, ``_LinearAttentionVReorderBase``, ``_Qwen35MRopeMixin``, ``Qwen3_5TextModel``,
``Qwen3_5MoeTextModel``; ``conversion/base.py`` ``TextModel.set_gguf_parameters`` and
``prepare_tensors``). What the converter bakes into the file, and this module undoes on the way back:

- RMSNorm weights are stored shifted, ``1 + w``, except the DeltaNet gated norm
  (``linear_attn.norm`` → ``ssm_norm``), which is stored as is;
- ``A_log`` becomes ``ssm_a = -exp(A_log)``; ``dt_bias`` becomes ``ssm_dt.bias``;
- the depthwise conv kernel ``[C, 1, K]`` is squeezed to ``[C, K]``;
- value heads are re-ordered from grouped (HF: v-head h reads k-head h // (n_v/n_k)) to tiled
  (GGUF: v-head h reads k-head h % n_k) in every tensor that touches them: the v rows of
  ``attn_qkv``, ``attn_gate``, ``ssm_beta``, ``ssm_alpha``, ``ssm_a``, ``ssm_dt.bias``, the v
  channels of ``ssm_conv1d`` and the input columns of ``ssm_out``;
- the fused expert tensor ``experts.gate_up_proj [E, 2·ff, d]`` is split into
  ``ffn_gate_exps`` / ``ffn_up_exps`` ``[E, ff, d]``; ``experts.down_proj`` is kept stacked.

Arrays are NumPy, in NumPy order (the reverse of ggml's ``ne``), so an HF ``nn.Linear`` weight
``[out, in]`` is written as is. The state-dict side uses transformers 5 names
(``Qwen3_5ForCausalLM`` / ``Qwen3_5MoeForCausalLM``: ``model.layers.N...``, ``lm_head.weight``);
``model.language_model.`` prefixes (the multimodal checkpoints) are accepted on input.
The core is NumPy only; torch is imported by ``to_transformers`` alone.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

import numpy as np

from harness.errors import InvalidInput

ARCHES = {"qwen3_5_text": "qwen35", "qwen3_5_moe_text": "qwen35moe"}
"""transformers ``model_type`` of the text config → GGUF ``general.architecture``."""

# llama.cpp gguf-py ``Keys.Attention.RECURRENT_LAYERS`` (not in the pinned gguf 0.19 package).
RECURRENT_LAYERS_KEY = "{arch}.attention.recurrent_layers"


@dataclass(frozen=True)
class Dims:
    """Gated DeltaNet head counts and sizes: key heads ``n_k`` × ``d_k``, value heads ``n_v`` × ``d_v``."""

    n_k: int
    n_v: int
    d_k: int
    d_v: int


# ---------------------------------------------------------------------------------------------
# Transforms: pairs of pure functions (HF arrays → GGUF arrays, GGUF arrays → HF array)
# ---------------------------------------------------------------------------------------------
def tile_v_heads(a: np.ndarray, axis: int, dims: Dims, head: int) -> np.ndarray:
    """Re-order the value-head axis ``axis`` (length n_v·head) from grouped to tiled order.

    Grouped (HF): ``[k0: v0..v{r-1}, k1: v0..v{r-1}, ...]``; tiled (GGUF): ``[v0: k0, k1, ..,
    v1: k0, k1, ..]`` with r = n_v / n_k. Source: llama.cpp ``conversion/qwen.py``
    ``_LinearAttentionVReorderBase._reorder_v_heads``.
    """
    r = dims.n_v // dims.n_k
    shape = a.shape
    axis = axis % a.ndim
    v = a.reshape(shape[:axis] + (dims.n_k, r, head) + shape[axis + 1 :])
    return np.ascontiguousarray(np.swapaxes(v, axis, axis + 1)).reshape(shape)


def group_v_heads(a: np.ndarray, axis: int, dims: Dims, head: int) -> np.ndarray:
    """Inverse of ``tile_v_heads``: tiled (GGUF) back to grouped (HF) value-head order."""
    r = dims.n_v // dims.n_k
    shape = a.shape
    axis = axis % a.ndim
    v = a.reshape(shape[:axis] + (r, dims.n_k, head) + shape[axis + 1 :])
    return np.ascontiguousarray(np.swapaxes(v, axis, axis + 1)).reshape(shape)


def _preimage(forward: Callable[[np.ndarray], np.ndarray], target: np.ndarray, guess: np.ndarray, span: int = 8) -> np.ndarray:
    """The float32 x nearest ``guess`` with ``forward(x) == target`` bit for bit, per element.

    ``forward`` (x ↦ x + 1, x ↦ −exp(x)) is not injective in float32, so the naive inverse can be
    off by an ulp; a file the converter wrote always has an exact preimage (the checkpoint's own
    value), found here among the ``span`` float32 neighbours on each side of ``guess``.
    Elements without one keep ``guess``.
    """
    best = guess.astype(np.float32).copy()
    found = forward(best) == target
    up = down = best
    for _ in range(span):
        up = np.nextafter(up, np.float32(np.inf))
        down = np.nextafter(down, np.float32(-np.inf))
        for cand in (up, down):
            hit = ~found & (forward(cand) == target)
            best[hit] = cand[hit]
            found |= hit
        if found.all():
            break
    return best


def _plus_one(w: np.ndarray) -> np.ndarray:
    return (w.astype(np.float32) + np.float32(1.0)).astype(np.float32)


def _neg_exp(a_log: np.ndarray) -> np.ndarray:
    return (-np.exp(a_log.astype(np.float64))).astype(np.float32)


@dataclass(frozen=True)
class Transform:
    """``to_gguf(hf_array, dims) -> tuple of GGUF arrays``; ``to_hf(gguf_arrays, dims) -> hf_array``."""

    name: str
    to_gguf: Callable[[np.ndarray, Dims], tuple[np.ndarray, ...]]
    to_hf: Callable[[tuple[np.ndarray, ...], Dims], np.ndarray]


def _qkv_v_rows(a: np.ndarray, d: Dims, f: Callable) -> np.ndarray:
    qk = 2 * d.n_k * d.d_k  # rows (conv channels) of q and k; the v rows follow
    return np.concatenate([a[:qk], f(a[qk:], 0, d, d.d_v)], axis=0)


IDENTITY = Transform("identity", lambda a, d: (a,), lambda g, d: g[0])
NORM_SHIFT = Transform(
    "1 + w (shifted RMSNorm)",
    lambda a, d: (_plus_one(a),),
    lambda g, d: _preimage(_plus_one, g[0], g[0].astype(np.float32) - np.float32(1.0)),
)
V_ROWS = Transform(
    "v heads tiled (rows)",
    lambda a, d: (tile_v_heads(a, 0, d, d.d_v),),
    lambda g, d: group_v_heads(g[0], 0, d, d.d_v),
)
V_SCALAR_ROWS = Transform(
    "v heads tiled (one row per head)",
    lambda a, d: (tile_v_heads(a, 0, d, 1),),
    lambda g, d: group_v_heads(g[0], 0, d, 1),
)
V_COLUMNS = Transform(
    "v heads tiled (input columns)",
    lambda a, d: (tile_v_heads(a, 1, d, d.d_v),),
    lambda g, d: group_v_heads(g[0], 1, d, d.d_v),
)
QKV_V_ROWS = Transform(
    "v rows of qkv tiled",
    lambda a, d: (_qkv_v_rows(a, d, tile_v_heads),),
    lambda g, d: _qkv_v_rows(g[0], d, group_v_heads),
)
CONV_SQUEEZE_V = Transform(
    "[C,1,K] squeezed to [C,K], v channels tiled",
    lambda a, d: (_qkv_v_rows(a.reshape(a.shape[0], a.shape[-1]), d, tile_v_heads),),
    lambda g, d: _qkv_v_rows(g[0], d, group_v_heads)[:, None, :],
)
A_LOG = Transform(
    "ssm_a = -exp(A_log), v heads tiled",
    lambda a, d: (_neg_exp(tile_v_heads(a, 0, d, 1)),),
    lambda g, d: group_v_heads(
        _preimage(_neg_exp, g[0], np.log(-g[0].astype(np.float64)).astype(np.float32)), 0, d, 1
    ),
)
GATE_UP_SPLIT = Transform(
    "experts.gate_up_proj [E, 2ff, d] split into gate, up [E, ff, d]",
    lambda a, d: (a[:, : a.shape[1] // 2], a[:, a.shape[1] // 2 :]),
    lambda g, d: np.concatenate(g, axis=1),
)


@dataclass(frozen=True)
class Rule:
    """One row of the mapping table: an HF state-dict name template, the GGUF name template(s)
    it becomes, and the transform between them. ``{i}`` is the layer index."""

    hf: str
    gguf: tuple[str, ...]
    transform: Transform

    def hf_name(self, i: int | None) -> str:
        return self.hf.format(i=i)

    def gguf_names(self, i: int | None) -> tuple[str, ...]:
        return tuple(g.format(i=i) for g in self.gguf)


L = "model.layers.{i}."
B = "blk.{i}."
RULES: tuple[Rule, ...] = (
    Rule("model.embed_tokens.weight", ("token_embd.weight",), IDENTITY),
    Rule("model.norm.weight", ("output_norm.weight",), NORM_SHIFT),
    Rule("lm_head.weight", ("output.weight",), IDENTITY),
    Rule(L + "input_layernorm.weight", (B + "attn_norm.weight",), NORM_SHIFT),
    Rule(L + "post_attention_layernorm.weight", (B + "post_attention_norm.weight",), NORM_SHIFT),
    # Gated DeltaNet (linear attention) layers
    Rule(L + "linear_attn.in_proj_qkv.weight", (B + "attn_qkv.weight",), QKV_V_ROWS),
    Rule(L + "linear_attn.in_proj_z.weight", (B + "attn_gate.weight",), V_ROWS),
    Rule(L + "linear_attn.in_proj_b.weight", (B + "ssm_beta.weight",), V_SCALAR_ROWS),
    Rule(L + "linear_attn.in_proj_a.weight", (B + "ssm_alpha.weight",), V_SCALAR_ROWS),
    Rule(L + "linear_attn.conv1d.weight", (B + "ssm_conv1d.weight",), CONV_SQUEEZE_V),
    Rule(L + "linear_attn.dt_bias", (B + "ssm_dt.bias",), V_SCALAR_ROWS),
    Rule(L + "linear_attn.A_log", (B + "ssm_a",), A_LOG),
    Rule(L + "linear_attn.norm.weight", (B + "ssm_norm.weight",), IDENTITY),  # gated norm: no +1
    Rule(L + "linear_attn.out_proj.weight", (B + "ssm_out.weight",), V_COLUMNS),
    # gated full-attention layers (q_proj rows are per head [query | gate] in both conventions)
    Rule(L + "self_attn.q_proj.weight", (B + "attn_q.weight",), IDENTITY),
    Rule(L + "self_attn.k_proj.weight", (B + "attn_k.weight",), IDENTITY),
    Rule(L + "self_attn.v_proj.weight", (B + "attn_v.weight",), IDENTITY),
    Rule(L + "self_attn.o_proj.weight", (B + "attn_output.weight",), IDENTITY),
    Rule(L + "self_attn.q_norm.weight", (B + "attn_q_norm.weight",), NORM_SHIFT),
    Rule(L + "self_attn.k_norm.weight", (B + "attn_k_norm.weight",), NORM_SHIFT),
    # dense FFN (qwen35)
    Rule(L + "mlp.gate_proj.weight", (B + "ffn_gate.weight",), IDENTITY),
    Rule(L + "mlp.up_proj.weight", (B + "ffn_up.weight",), IDENTITY),
    Rule(L + "mlp.down_proj.weight", (B + "ffn_down.weight",), IDENTITY),
    # MoE FFN (qwen35moe)
    Rule(L + "mlp.gate.weight", (B + "ffn_gate_inp.weight",), IDENTITY),
    Rule(L + "mlp.experts.gate_up_proj", (B + "ffn_gate_exps.weight", B + "ffn_up_exps.weight"), GATE_UP_SPLIT),
    Rule(L + "mlp.experts.down_proj", (B + "ffn_down_exps.weight",), IDENTITY),
    Rule(L + "mlp.shared_expert.gate_proj.weight", (B + "ffn_gate_shexp.weight",), IDENTITY),
    Rule(L + "mlp.shared_expert.up_proj.weight", (B + "ffn_up_shexp.weight",), IDENTITY),
    Rule(L + "mlp.shared_expert.down_proj.weight", (B + "ffn_down_shexp.weight",), IDENTITY),
    Rule(L + "mlp.shared_expert_gate.weight", (B + "ffn_gate_inp_shexp.weight",), IDENTITY),
)
del L, B


def _template_regex(template: str) -> re.Pattern:
    return re.compile("^" + re.escape(template).replace(re.escape("{i}"), r"(\d+)") + "$")


_HF_INDEX = [(_template_regex(r.hf), r) for r in RULES]
_GGUF_INDEX = [(_template_regex(g), r) for r in RULES for g in r.gguf]


def _match(index: list[tuple[re.Pattern, Rule]], name: str) -> tuple[Rule, int | None] | None:
    for rx, rule in index:
        m = rx.match(name)
        if m:
            return rule, (int(m.group(1)) if m.groups() else None)
    return None


# ---------------------------------------------------------------------------------------------
# Tensor types when writing F16 (llama.cpp conversion/base.py ``prepare_tensors``)
# ---------------------------------------------------------------------------------------------
_ALWAYS_F32 = ("ffn_gate_inp.weight", "ffn_gate_inp_shexp.weight", "ssm_conv1d.weight")


def gguf_dtype(name: str, ndim: int, out_type: str) -> type:
    """NumPy dtype a tensor is written as: float32 for ``out_type`` F32; for F16, float16 except
    1-D tensors, norms, router gates, the conv kernel and non-``.weight`` tensors (``ssm_a``,
    ``ssm_dt.bias``), which llama.cpp's converter keeps in F32."""
    if out_type == "F32":
        return np.float32
    if out_type != "F16":
        raise InvalidInput(f"unsupported output type {out_type!r}; use F32 or F16 (then llama.cpp's quantizer)")
    if ndim <= 1 or name.endswith("_norm.weight") or name.endswith(_ALWAYS_F32) or not name.endswith(".weight"):
        return np.float32
    return np.float16


# ---------------------------------------------------------------------------------------------
# Config ⇄ metadata
# ---------------------------------------------------------------------------------------------
def _config_dict(config: Any) -> dict[str, Any]:
    return dict(config.to_dict()) if hasattr(config, "to_dict") else dict(config)


def dims_of_config(cfg: Mapping[str, Any]) -> Dims:
    """DeltaNet ``Dims`` from a transformers text config dict."""
    return Dims(
        n_k=int(cfg["linear_num_key_heads"]),
        n_v=int(cfg["linear_num_value_heads"]),
        d_k=int(cfg["linear_key_head_dim"]),
        d_v=int(cfg["linear_value_head_dim"]),
    )


def arch_of_config(cfg: Mapping[str, Any]) -> str:
    """``qwen35`` or ``qwen35moe`` for a text config; ``InvalidInput`` for anything else."""
    mt = cfg.get("model_type")
    if mt not in ARCHES:
        raise InvalidInput(f"unsupported transformers model_type {mt!r}; supported: {', '.join(ARCHES)}")
    return ARCHES[mt]


# (GGUF key suffix, config field, kind, arches). One table; derived keys follow in config_to_metadata.
_CONFIG_KEYS: tuple[tuple[str, str, str, tuple[str, ...]], ...] = (
    ("context_length", "max_position_embeddings", "u32", ("qwen35", "qwen35moe")),
    ("embedding_length", "hidden_size", "u32", ("qwen35", "qwen35moe")),
    ("feed_forward_length", "intermediate_size", "u32", ("qwen35",)),
    ("attention.head_count", "num_attention_heads", "u32", ("qwen35", "qwen35moe")),
    ("attention.head_count_kv", "num_key_value_heads", "u32", ("qwen35", "qwen35moe")),
    ("attention.key_length", "head_dim", "u32", ("qwen35", "qwen35moe")),
    ("attention.value_length", "head_dim", "u32", ("qwen35", "qwen35moe")),
    ("attention.layer_norm_rms_epsilon", "rms_norm_eps", "f32", ("qwen35", "qwen35moe")),
    ("ssm.conv_kernel", "linear_conv_kernel_dim", "u32", ("qwen35", "qwen35moe")),
    ("ssm.state_size", "linear_key_head_dim", "u32", ("qwen35", "qwen35moe")),
    ("ssm.group_count", "linear_num_key_heads", "u32", ("qwen35", "qwen35moe")),
    ("ssm.time_step_rank", "linear_num_value_heads", "u32", ("qwen35", "qwen35moe")),
    ("expert_count", "num_experts", "u32", ("qwen35moe",)),
    ("expert_used_count", "num_experts_per_tok", "u32", ("qwen35moe",)),
    ("expert_feed_forward_length", "moe_intermediate_size", "u32", ("qwen35moe",)),
    ("expert_shared_feed_forward_length", "shared_expert_intermediate_size", "u32", ("qwen35moe",)),
)
DEFAULT_MROPE_SECTION = [11, 11, 10, 0]  # llama.cpp ``_Qwen35MRopeMixin._QWEN35_DEFAULT_MROPE_SECTION``


def config_to_metadata(config: Any, name: str, out_type: str = "F32") -> dict[str, tuple[str, Any]]:
    """GGUF model metadata (no tokenizer keys) for a transformers Qwen3.5 text config.

    Returns ``{key: (kind, value)}`` as ``fixtures.write_gguf`` takes it. Raises ``InvalidInput``
    for an unsupported ``model_type``. Source: llama.cpp ``TextModel.set_gguf_parameters``,
    ``Qwen2MoeModel``/``Qwen3NextModel.set_gguf_parameters``, ``_Qwen35MRopeMixin``.
    """
    from gguf import LlamaFileType

    cfg = _config_dict(config)
    a = arch_of_config(cfg)
    rope = dict(cfg.get("rope_parameters") or {})
    n_layer = int(cfg["num_hidden_layers"])
    m: dict[str, tuple[str, Any]] = {
        "general.name": ("str", name),
        "general.file_type": ("u32", int(LlamaFileType.ALL_F32 if out_type == "F32" else LlamaFileType.MOSTLY_F16)),
        f"{a}.block_count": ("u32", n_layer),
    }
    for suffix, field, kind, arches in _CONFIG_KEYS:
        if a in arches and cfg.get(field) is not None:
            m[f"{a}.{suffix}"] = (kind, cfg[field])
    sections = list(rope.get("mrope_section") or DEFAULT_MROPE_SECTION)
    m[f"{a}.rope.dimension_sections"] = ("arr_i32", (sections + [0, 0, 0, 0])[:4])
    m[f"{a}.rope.freq_base"] = ("f32", float(rope.get("rope_theta", 10000.0)))
    m[f"{a}.rope.dimension_count"] = ("u32", int(int(cfg["head_dim"]) * rope.get("partial_rotary_factor", 0.25)))
    m[f"{a}.ssm.inner_size"] = ("u32", int(cfg["linear_value_head_dim"]) * int(cfg["linear_num_value_heads"]))
    layer_types = cfg.get("layer_types")
    if layer_types is not None:
        if len(layer_types) != n_layer:
            raise InvalidInput(f"layer_types has {len(layer_types)} entries, expected num_hidden_layers ({n_layer})")
        m[RECURRENT_LAYERS_KEY.format(arch=a)] = ("arr_bool", [t == "linear_attention" for t in layer_types])
    m[f"{a}.full_attention_interval"] = ("u32", int(cfg.get("full_attention_interval", 4)))
    return m


def metadata_to_config(model: Any) -> dict[str, Any]:
    """transformers text-config kwargs (plus ``model_type``) for an opened ``GGUFModel``.

    Trunk layers only: MTP (nextn) blocks have no place in ``Qwen3_5ForCausalLM`` and are
    refused. Raises ``InvalidInput`` for an unsupported arch, MTP blocks or no ``token_embd``.
    """
    hp = model.hparams
    if not model.has_tensor("token_embd.weight"):
        raise InvalidInput(f"{model.path}: token_embd.weight is missing")
    if hp.n_layer_nextn:
        raise InvalidInput(f"{model.path}: {hp.n_layer_nextn} MTP (nextn) block(s): the transformers engine runs trunk-only models")
    if hp.ssm_d_inner % hp.ssm_dt_rank:
        raise InvalidInput(f"{model.path}: ssm.inner_size {hp.ssm_d_inner} is not a multiple of time_step_rank {hp.ssm_dt_rank}")
    cfg: dict[str, Any] = {
        "model_type": "qwen3_5_moe_text" if hp.is_moe else "qwen3_5_text",
        "vocab_size": int(model.tensor_info("token_embd.weight").ne[1]),
        "hidden_size": hp.n_embd,
        "num_hidden_layers": hp.n_layer,
        "num_attention_heads": hp.n_head,
        "num_key_value_heads": hp.n_head_kv,
        "head_dim": hp.head_dim,
        "rms_norm_eps": hp.rms_eps,
        "max_position_embeddings": hp.context_length or 4096,
        "tie_word_embeddings": not model.has_tensor("output.weight"),
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": hp.rope_freq_base,
            "partial_rotary_factor": hp.n_rot / hp.head_dim,
            "mrope_section": list(hp.rope_sections[:3]),
            "mrope_interleaved": True,
        },
        "linear_conv_kernel_dim": hp.ssm_d_conv,
        "linear_key_head_dim": hp.ssm_d_state,
        "linear_value_head_dim": hp.ssm_d_inner // hp.ssm_dt_rank,
        "linear_num_key_heads": hp.ssm_n_group,
        "linear_num_value_heads": hp.ssm_dt_rank,
        "layer_types": ["linear_attention" if hp.is_recurrent(i) else "full_attention" for i in range(hp.n_layer)],
    }
    if hp.is_moe:
        cfg.update(
            num_experts=hp.n_expert,
            num_experts_per_tok=hp.n_expert_used,
            moe_intermediate_size=hp.n_ff_exp,
            shared_expert_intermediate_size=hp.n_ff_shexp,
        )
    else:
        cfg["intermediate_size"] = hp.n_ff
    return cfg


# ---------------------------------------------------------------------------------------------
# State dict ⇄ GGUF tensors
# ---------------------------------------------------------------------------------------------
def _as_numpy(x: Any) -> np.ndarray:
    if hasattr(x, "detach"):  # a torch tensor; float32 numpy without importing torch here
        x = x.detach().cpu()
        if str(x.dtype) not in ("torch.float32", "torch.float16", "torch.float64"):
            x = x.float()
        x = x.numpy()
    return np.asarray(x)


def state_dict_to_gguf_tensors(config: Any, state_dict: Mapping[str, Any], out_type: str = "F32") -> dict[str, np.ndarray]:
    """GGUF tensors (NumPy order, float32 / float16 per ``gguf_dtype``) for an HF state dict.

    ``state_dict`` values are torch tensors or NumPy arrays. ``lm_head.weight`` is dropped when
    the config ties it to the embedding; ``mtp.*`` and ``model.visual.*`` are skipped as llama.cpp's
    text converter does. Raises ``InvalidInput`` for a tensor no rule maps.
    """
    cfg = _config_dict(config)
    dims = dims_of_config(cfg)
    out: dict[str, np.ndarray] = {}
    for key, value in state_dict.items():
        name = key.replace("model.language_model.", "model.", 1)
        if name.startswith(("mtp.", "model.mtp.", "model.visual.")):
            continue
        if name == "lm_head.weight" and cfg.get("tie_word_embeddings"):
            continue
        hit = _match(_HF_INDEX, name)
        if hit is None:
            raise InvalidInput(f"no GGUF mapping for state-dict tensor {key!r}")
        rule, i = hit
        arrays = rule.transform.to_gguf(_as_numpy(value).astype(np.float32), dims)
        for gname, arr in zip(rule.gguf_names(i), arrays):
            out[gname] = np.ascontiguousarray(arr, dtype=gguf_dtype(gname, arr.ndim, out_type))
    return dict(sorted(out.items(), key=lambda kv: _gguf_order(kv[0])))


def _gguf_order(name: str) -> tuple[int, int, str]:
    """llama.cpp's converter order: token_embd, blk.0 .. blk.N, then output_norm, output."""
    m = re.match(r"blk\.(\d+)\.", name)
    if m:
        return (1, int(m.group(1)), name)
    return (0 if name.startswith("token_embd") else 2, 0, name)


def gguf_to_state_dict(model: Any) -> dict[str, np.ndarray]:
    """HF state dict (NumPy float32) of an opened ``GGUFModel``: every tensor through its rule's
    inverse. Quantized tensors are dequantized first (``GGUFModel.tensor``). Raises
    ``InvalidInput`` for a tensor no rule maps or a rule with a missing part."""
    hp = model.hparams
    dims = Dims(n_k=hp.ssm_n_group, n_v=hp.ssm_dt_rank, d_k=hp.ssm_d_state, d_v=hp.head_v_dim)
    pending: dict[tuple[str, int | None], Rule] = {}
    for name in model.tensor_names:
        hit = _match(_GGUF_INDEX, name)
        if hit is None:
            raise InvalidInput(f"{model.path}: no transformers mapping for GGUF tensor {name!r}")
        rule, i = hit
        pending[(rule.hf, i)] = rule
    sd: dict[str, np.ndarray] = {}
    for (_, i), rule in pending.items():
        names = rule.gguf_names(i)
        missing = [n for n in names if not model.has_tensor(n)]
        if missing:
            raise InvalidInput(f"{model.path}: {missing[0]!r} is missing ({rule.hf_name(i)} needs {', '.join(names)})")
        arrays = tuple(np.array(model.tensor(n, dtype=np.float32)) for n in names)
        sd[rule.hf_name(i)] = np.ascontiguousarray(rule.transform.to_hf(arrays, dims), dtype=np.float32)
    return sd


# ---------------------------------------------------------------------------------------------
# Files and models
# ---------------------------------------------------------------------------------------------
def tokenizer_metadata(n_vocab: int) -> dict[str, tuple[str, Any]]:
    """The fixtures' byte-level BPE tokenizer keys (``tokenizer.ggml.*``) padded to ``n_vocab``.

    One source: ``harness.fixtures.build_vocab`` / ``make_metadata``, so llama.cpp tokenizes a
    converted model exactly as it tokenizes every fixture.
    """
    from harness import fixtures

    tokens, types, merges = fixtures.build_vocab(n_vocab)
    if len(tokens) != n_vocab:
        raise InvalidInput(f"the fixture vocabulary has {len(tokens)} tokens, the model {n_vocab}")
    meta = fixtures.make_metadata(fixtures.SPECS["tiny-qwen35"], tokens, types, merges)
    return {k: v for k, v in meta.items() if k.startswith("tokenizer.")}


def hf_to_gguf(
    config: Any,
    state_dict: Mapping[str, Any],
    path: str | os.PathLike,
    name: str,
    out_type: str = "F32",
    tokenizer: Mapping[str, tuple[str, Any]] | None = None,
) -> Path:
    """Write a transformers Qwen3.5 text checkpoint (config + state dict) as a GGUF at ``path``.

    ``out_type`` F32 or F16 (lower types: quantize the result with ``fixtures.quantize``).
    ``tokenizer`` (``{key: (kind, value)}``) defaults to the fixtures' vocabulary padded to the
    config's ``vocab_size``. Written atomically. Raises ``InvalidInput`` for an unsupported
    config or an unmapped tensor.
    """
    from harness.fixtures import write_gguf

    cfg = _config_dict(config)
    arch = arch_of_config(cfg)
    meta = config_to_metadata(cfg, name, out_type)
    meta.update(tokenizer if tokenizer is not None else tokenizer_metadata(int(cfg["vocab_size"])))
    tensors = state_dict_to_gguf_tensors(cfg, state_dict, out_type)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        write_gguf(tmp, arch, meta, tensors)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def gguf_tokenizer_metadata(model: Any) -> dict[str, tuple[str, Any]]:
    """The ``tokenizer.ggml.*`` keys of an opened ``GGUFModel`` as ``{key: (kind, value)}``."""
    kinds = {"STRING": "str", "UINT32": "u32", "INT32": "i32", "BOOL": "bool", "FLOAT32": "f32"}
    out: dict[str, tuple[str, Any]] = {}
    for key in model.keys:
        if not key.startswith("tokenizer."):
            continue
        t = model.metadata_type(key)
        if t == "ARRAY[STRING]":
            out[key] = ("arr_str", list(model.raw_metadata(key)))
        elif t == "ARRAY[INT32]":
            out[key] = ("arr_i32", list(model.raw_metadata(key)))
        elif t in kinds:
            out[key] = (kinds[t], model.raw_metadata(key))
        else:
            raise InvalidInput(f"{model.path}: tokenizer key {key!r} has unsupported type {t}")
    return out


def transformers_config(cfg: Mapping[str, Any]) -> Any:
    """A ``Qwen3_5TextConfig`` / ``Qwen3_5MoeTextConfig`` from ``metadata_to_config`` kwargs."""
    from transformers import Qwen3_5MoeTextConfig, Qwen3_5TextConfig

    kwargs = {k: v for k, v in cfg.items() if k != "model_type"}
    cls = Qwen3_5MoeTextConfig if cfg["model_type"] == "qwen3_5_moe_text" else Qwen3_5TextConfig
    return cls(**kwargs)


def causal_lm_class(cfg: Mapping[str, Any]) -> Any:
    """``Qwen3_5ForCausalLM`` or ``Qwen3_5MoeForCausalLM`` for a config dict's ``model_type``."""
    from transformers import Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM

    return Qwen3_5MoeForCausalLM if _config_dict(cfg)["model_type"] == "qwen3_5_moe_text" else Qwen3_5ForCausalLM


def to_transformers(model: Any, dtype: Any = None) -> Any:
    """A transformers ``Qwen3_5(Moe)ForCausalLM`` (eval mode, CPU) holding the weights of an
    opened ``GGUFModel``, in ``dtype`` (a torch dtype; float32 by default). MoE models use
    transformers' ``eager`` experts implementation.

    Needs the ``hf`` extra (torch, transformers). Raises ``InvalidInput`` for a model the
    inverse conversion cannot express (MTP blocks, unmapped tensors).
    """
    import torch

    cfg = metadata_to_config(model)
    sd = gguf_to_state_dict(model)
    config = transformers_config(cfg)
    with torch.device("cpu"):
        lm = causal_lm_class(cfg)(config)
    tensors = {k: torch.from_numpy(v) for k, v in sd.items()}
    if config.tie_word_embeddings:
        tensors.setdefault("lm_head.weight", tensors["model.embed_tokens.weight"])
    missing, unexpected = lm.load_state_dict(tensors, strict=False)
    missing = [k for k in missing if not (k == "lm_head.weight" and config.tie_word_embeddings)]
    if missing or unexpected:
        raise InvalidInput(f"{model.path}: state dict mismatch: missing {missing[:3]}, unexpected {unexpected[:3]}")
    if hasattr(lm, "set_experts_implementation") and cfg["model_type"] == "qwen3_5_moe_text":
        # the per-expert loop: readable, and the grouped_mm kernel refuses float64
        lm.set_experts_implementation("eager")
    return lm.to(dtype or torch.float32).eval()
