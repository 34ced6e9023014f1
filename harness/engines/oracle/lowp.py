"""Low-precision emulation of the oracle: the engines ``oracle-bf16`` and ``oracle-f16``.

What a GPU serving engine does when it runs Qwen3.5 in bfloat16 (or float16), emulated on the
exact oracle's forward so that a compute class's known-good floor can be measured without a GPU:

- every weight of a matmul (``attn_qkv``, ``ssm_out``, ``ffn_*``, expert tensors, ``output``,
  the ``token_embd`` rows) is rounded to the format once, round-to-nearest-even (``ml_dtypes``
  casts, not bit tricks);
- every matmul with a weight has its activation input rounded to the format too, and
  accumulates in float32 (``np.matmul`` on float32 arrays, as a bf16 GEMM with an f32
  accumulator does);
- norms, softmax, gates, the convolution and the recurrent state stay in float32 or wider (the
  exact oracle's float64 where a step allocates its own buffers);
- the residual stream is rounded to the format after each add (``attn_residual`` and the
  post-FFN sum), as an engine that keeps hidden states in bf16 does.

This is one class of engine, not a model of every bf16 engine: a class's known-good floor is the
maximum over real engines of the class (transformers in bf16/f16) and this emulation, never the
emulation alone (``harness calibrate``). The exact ``oracle`` is untouched: these engines are
subclasses that override ``load_layer``, ``init_state``, ``embed``, ``block`` and ``lm_head``.
"""

from __future__ import annotations

import os
from typing import Any, Sequence

import ml_dtypes
import numpy as np

from harness.engines.base import EngineInfo
from harness.engines.oracle.qwen35 import Qwen35Oracle
from harness.engines.oracle.qwen35moe import Qwen35MoeOracle
from harness.model.gguf_model import GGUFModel, Override

FORMATS = {"bf16": ml_dtypes.bfloat16, "f16": np.float16}
"""Compute class → NumPy dtype of the format values are rounded to."""

RESIDUAL_SUMS = frozenset({"attn_residual", "post_ffn", "post_moe"})
"""Graph names (llama.cpp ``qwen35*.cpp``) of the residual-stream sums rounded after each add."""

NOT_MATMUL = ("ssm_conv1d",)
"""≥2-D layer tensors that are not matmul weights (the depthwise conv kernel): kept in float32."""


def round_to(x: np.ndarray, fmt: Any) -> np.ndarray:
    """``x`` rounded to ``fmt`` (round-to-nearest-even) and held as float32. Any shape."""
    return np.asarray(x, dtype=np.float32).astype(fmt).astype(np.float32)


class RoundedWeight(np.ndarray):
    """A weight already rounded to the format; any ``np.matmul`` it takes part in rounds the other
    operand to the same format and computes in float32 (a plain ndarray comes out)."""

    fmt: Any = None

    def __array_finalize__(self, obj: Any) -> None:
        self.fmt = getattr(obj, "fmt", None)

    def __array_ufunc__(self, ufunc: Any, method: str, *inputs: Any, **kwargs: Any) -> Any:
        fmt = next(getattr(i, "fmt", None) for i in inputs if isinstance(i, RoundedWeight))
        plain = [np.asarray(i).view(np.ndarray) if isinstance(i, RoundedWeight) else i for i in inputs]
        if ufunc is np.matmul and method == "__call__":
            plain = [round_to(p, fmt) for p in plain]
        return getattr(ufunc, method)(*plain, **kwargs)


def rounded_weight(x: np.ndarray, fmt: Any) -> RoundedWeight:
    w = round_to(x, fmt).view(RoundedWeight)
    w.fmt = fmt
    return w


class _RoundingEmit:
    """Wraps the oracle's recorder: the residual sums it names come back rounded."""

    def __init__(self, emit: Any, fmt: Any):
        self.emit, self.fmt = emit, fmt

    def __call__(self, name: str, il: int, x: np.ndarray) -> np.ndarray:
        if name in RESIDUAL_SUMS:
            x = round_to(x, self.fmt)
        return self.emit(name, il, x)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.emit, name)


class LowPrecisionMixin:
    """The overrides shared by both architectures' emulations (module docstring)."""

    compute_class = "bf16"

    @property
    def fmt(self) -> Any:
        return FORMATS[self.compute_class]

    @property
    def info(self) -> EngineInfo:
        i = super().info
        i.name = f"oracle-{self.compute_class}"
        i.version = i.version.replace("float64", f"{self.compute_class}-emulated")
        i.settings = {**i.settings, "dtype": f"{self.compute_class} matmul inputs and weights, float32 accumulation",
                      "residual": f"rounded to {self.compute_class} after each add"}
        i.compute_class = self.compute_class
        return i

    def load_layer(self, il: int) -> dict[str, np.ndarray]:
        w = super().load_layer(il)
        for k, v in list(w.items()):
            if v.ndim >= 2 and not k.startswith(NOT_MATMUL):
                w[k] = rounded_weight(v, self.fmt)
            else:
                w[k] = np.asarray(v, dtype=np.float32)
        return w

    def init_state(self, il: int, w: dict[str, np.ndarray]) -> dict[str, Any]:
        s = super().init_state(il, w)
        return {k: (v.astype(np.float32) if isinstance(v, np.ndarray) else v) for k, v in s.items()}

    def embed(self, tokens: np.ndarray) -> np.ndarray:
        return round_to(super().embed(tokens), self.fmt)

    def block(self, il: int, w: dict[str, np.ndarray], x: np.ndarray, state: dict[str, Any], pos: np.ndarray, emit: Any) -> np.ndarray:
        return super().block(il, w, x, state, pos, _RoundingEmit(emit, self.fmt))

    def lm_head(self, h: np.ndarray, dtype: Any = np.float32) -> np.ndarray:
        """Logits [B, V] as ``dtype``: ``h`` rounded to the format times the rounded output matrix
        (float32 accumulation), read in vocabulary slices of ``output_slice_rows``."""
        v = self.n_vocab
        hb = round_to(h, self.fmt)
        out = np.empty((h.shape[0], v), dtype=dtype)
        for r0 in range(0, v, self.output_slice_rows):
            r1 = min(v, r0 + self.output_slice_rows)
            out[:, r0:r1] = hb @ round_to(self.read_tensor(self._output_name, slice(r0, r1), np.float32), self.fmt).T
        return out


class Qwen35LowPrecision(LowPrecisionMixin, Qwen35Oracle):
    """``qwen35`` in an emulated low precision (``compute_class``: ``bf16`` or ``f16``)."""


class Qwen35MoeLowPrecision(LowPrecisionMixin, Qwen35MoeOracle):
    """``qwen35moe`` in an emulated low precision (``compute_class``: ``bf16`` or ``f16``)."""


def load_lowp_oracle(model: GGUFModel | str | os.PathLike, compute_class: str, overrides: Sequence[Override] = ()) -> Qwen35Oracle:
    """The ``oracle-<class>`` engine for ``model``; ``compute_class`` is ``bf16`` or ``f16``.

    Raises ``InvalidInput`` for an unreadable file or an unsupported architecture, ``KeyError``
    for another class."""
    if not isinstance(model, GGUFModel):
        model = GGUFModel(model, overrides)
    cls = {"qwen35": Qwen35LowPrecision, "qwen35moe": Qwen35MoeLowPrecision}[model.require_supported()]
    eng = cls(model)
    FORMATS[compute_class]  # noqa: B018 - a KeyError names an unknown class
    eng.compute_class = compute_class
    return eng
