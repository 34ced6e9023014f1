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

Several sequences (capability ``multi_seq``) are run as transformers-based trainers and engines
run them: **packed** into one row (``pack_sequences``), position ids restarting at 0 for each
sequence and, with ``packed="cu_seqlens"`` (the default), ``cu_seq_lens_q`` / ``cu_seq_lens_k``
with ``max_length_q`` / ``max_length_k``, the keyword arguments
``DataCollatorWithFlattening(return_flash_attn_kwargs=True)`` gives; ``packed="position_ids"`` gives
the position ids alone (the collator's default). The attention layers find the packing in the
position ids (``masking_utils.find_packed_sequence_indices``: a block-diagonal causal mask); the
Gated DeltaNet layers have only ``cu_seq_lens_q`` to go by, which they pass on as ``cu_seqlens``:
the flash-linear-attention kernels reset the conv and recurrent state there, and transformers 5.25's
PyTorch fallback refuses it (``ValueError``: "can't keep packed sequences apart without
flash-linear-attention"; transformers PR #46859: state leaked between packed sequences in the torch
fallback), so on CPU the default is UNMEASURED, naming that refusal. With the position ids alone
the fallback runs the row as one sequence, the conv and recurrent state carried across each
boundary: measured on ``fixture:trained-qwen35`` (sequences of 70, 45 and 90 tokens), the third
sequence's row 0 is at cosine 0.835 from its solo run (KLD 5.66, 11 of 90 argmaxes differ). Each
sequence's rows are judged against its solo run by the ``multiseq`` probe.

Needs the ``hf`` extra: ``pip install -e .[hf]`` (torch, transformers); without it a run is UNMEASURED (exit 5), naming the command.
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
PACKED = ("cu_seqlens", "position_ids")
"""How ``logits_multi`` tells transformers where each packed sequence starts: ``cu_seqlens`` (the
position ids and ``cu_seq_lens_q/k``) or ``position_ids`` (the position ids alone)."""
DTYPE_CLASS = {"float64": "f64", "float32": "f32", "bfloat16": "bf16", "float16": "f16"}
"""torch dtype → the engine's compute class (``harness.engines.base.COMPUTE_CLASSES``)."""


def _require_torch():
    """The ``torch`` module; ``Unmeasured`` (exit 5) naming the engine and the install command when
    torch or transformers is missing: nothing could be measured here, which is never a PASS."""
    try:
        import torch
        import transformers  # noqa: F401
    except ImportError:
        raise Unmeasured(
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
        packed: str = "cu_seqlens",
    ):
        if dtype not in DTYPES:
            raise InvalidInput(f"transformers engine dtype {dtype!r}: use one of {', '.join(DTYPES)}")
        if packed not in PACKED:
            raise InvalidInput(f"transformers engine packed {packed!r}: use one of {', '.join(PACKED)}")
        self.packed = packed
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
                "multi_seq": f"packed: one row, position ids restarting per sequence{', cu_seq_lens_q/k' if self.packed == 'cu_seqlens' else ''}",
                "overrides": [o.to_flag() for o in self.overrides],
            },
            capabilities=["chunks", "activations", "tokenize", "multi_seq", "dequantized_weights"],
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

    def _packed(self, sequences: Sequence[Sequence[int]]) -> Any:
        """Logits tensor [Σ T_i, V] (model dtype) of ``sequences`` packed into one row
        (``pack_sequences``), one forward without a cache. Raises ``Unmeasured`` where transformers
        refuses packed sequences (its PyTorch fallback of the gated delta rule given ``cu_seqlens``)."""
        torch = self.torch
        seqs = [self._check_tokens(q) for q in sequences]
        if not seqs or any(not q for q in seqs):
            raise EngineError("transformers: packed sequences need at least one sequence, each of at least one token")
        ids, pos, cu = pack_sequences(seqs)
        longest = int(np.diff(cu).max())
        flash = {"cu_seq_lens_q": torch.from_numpy(cu), "cu_seq_lens_k": torch.from_numpy(cu), "max_length_q": longest,
                 "max_length_k": longest} if self.packed == "cu_seqlens" else {}
        try:
            with torch.inference_mode():
                return self.lm(input_ids=torch.from_numpy(ids)[None], position_ids=torch.from_numpy(pos)[None], use_cache=False,
                               **flash).logits[0]
        except ValueError as e:
            if "packed sequences apart" not in str(e):
                raise
            import transformers

            raise Unmeasured(f"transformers {transformers.__version__} refuses packed sequences on this device "
                             f"({str(e).splitlines()[0][:200]})") from None

    def logits(self, tokens: Sequence[int], chunks: Sequence[int] | None = None) -> Iterator[LogitBlock]:
        """Yield ``(start, float32 [B, V])`` logit blocks; row t follows ``tokens[:t+1]``."""
        yield from self._blocks(self._run(tokens, chunks))

    def logits_multi(self, sequences: Sequence[Sequence[int]]) -> Iterator[LogitBlock]:
        """Capability ``multi_seq``: the sequences packed into one row and run in one forward
        (``pack_sequences``: position ids restarting per sequence, ``cu_seq_lens_q/k``); yields
        ``(start, float32 [B, V])`` blocks of the rows in order, ``sum(len(q))`` in all: row
        ``offset_i + t`` follows ``sequences[i][:t+1]`` when the packed path keeps the sequences
        apart. Raises ``EngineError`` for an empty sequence, token ids out of range or non-finite
        output, ``Unmeasured`` where transformers refuses packed sequences (``_packed``)."""
        yield from self._blocks(self._packed(sequences))

    def _blocks(self, logits: Any) -> Iterator[LogitBlock]:
        """A logits tensor [T, V] as float32 blocks; ``EngineError`` at its first non-finite row."""
        out = logits.float().numpy()
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


def pack_sequences(sequences: Sequence[Sequence[int]]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Sequences packed into one row as transformers' ``DataCollatorWithFlattening`` packs them:
    ``input_ids`` int64 [N] (the sequences concatenated, N = Σ T_i), ``position_ids`` int64 [N]
    (0 … T_i − 1 for each sequence) and ``cu_seqlens`` int32 [S + 1] (0, T_0, T_0 + T_1, …, N:
    each sequence's first row, the flash-attention and flash-linear-attention convention)."""
    lengths = [len(q) for q in sequences]
    ids = np.asarray([int(t) for q in sequences for t in q], dtype=np.int64)
    pos = np.concatenate([np.arange(n, dtype=np.int64) for n in lengths]) if lengths else np.zeros(0, np.int64)
    cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    return ids, pos, cu


def load_transformers(
    model_path: str | os.PathLike, overrides: Sequence[Override] = (), dtype: str = "float32", **settings: Any
) -> TransformersEngine:
    """The ``transformers`` engine for a qwen35 / qwen35moe GGUF (registry name ``transformers``).

    ``dtype`` ``float32`` (default), ``float64``, ``bfloat16`` or ``float16``; other settings: ``threads``, ``block_size``,
    ``tokenizer_dir`` (the model folder whose tokenizer files ``tokenize_text`` uses; None: UNMEASURED),
    ``packed`` (``PACKED``: how ``logits_multi`` marks the packed sequences).
    Raises ``InvalidInput`` with the install command when torch or transformers is missing.
    """
    return TransformersEngine(model_path, overrides, dtype=dtype, **settings)
