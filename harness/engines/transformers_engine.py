"""transformers as a candidate engine: a third, independently written Qwen3.5 forward pass.

The GGUF is turned back into a transformers ``Qwen3_5ForCausalLM`` / ``Qwen3_5MoeForCausalLM``
by the inverse conversion (``harness.fixtures.convert.to_transformers``) and run on CPU in float32
(``--dtype float64``, ``bfloat16`` or ``float16`` on request). Where the oracle and transformers
agree and a candidate does not, the candidate is wrong.

Numerics worth knowing (transformers 5 ``models/qwen3_5*/modeling_*.py``): the RMSNorms and the
gated delta rule cast to float32 internally whatever the model dtype, so float64 mode is float64
in the matmuls and attention only, and bfloat16/float16 mode is how GPU serving engines run
Qwen3.5: low-precision weights, matmuls and residual stream with float32 norms and recurrent
state. Its compute class (``DTYPE_CLASS``) says so: ``bf16`` / ``f16``, not ``mixed``, since the
f32 islands are the ones every such engine keeps. Without flash-linear-attention / causal-conv1d installed,
transformers uses its reference PyTorch kernels (chunked gated delta rule for prompts, the
recurrent rule for single-token steps).

Needs the ``hf`` extra: ``pip install -e .[hf]`` (torch, transformers).
"""

from __future__ import annotations

import os
from functools import cached_property
from pathlib import Path
from typing import Any, Collection, Iterator, Sequence

import numpy as np

from harness.engines.base import EngineInfo, LogitBlock, validate_chunks
from harness.errors import EngineError, InvalidInput, Unmeasured
from harness.model.gguf_model import GGUFModel, Override

DTYPES = ("float32", "float64", "bfloat16", "float16")
DTYPE_CLASS = {"float64": "f64", "float32": "f32", "bfloat16": "bf16", "float16": "f16"}
"""torch dtype → the engine's compute class (``harness.engines.base.COMPUTE_CLASSES``)."""


def _require_torch():
    try:
        import torch
        import transformers  # noqa: F401
    except ImportError:
        raise InvalidInput(
            "the transformers engine needs torch and transformers, which are not installed: pip install -e .[hf]"
        ) from None
    return torch


