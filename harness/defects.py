"""Defective fixtures: one small GGUF per lint finding code, each planting exactly that defect.

``DEFECTS[name] = (base fixture, defect function or None, expected code)``. The defect function
edits ``(metadata, tensors)`` in place before writing (see ``harness.fixtures.build_fixture``);
metadata is ``{key: (kind, value)}``, tensors are NumPy-order arrays (the reverse of ggml ``ne``).
A defect that changes a hyperparameter also reshapes the tensors that depend on it, so only the
targeted check fires. ``mtp-declared-absent`` is the shipped fixture of the same name.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import numpy as np

from harness import fixtures as fx

Defect = Callable[[dict, dict], None]


def _arch(meta: dict) -> str:
    return "qwen35moe" if any(k.startswith("qwen35moe.") for k in meta) else "qwen35"


def _set_key(suffix: str, kind: str, value) -> Defect:
    def plant(meta: dict, tensors: dict) -> None:
        meta[f"{_arch(meta)}.{suffix}"] = (kind, value)

    return plant


def _drop_key(suffix: str) -> Defect:
    def plant(meta: dict, tensors: dict) -> None:
        del meta[f"{_arch(meta)}.{suffix}"]

    return plant


def _edit_tensor(name: str, fn: Callable[[np.ndarray], np.ndarray]) -> Defect:
    def plant(meta: dict, tensors: dict) -> None:
        tensors[name] = fn(tensors[name])

    return plant


def _head_count_kv_3(meta: dict, tensors: dict) -> None:
    """head_count 4 with head_count_kv 3 (4 % 3 != 0); attn_k / attn_v resized to 3 KV heads."""
    meta["qwen35.attention.head_count_kv"] = ("u32", 3)
    rng = np.random.default_rng(0)
    for name in list(tensors):
        if name.endswith((".attn_k.weight", ".attn_v.weight")):
            d = tensors[name].shape[1]
            tensors[name] = (rng.standard_normal((3 * 32, d)) / np.sqrt(d)).astype(np.float32)


def _group_count_3(meta: dict, tensors: dict) -> None:
    """n_k 3 with n_v 4 (4 % 3 != 0); attn_qkv and ssm_conv1d resized to conv_dim 2·3·32 + 4·32."""
    meta["qwen35.ssm.group_count"] = ("u32", 3)
    conv_dim = 2 * 3 * 32 + 4 * 32
    rng = np.random.default_rng(0)
    for name in list(tensors):
        if name.endswith(".attn_qkv.weight"):
            tensors[name] = (rng.standard_normal((conv_dim, tensors[name].shape[1])) / 8).astype(np.float32)
        elif name.endswith(".ssm_conv1d.weight"):
            tensors[name] = (0.5 * rng.standard_normal((conv_dim, tensors[name].shape[1]))).astype(np.float32)


def _swap_layer_2_to_attention(meta: dict, tensors: dict) -> None:
    """blk.2 (Gated DeltaNet by the schedule) gets blk.3's attention tensor set instead."""
    for name in [n for n in tensors if n.startswith("blk.2.")]:
        if not name.endswith(("attn_norm.weight", "post_attention_norm.weight")) and ".ffn_" not in name:
            del tensors[name]
    for name in [n for n in tensors if n.startswith("blk.3.attn_") and n != "blk.3.attn_norm.weight"]:
        tensors["blk.2." + name.removeprefix("blk.3.")] = tensors[name].copy()


def _mtp_only(meta: dict, tensors: dict) -> None:
    """Keep only the MTP block (blk.8) and the global tensors."""
    for name in [n for n in tensors if n.startswith("blk.") and not n.startswith("blk.8.")]:
        del tensors[name]


def _mtp_undeclared(meta: dict, tensors: dict) -> None:
    """MTP tensors written (blk.8) but block_count 8 and no nextn_predict_layers."""
    meta["qwen35.block_count"] = ("u32", 8)
    del meta["qwen35.nextn_predict_layers"]


DEFECTS: dict[str, tuple[str, Defect | None, str]] = {
    "missing-key": ("tiny-qwen35", _drop_key("ssm.conv_kernel"), "QL101"),
    "key-wrong-type": ("tiny-qwen35", _set_key("ssm.conv_kernel", "i32", 4), "QL102"),
    "interval-zero": ("tiny-qwen35", _set_key("full_attention_interval", "u32", 0), "QL103"),
    "value-length-differs": ("tiny-qwen35", _set_key("attention.value_length", "u32", 16), "QL104"),
    "head-count-kv-not-divisor": ("tiny-qwen35", _head_count_kv_3, "QL105"),
    "n-v-not-multiple-of-n-k": ("tiny-qwen35", _group_count_3, "QL106"),
    "inner-size-wrong": ("tiny-qwen35", _set_key("ssm.inner_size", "u32", 100), "QL107"),
    "rope-dims-odd": ("tiny-qwen35", _set_key("rope.dimension_count", "u32", 7), "QL108"),
    "rope-sections-bad": ("tiny-qwen35", _set_key("rope.dimension_sections", "arr_i32", [2, 1, 0, 0]), "QL109"),
    "expert-used-too-many": ("tiny-qwen35moe", _set_key("expert_used_count", "u32", 5), "QL110"),
    "mtp-declared-absent": ("mtp-declared-absent", None, "QL201"),
    "mtp-only": ("tiny-qwen35-mtp", _mtp_only, "QL202"),
    "mtp-undeclared": ("tiny-qwen35-mtp", _mtp_undeclared, "QL203"),
    "schedule-mismatch": ("tiny-qwen35", _swap_layer_2_to_attention, "QL204"),
    "tensor-missing": ("tiny-qwen35", lambda m, t: t.pop("blk.5.ssm_beta.weight"), "QL301"),
    "attn-qkv-wrong-shape": ("tiny-qwen35", _edit_tensor("blk.0.attn_qkv.weight", lambda w: w[:-32]), "QL302"),
    "vocab-rows-mismatch": ("tiny-qwen35", _edit_tensor("output.weight", lambda w: w[:-1]), "QL303"),
    "unexpected-tensor": ("tiny-qwen35", lambda m, t: t.__setitem__("rope_freqs.weight", np.ones(4, np.float32)), "QL304"),
    "ssm-a-positive": ("tiny-qwen35", _edit_tensor("blk.0.ssm_a", np.abs), "QL401"),
    "norm-shift-missing": ("tiny-qwen35", _edit_tensor("blk.3.attn_q_norm.weight", lambda w: w - 1), "QL402"),
    "norm-double-shift": ("tiny-qwen35", _edit_tensor("output_norm.weight", lambda w: w + 1), "QL403"),
    "ssm-norm-shifted": ("tiny-qwen35", _edit_tensor("blk.1.ssm_norm.weight", lambda w: w + 1), "QL404"),
    "ssm-a-f16": ("tiny-qwen35", _edit_tensor("blk.0.ssm_a", lambda w: w.astype(np.float16)), "QL405"),
}
"""Defect name → (base fixture in ``harness.fixtures.SPECS``, defect or None, expected lint code)."""


def build_defect(name: str, directory: Path) -> Path:
    """Write defective fixture ``name`` to ``directory/NAME.gguf`` (deterministic, F32 unless the
    defect says otherwise) and return its path. Raises ``KeyError`` for an unknown name."""
    base, defect, _ = DEFECTS[name]
    return fx.build_fixture(fx.SPECS[base], Path(directory) / f"{name}.gguf", defect)