class TransformersEngine:
    """transformers on CPU, bound to one GGUF (converted back to a transformers model on first use).

    ``logits(tokens, chunks)`` yields ``(start, float32 [B, V])`` blocks; with ``chunks`` the
    prompt is fed piece by piece with transformers' cache (attention KV and DeltaNet conv and
    recurrent states) carried between calls. ``activations`` returns per-layer tensors under
    llama.cpp's graph names. Raises ``InvalidInput`` for a model the inverse conversion cannot
    express and ``EngineError`` for token ids out of range or non-finite output.
    """

    name = "transformers"

    def __init__(
        self,
        model_path: str | os.PathLike,
        overrides: Sequence[Override] = (),
        dtype: str = "float32",
        threads: int | None = None,
        block_size: int = 256,
        tokenizer_dir: str | os.PathLike | None = None,
    ):
        if dtype not in DTYPES:
            raise InvalidInput(f"transformers engine dtype {dtype!r}: use one of {', '.join(DTYPES)}")
        self.torch = _require_torch()
        self.model_path = Path(model_path)
        self.overrides = list(overrides)
        self.gguf = GGUFModel(self.model_path, self.overrides)
        self.gguf.require_supported()
        self.dtype = dtype
        self.threads = threads
        self.block_size = block_size
        self.tokenizer_dir = Path(tokenizer_dir) if tokenizer_dir else None

    @cached_property
    def lm(self) -> Any:
        """The transformers model (built on first use; InvalidInput if it cannot be)."""
        os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never look for hub kernels
        if self.threads:
            self.torch.set_num_threads(self.threads)
        from harness.fixtures.convert import to_transformers  # NumPy-to-torch conversion: only when the engine runs

        return to_transformers(self.gguf, getattr(self.torch, self.dtype))

    @property
    def n_vocab(self) -> int:
        return int(self.gguf.tensor_info("token_embd.weight").ne[1])

    @property
    def info(self) -> EngineInfo:
        import transformers

        return EngineInfo(
            name=self.name,
            version=f"transformers {transformers.__version__}, torch {self.torch.__version__}",
            settings={
                "dtype": self.dtype,
                "threads": self.torch.get_num_threads(),
                "attn_implementation": "sdpa",
                "device": "cpu",
                "overrides": [o.to_flag() for o in self.overrides],
            },
            capabilities=["chunks", "activations", "tokenize"],
            build={"engine": f"{__name__}.TransformersEngine", "loader": "harness.fixtures.convert.to_transformers",
                   "tokenizer_dir": None if self.tokenizer_dir is None else str(self.tokenizer_dir)},
            compute_class=DTYPE_CLASS[self.dtype],
        )

    # -- tokenizer ------------------------------------------------------------------------
    @cached_property
    def tokenizer(self) -> Any:
        """The tokenizer transformers loads from ``tokenizer_dir`` (``AutoTokenizer.from_pretrained``:
        the model folder's ``tokenizer.json`` / ``tokenizer_config.json``, what a user of
        transformers gets). Raises ``Unmeasured`` without a folder: the model is built from the
        GGUF by the harness's own converter, so there is no tokenizer of transformers' own to
        judge, and ``InvalidInput`` for a folder transformers cannot load a tokenizer from."""
        if self.tokenizer_dir is None:
            raise Unmeasured("transformers has no tokenizer of its own for this model: the harness builds the model from the GGUF "
                             "(harness.fixtures.convert), and judging its own conversion against llama.cpp would not judge "
                             "transformers; pass the model folder's tokenizer with --tokenizer-dir DIR")
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        from transformers import AutoTokenizer

        try:
            return AutoTokenizer.from_pretrained(str(self.tokenizer_dir))
        except (OSError, ValueError, KeyError) as e:
            raise InvalidInput(f"transformers cannot load a tokenizer from {self.tokenizer_dir} ({str(e).splitlines()[0][:200] if str(e) else type(e).__name__})") from None

    def tokenize_text(self, text: str, add_special: bool = False) -> list[int]:
        """Token ids of ``text`` by ``tokenizer`` (capability ``tokenize``;
        ``add_special_tokens=add_special``). Raises ``Unmeasured`` / ``InvalidInput`` as ``tokenizer``."""
        ids = self.tokenizer(str(text), add_special_tokens=bool(add_special))["input_ids"]
        return [int(t) for t in ids]

    # -- forward --------------------------------------------------------------------------
    def _check_tokens(self, tokens: Sequence[int]) -> list[int]:
        toks = [int(t) for t in tokens]
        bad = [t for t in toks if not 0 <= t < self.n_vocab]
        if bad:
            raise EngineError(f"transformers: token id {bad[0]} out of range [0, {self.n_vocab})")
        return toks

    def _run(self, tokens: Sequence[int], chunks: Sequence[int] | None) -> Any:
        """Logits tensor [T, V] (model dtype) for ``tokens`` fed whole or as ``chunks``."""
        torch = self.torch
        toks = self._check_tokens(tokens)
        pieces = validate_chunks(len(toks), chunks)
        lm = self.lm
        outs = []
        with torch.inference_mode():
            if chunks is None:
                outs.append(lm(input_ids=torch.tensor([toks]), use_cache=False).logits[0])
            else:
                cache = None
                pos = 0
                for n in pieces:
                    o = lm(input_ids=torch.tensor([toks[pos : pos + n]]), cache=cache, use_cache=True)
                    cache = o.cache
                    outs.append(o.logits[0])
                    pos += n
        return torch.cat(outs, dim=0)

    def logits(self, tokens: Sequence[int], chunks: Sequence[int] | None = None) -> Iterator[LogitBlock]:
        """Yield ``(start, float32 [B, V])`` logit blocks; row t follows ``tokens[:t+1]``."""
        out = self._run(tokens, chunks).float().numpy()
        if not np.isfinite(out).all():
            t = int(np.argwhere(~np.isfinite(out))[0, 0])
            raise EngineError(f"transformers: non-finite logits at position {t}")
        for start in range(0, out.shape[0], self.block_size):
            yield start, np.ascontiguousarray(out[start : start + self.block_size])

    def activations(
        self, tokens: Sequence[int], chunks: Sequence[int] | None = None, names: Collection[str] | None = None
    ) -> dict[str, np.ndarray]:
        """Per-layer tensors under llama.cpp's names (``src/models/qwen35.cpp`` ``cb()`` calls),
        position-major ``[T, n]`` in the model dtype: ``attn_norm-N``, ``linear_attn_out-N`` or
        ``attn_output-N``, ``attn_residual-N``, ``attn_post_norm-N``, ``ffn_out-N``, ``l_out-N``,
        ``result_norm`` and ``result_output`` [T, V]. ``names`` keeps only those names (exact,
        like ``l_out-3``, or by op, like ``l_out``); None keeps all.
        """
        lm = self.lm
        store: dict[str, list[Any]] = {}

        def keep(name: str) -> bool:
            return names is None or name in names or name.rsplit("-", 1)[0] in names

        def save(name: str, x: Any) -> None:
            if keep(name):
                x = x[0] if isinstance(x, tuple) else x
                store.setdefault(name, []).append(x.detach().reshape(-1, x.shape[-1]).clone())

        hooks = []
        for il, layer in enumerate(lm.model.layers):
            mixer, mixer_name = (
                (layer.linear_attn, "linear_attn_out") if hasattr(layer, "linear_attn") else (layer.self_attn, "attn_output")
            )
            hooks += [
                layer.input_layernorm.register_forward_hook(lambda m, i, o, il=il: save(f"attn_norm-{il}", o)),
                mixer.register_forward_hook(lambda m, i, o, il=il, n=mixer_name: save(f"{n}-{il}", o)),
                layer.post_attention_layernorm.register_forward_pre_hook(lambda m, i, il=il: save(f"attn_residual-{il}", i[0])),
                layer.post_attention_layernorm.register_forward_hook(lambda m, i, o, il=il: save(f"attn_post_norm-{il}", o)),
                layer.mlp.register_forward_hook(lambda m, i, o, il=il: save(f"ffn_out-{il}", o)),
                layer.register_forward_hook(lambda m, i, o, il=il: save(f"l_out-{il}", o)),
            ]
        hooks.append(lm.model.norm.register_forward_hook(lambda m, i, o: save("result_norm", o)))
        try:
            logits = self._run(tokens, chunks)
        finally:
            for h in hooks:
                h.remove()
        out = {k: self.torch.cat(v, dim=0).float().numpy() if self.dtype in ("bfloat16", "float16") else self.torch.cat(v, dim=0).numpy()
               for k, v in store.items()}
        if keep("result_output"):
            out["result_output"] = logits.float().numpy()
        return out


def load_transformers(
    model_path: str | os.PathLike, overrides: Sequence[Override] = (), dtype: str = "float32", **settings: Any
) -> TransformersEngine:
    """The ``transformers`` engine for a qwen35 / qwen35moe GGUF (registry name ``transformers``).

    ``dtype`` ``float32`` (default), ``float64``, ``bfloat16`` or ``float16``; other settings: ``threads``, ``block_size``,
    ``tokenizer_dir`` (the model folder whose tokenizer files ``tokenize_text`` uses; None: UNMEASURED).
    Raises ``InvalidInput`` with the install command when torch or transformers is missing.
    """
    return TransformersEngine(model_path, overrides, dtype=dtype, **settings)
