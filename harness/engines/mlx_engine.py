"""mlx-lm as a candidate engine: Apple's MLX Qwen3.5 (``mlx_lm/models/qwen3_5.py``,
``qwen3_5_moe.py``, ``gated_delta.py``), a forward pass nobody in this repository wrote.

mlx-lm loads a transformers folder, not a GGUF, so the engine writes one from the GGUF with the
harness's converter (``harness.fixtures.convert.write_transformers_folder``: NumPy and
safetensors, no torch), cached by the model's sha256 and overrides, or loads a folder the user
names (``folder=``, ``--mlx-folder``). It runs on MLX's CPU device (``mlx-cpu`` on Linux; on
macOS ``mlx`` runs there as well) in float32, bfloat16 or float16 (``dtype``); the compute class
follows (``DTYPE_CLASS``). Every float parameter is cast except ``A_log``, which mlx-lm's own
converter keeps in float32 (``TextModel.cast_predicate``); mlx-lm's gated delta rule and RMSNorms
run in the parameters' dtype otherwise.

MoE below float32 on the CPU backend: mlx-cpu 0.32.4's ``GatherMM`` (the routed experts'
``mx.gather_mm`` in ``mlx_lm/models/switch_layers.py`` ``SwitchLinear``) raises "Currently only
supports float32". Below float32 the engine therefore gives each loaded ``SwitchLinear`` a
``__call__`` (``ExpertMatmul``) that casts its bf16/f16 input and expert weights to float32 for
the product and rounds the result back to the compute dtype: what a bf16 GEMM with float32
accumulation computes (bf16 values are exact in float32, each product of two bf16 values is exact
in float32, the sum accumulates in float32, the output is rounded once to bf16). It is no upgrade
of the class: the weights and activations stay bf16 at every layer boundary, and mlx-cpu's own
dense ``mx.matmul`` in bf16 gives bit-identical results on the same gathered weights
(``tests/test_mlx_engine.py``). Nothing in mlx-lm itself is patched: only the instances of the
loaded model change class.

Capabilities: ``chunks`` (mlx-lm's prompt cache: ``KVCache`` for attention layers, ``ArraysCache``
with the conv and recurrent state for Gated DeltaNet layers, carried between calls),
``generate`` (greedy, one token per call through the cache) and ``prefix_reuse`` (a session's
cache state kept at each checkpoint and restored into a fresh cache, as a server restores a
prompt-cache entry), ``tokenize`` (``tokenize_text``: the tokenizer mlx-lm loads from the model
folder, ``mlx_lm.utils.load_tokenizer``, a ``TokenizerWrapper`` over transformers'
``AutoTokenizer``; what a user of mlx-lm gets). Only a folder of the user's (``--mlx-folder``)
holding ``tokenizer.json`` or ``tokenizer_config.json`` has a tokenizer of mlx-lm's own: the
folder the harness converts from the GGUF holds none, and building one from the GGUF's vocabulary
would be the harness checking its own conversion against llama.cpp, so there ``tokenize_text``
raises ``Unmeasured`` with that reason and ``harness tokenizer`` is UNMEASURED. Not
``multi_seq``: see docs/engines.md ("mlx-lm").

The pitfalls of driving mlx-lm by hand (docs/engines.md lists them), and what the engine checks
when it loads, each an ``EngineError`` naming the remedy:

- a bare ``qwen3_5_text`` config is refused by mlx-lm; the folder writer nests the text config
  under ``text_config`` with ``model_type`` ``qwen3_5`` / ``qwen3_5_moe``;
- mlx-lm's ``sanitize`` adds 1 to the layer, final and q/k norms only when some
  ``conv1d.weight`` still has the transformers layout ``[C, 1, K]``: the loaded
  ``input_layernorm`` and final norm are compared with the GGUF's ``attn_norm`` /
  ``output_norm`` (which store 1 + w), so a norm shifted twice or not at all is named;
- mlx-lm builds layer i as full attention iff ``(i + 1) % full_attention_interval == 0`` and
  ignores ``layer_types``: the schedule it built is compared with the GGUF's
  (``Qwen35HParams.recurrent``);
- mlx-lm drops ``mtp.*`` weights; the folder writer writes trunk-only models and refuses MTP blocks.

Needs the ``mlx`` extra: ``pip install -e .[mlx]``; without it a run is UNMEASURED (exit 5), naming the command.
"""

from __future__ import annotations

import json
import os
from functools import cached_property
from pathlib import Path
from typing import Any, Iterator, Sequence

import numpy as np

from harness.engines.base import EngineInfo, LogitBlock, validate_chunks
from harness.errors import EngineError, InvalidInput, NotComparable, Unmeasured
from harness.model.gguf_model import GGUFModel, Override

DTYPES = ("float32", "bfloat16", "float16")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
"""The files of a model folder that make mlx-lm's tokenizer (``mlx_lm.tokenizer_utils.load``)."""
DTYPE_CLASS = {"float32": "f32", "bfloat16": "bf16", "float16": "f16"}
"""MLX dtype name → the engine's compute class (``harness.engines.base.COMPUTE_CLASSES``)."""
NORM_PROBES = (("language_model.model.layers.0.input_layernorm.weight", "blk.0.attn_norm.weight"),
               ("language_model.model.norm.weight", "output_norm.weight"))
"""(mlx-lm parameter, GGUF tensor) pairs compared after loading: GGUF stores 1 + w, mlx-lm
multiplies by its loaded weight, so the two must be equal."""


def schedule_mismatch(recurrent: Sequence[bool], interval: int) -> str | None:
    """None when mlx-lm's rule (layer i is full attention iff ``(i + 1) % interval == 0``) builds
    the schedule ``recurrent`` (True: Gated DeltaNet, per trunk layer), else the message naming
    both schedules and the remedy."""
    built = [(i + 1) % interval != 0 for i in range(len(recurrent))] if interval > 0 else [True] * len(recurrent)
    if built == [bool(r) for r in recurrent]:
        return None
    at = lambda s: [i for i, r in enumerate(s) if not r]  # noqa: E731
    return (f"mlx-lm would build full attention at layers {at(built)} (full_attention_interval {interval}), the model has it "
            f"at {at(recurrent)}: mlx-lm reads full_attention_interval and ignores layer_types, so it cannot run this "
            "schedule; remedy: a model with full attention at every k-th layer, or an mlx-lm whose DecoderLayer reads "
            "layer_types (mlx_lm/models/qwen3_5.py)")


_EXPERT_MATMUL: dict[str, type] = {}


def expert_matmul_class() -> type:
    """``ExpertMatmul``: a subclass of mlx-lm's ``SwitchLinear`` (built once, on first use, so
    that importing this module needs no mlx) whose ``__call__`` computes the routed experts'
    ``gather_mm`` in float32 from bf16/f16 inputs and weights and rounds the product to the
    input's dtype (module docstring: float32 accumulation, one rounding). Shapes as mlx-lm's:
    ``x`` ``[..., 1, D_in]``, ``indices`` ``[..., k]``, weight ``[E, D_out, D_in]``, result
    ``[..., k, 1, D_out]`` in ``x.dtype``; a float32 call is mlx-lm's own."""
    if "cls" not in _EXPERT_MATMUL:
        import mlx.core as mx
        from mlx_lm.models.switch_layers import SwitchLinear

        class ExpertMatmul(SwitchLinear):
            def __call__(self, x: Any, indices: Any, sorted_indices: bool = False) -> Any:
                w = self["weight"]
                if x.dtype == mx.float32 and w.dtype == mx.float32:
                    return super().__call__(x, indices, sorted_indices=sorted_indices)
                out = mx.gather_mm(x.astype(mx.float32), w.astype(mx.float32).swapaxes(-1, -2),
                                   rhs_indices=indices, sorted_indices=sorted_indices).astype(x.dtype)
                if "bias" in self:
                    out = out + mx.expand_dims(self["bias"][indices], -2)
                return out

        _EXPERT_MATMUL["cls"] = ExpertMatmul
    return _EXPERT_MATMUL["cls"]


def accumulate_experts_in_f32(model: Any) -> int:
    """Turn every mlx-lm ``SwitchLinear`` of ``model`` (an ``mlx.nn.Module``) into an
    ``ExpertMatmul`` in place (``expert_matmul_class``); returns how many. Only these instances
    change: mlx-lm's class and other models are untouched."""
    from mlx_lm.models.switch_layers import SwitchLinear

    cls, n = expert_matmul_class(), 0
    for _, module in model.named_modules():
        if type(module) is SwitchLinear:
            module.__class__ = cls
            n += 1
    return n


def _require_mlx() -> tuple[Any, Any]:
    """``(mlx.core, mlx_lm)``; ``Unmeasured`` (exit 5) naming the engine and the install command when
    either is missing: nothing could be measured here, which is no bad input and never a PASS."""
    try:
        import mlx.core as mx
        import mlx_lm
    except ImportError:
        raise Unmeasured("the mlx engine needs mlx and mlx-lm, which are not installed: pip install -e .[mlx]") from None
    return mx, mlx_lm


def _distribution_version(name: str) -> str:
    from importlib import metadata

    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "unknown"


class MlxEngine:
    """mlx-lm on MLX's CPU device, bound to one GGUF (see the module docstring).

    ``logits(tokens, chunks)`` yields ``(start, float32 [B, V])`` blocks; with ``chunks`` the
    prompt is fed piece by piece through one prompt cache. Raises ``InvalidInput`` for a dtype it
    does not run, a model the converter cannot express or a missing install, and
    ``EngineError`` for a folder mlx-lm cannot load, a pitfall seen at load, token ids out of
    range or non-finite output.
    """

    name = "mlx"

    def __init__(
        self,
        model_path: str | os.PathLike,
        overrides: Sequence[Override] = (),
        dtype: str = "float32",
        folder: str | os.PathLike | None = None,
        block_size: int = 256,
    ):
        if dtype not in DTYPES:
            raise InvalidInput(f"mlx engine dtype {dtype!r}: use one of {', '.join(DTYPES)}")
        self.mx, self.mlx_lm = _require_mlx()
        self.model_path = Path(model_path)
        self.overrides = list(overrides)
        self.gguf = GGUFModel(self.model_path, self.overrides)
        self.gguf.require_supported()
        self.dtype = dtype
        self.user_folder = Path(folder) if folder is not None else None
        self.block_size = block_size
        self.sessions: dict[str, dict[int, list[Any]]] = {}
        self.expert_matmuls = 0
        """How many routed-expert ``SwitchLinear`` layers run through ``ExpertMatmul`` (0 at float32)."""

    # -- loading ----------------------------------------------------------------------------
    @cached_property
    def folder(self) -> Path:
        """The transformers folder mlx-lm loads: the user's, or the converter's (cached)."""
        if self.user_folder is not None:
            if not (self.user_folder / "config.json").is_file():
                raise InvalidInput(f"{self.user_folder}: not a transformers folder (no config.json)")
            return self.user_folder
        from harness.fixtures.convert import cached_transformers_folder

        return cached_transformers_folder(self.gguf)

    @cached_property
    def model(self) -> Any:
        """The mlx-lm model (loaded on first use, checked, then cast to ``dtype``)."""
        mx = self.mx
        mx.set_default_device(mx.cpu)
        from mlx_lm.utils import load_model

        self._check_same_model()
        self._check_schedule()
        try:
            model, _ = load_model(self.folder)
        except (ValueError, KeyError, FileNotFoundError, TypeError) as e:
            raise EngineError(f"mlx-lm cannot load {self.folder}: {' '.join(str(e).split())[:300]}") from None
        self._check_norms(model)
        if self.dtype != "float32":
            from mlx.utils import tree_flatten, tree_unflatten

            keep = getattr(model, "cast_predicate", lambda path: True)
            target = getattr(mx, self.dtype)
            params = [(k, v.astype(target) if keep(k) and mx.issubdtype(v.dtype, mx.floating) else v)
                      for k, v in tree_flatten(model.parameters())]
            model.update(tree_unflatten(params))
            self.expert_matmuls = accumulate_experts_in_f32(model)
        mx.eval(model.parameters())
        return model

    def _text_config(self) -> dict[str, Any]:
        """The folder's text config (``text_config`` of ``config.json``, else the whole file).
        Raises ``EngineError`` for a config that is not readable JSON."""
        try:
            top = json.loads((self.folder / "config.json").read_text())
        except (OSError, ValueError) as e:
            raise EngineError(f"mlx: {self.folder}/config.json is not readable JSON ({e})") from None
        text = top.get("text_config", top) if isinstance(top, dict) else {}
        return text if isinstance(text, dict) else {}

    def _other_model(self, what: str) -> NotComparable:
        """The refusal of a ``--mlx-folder`` that holds another model than the GGUF (exit 4,
        NOT-COMPARABLE: the two sides would run different models), naming the folder."""
        return NotComparable(f"--mlx-folder {self.user_folder} holds another model than {self.gguf.path.name}: {what}")

    def _check_same_model(self) -> None:
        """A user's folder against the GGUF before loading: its text config's ``vocab_size``,
        ``hidden_size`` and ``num_hidden_layers`` must be the GGUF's ``n_vocab``, ``n_embd`` and
        trunk ``n_layer``. Raises ``NotComparable`` naming the folder and the first field that
        differs."""
        if self.user_folder is None:
            return
        text, hp = self._text_config(), self.gguf.hparams
        for key, want in (("vocab_size", self.n_vocab), ("hidden_size", hp.n_embd), ("num_hidden_layers", hp.n_layer)):
            got = text.get(key)
            if got is not None and got != want:
                raise self._other_model(f"its config.json has {key} {got!r}, the GGUF {want}")

    def _check_schedule(self) -> None:
        """The schedule mlx-lm will build (``full_attention_interval`` of the folder's text config
        only, default 4 as in mlx-lm's ``TextModelArgs``) against the GGUF's, before loading:
        a mismatch would otherwise surface as mlx-lm's missing/unexpected-parameter error."""
        text, hp = self._text_config(), self.gguf.hparams
        message = schedule_mismatch([hp.is_recurrent(i) for i in range(hp.n_layer)], int(text.get("full_attention_interval", 4)))
        if message:
            raise EngineError(f"mlx: {message}")

    def _check_norms(self, model: Any) -> None:
        """The loaded norm weights against the GGUF's (which already hold 1 + w)."""
        from mlx.utils import tree_flatten

        params = dict(tree_flatten(model.parameters()))
        for mname, gname in NORM_PROBES:
            if mname not in params or not self.gguf.has_tensor(gname):
                continue
            got = np.array(params[mname].astype(self.mx.float32)).reshape(-1)
            want = np.asarray(self.gguf.tensor(gname, dtype=np.float32)).reshape(-1)
            if got.shape != want.shape or np.allclose(got, want, rtol=1e-5, atol=1e-5):
                continue
            if np.allclose(got, want + 1.0, rtol=1e-5, atol=1e-5):
                raise EngineError(
                    f"mlx-lm loaded {mname} as the GGUF's {gname} + 1: the norm is shifted twice. mlx-lm's sanitize adds 1 "
                    "to the norms whenever a conv1d.weight has the transformers layout [C, 1, K], and this folder's norms "
                    "already hold 1 + w; remedy: store the norms as transformers does (w, unshifted), or let the harness "
                    "write the folder (drop --mlx-folder)")
            if np.allclose(got, want - 1.0, rtol=1e-5, atol=1e-5):
                raise EngineError(
                    f"mlx-lm loaded {mname} as the GGUF's {gname} - 1: the norm shift is missing. mlx-lm adds 1 only when a "
                    "conv1d.weight has the transformers layout [C, 1, K]; this folder's conv1d is already in mlx's layout "
                    "[C, K, 1] with unshifted norms; remedy: store conv1d as [C, 1, K], or the norms as 1 + w")
            what = (f"mlx-lm loaded {mname} with values that are not the GGUF's {gname} "
                    f"(max |diff| {float(np.max(np.abs(got - want))):.3g})")
            if self.user_folder is not None:
                raise self._other_model(what)
            raise EngineError(f"{what}: the folder {self.folder} holds other weights")

    @property
    def n_vocab(self) -> int:
        return int(self.gguf.tensor_info("token_embd.weight").ne[1])

    @property
    def info(self) -> EngineInfo:
        moe_below_f32 = self.dtype != "float32" and self.gguf.hparams.is_moe
        experts = {"expert_matmul": f"gather_mm in float32, rounded to {self.dtype} (ExpertMatmul)"} if moe_below_f32 else {}
        return EngineInfo(
            name=self.name,
            version=f"mlx-lm {_distribution_version('mlx-lm')}, mlx {_distribution_version('mlx')}",
            settings={
                **experts,
                "dtype": self.dtype,
                "device": "cpu",
                "backend": "cpu",
                "folder": "user" if self.user_folder is not None else "converted",
                "tokenizer": ", ".join(self.tokenizer_files()) or "none of its own",
                "overrides": [o.to_flag() for o in self.overrides],
            },
            capabilities=["chunks", "generate", "prefix_reuse", "tokenize"]
            + (["dequantized_weights"] if self.user_folder is None else []),  # a user's folder: its own weights
            build={"engine": f"{__name__}.MlxEngine", "loader": "harness.fixtures.convert.write_transformers_folder"},
            compute_class=DTYPE_CLASS[self.dtype],
        )

    # -- tokenizer ------------------------------------------------------------------------
    def tokenizer_files(self) -> list[str]:
        """The ``TOKENIZER_FILES`` present in the user's folder; ``[]`` for the converted folder
        (the harness writes none) or a user folder without them."""
        if self.user_folder is None:
            return []
        return [f for f in TOKENIZER_FILES if (self.user_folder / f).is_file()]

    @cached_property
    def tokenizer(self) -> Any:
        """mlx-lm's tokenizer of the folder (``mlx_lm.utils.load_tokenizer``, offline). Raises
        ``Unmeasured`` when the folder has no tokenizer files of its own (the converted folder:
        module docstring), ``InvalidInput`` when mlx-lm cannot load them."""
        if self.user_folder is None:
            raise Unmeasured("mlx has no tokenizer of its own for this model: the harness writes mlx-lm's folder from the GGUF "
                             "(harness.fixtures.convert) with no tokenizer files, and a tokenizer built from the GGUF's vocabulary "
                             "would be the harness checking its own conversion against llama.cpp, not mlx-lm; pass the model "
                             "folder with its own tokenizer.json / tokenizer_config.json with --mlx-folder DIR")
        if not self.tokenizer_files():
            raise Unmeasured(f"mlx has no tokenizer of its own for this model: {self.user_folder} holds neither "
                             f"{' nor '.join(TOKENIZER_FILES)}")
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        from mlx_lm.utils import load_tokenizer

        try:
            return load_tokenizer(self.user_folder)
        except (OSError, ValueError, KeyError, TypeError) as e:
            first = str(e).splitlines()[0][:200] if str(e) else type(e).__name__
            raise InvalidInput(f"mlx-lm cannot load a tokenizer from {self.user_folder} ({first})") from None

    def tokenize_text(self, text: str, add_special: bool = False) -> list[int]:
        """Token ids of ``text`` by mlx-lm's tokenizer of the folder (capability ``tokenize``:
        ``TokenizerWrapper.encode(text, add_special_tokens=add_special)``, the call mlx-lm's
        ``generate`` makes with the default True; special-token strings in the text are matched as
        transformers does). Raises ``Unmeasured`` / ``InvalidInput`` as ``tokenizer``."""
        ids = self.tokenizer.encode(str(text), add_special_tokens=bool(add_special))
        return [int(t) for t in ids]

    # -- forward --------------------------------------------------------------------------
    def _check_tokens(self, tokens: Sequence[int]) -> list[int]:
        toks = [int(t) for t in tokens]
        bad = [t for t in toks if not 0 <= t < self.n_vocab]
        if bad:
            raise EngineError(f"mlx: token id {bad[0]} out of range [0, {self.n_vocab})")
        return toks

    def _step(self, toks: Sequence[int], cache: Any) -> np.ndarray:
        """One model call on ``toks`` (with ``cache``, or none): float32 ``[len(toks), V]``."""
        mx = self.mx
        out = self.model(mx.array([list(toks)]), cache=cache)[0].astype(mx.float32)
        rows = np.array(out, dtype=np.float32)
        if not np.isfinite(rows).all():
            raise EngineError(f"mlx: non-finite logits at position {int(np.argwhere(~np.isfinite(rows))[0, 0])} of a call")
        return rows

    def _fresh_cache(self) -> list[Any]:
        from mlx_lm.models.cache import make_prompt_cache

        return make_prompt_cache(self.model)

    def logits(self, tokens: Sequence[int], chunks: Sequence[int] | None = None) -> Iterator[LogitBlock]:
        """Yield ``(start, float32 [B, V])`` logit blocks; row t follows ``tokens[:t+1]``. Whole
        (``chunks`` None): one call without a cache; else one call per piece through one cache."""
        toks = self._check_tokens(tokens)
        pieces = validate_chunks(len(toks), chunks)
        if chunks is None:
            out = self._step(toks, None)
        else:
            cache, pos, parts = self._fresh_cache(), 0, []
            for n in pieces:
                parts.append(self._step(toks[pos:pos + n], cache))
                pos += n
            out = np.concatenate(parts, axis=0)
        for start in range(0, out.shape[0], self.block_size):
            yield start, np.ascontiguousarray(out[start:start + self.block_size])

    def generate(self, tokens: Sequence[int], n_tokens: int) -> list[int]:
        """Greedy continuation (argmax, ties to the lowest id) of ``tokens``: the prompt in one
        call, then each chosen token fed back one per call through the cache. Returns ``n_tokens`` ids."""
        toks = self._check_tokens(tokens)
        if not toks:
            raise EngineError("mlx: generate needs at least one prompt token")
        cache, out = self._fresh_cache(), []
        last = self._step(toks, cache)[-1]
        while len(out) < n_tokens:
            out.append(int(np.argmax(last)))
            if len(out) < n_tokens:
                last = self._step([out[-1]], cache)[-1]
        return out

    # -- sessions (prefix_reuse) ------------------------------------------------------------
    def _snapshot(self, cache: list[Any]) -> list[Any]:
        """Each layer's state as evaluated arrays: ``(keys, values)`` up to the offset for a
        ``KVCache``, the ``[conv, recurrent]`` list for an ``ArraysCache``."""
        snap: list[Any] = []
        for c in cache:
            if hasattr(c, "keys"):
                kv = (None, None) if c.keys is None else (c.keys[..., :c.offset, :], c.values[..., :c.offset, :])
                snap.append(("kv", kv, c.offset))
            else:
                snap.append(("arrays", list(c.cache), None))
        self.mx.eval([a for _, arrays, _ in snap for a in arrays if a is not None])
        return snap

    def _restore(self, snap: list[Any]) -> list[Any]:
        """A fresh prompt cache holding ``snap`` (the snapshot is not shared with it)."""
        cache = self._fresh_cache()
        for c, (kind, arrays, offset) in zip(cache, snap):
            if kind == "kv":
                c.keys, c.values = arrays
                c.offset = offset
            else:
                c.cache = list(arrays)
        return cache

    def session_logits(self, tokens: Sequence[int], *, session: str, parent: str | None = None, after: int = 0,
                       checkpoints: Sequence[int] = ()) -> Iterator[LogitBlock]:
        """Feed ``tokens`` from ``parent``'s state after ``after`` tokens (None: fresh), keep the
        state under ``session`` at the end and at each of ``checkpoints`` (positions in the
        session's whole history); yields ``tokens``' rows (``harness.engines.base.Engine``,
        capability ``prefix_reuse``). Raises ``EngineError`` for a parent without that checkpoint."""
        toks = self._check_tokens(tokens)
        if parent is None:
            cache, keep = self._fresh_cache(), {}
        else:
            states = self.sessions.get(parent, {})
            if after not in states:
                raise EngineError(f"mlx: session {parent!r} has no state after {after} tokens")
            cache = self._restore(states[after])
            keep = dict(states) if parent == session else {}
        cuts = sorted({int(k) - after for k in checkpoints if after < int(k) < after + len(toks)} | {len(toks)})
        parts, done = [], 0
        for cut in cuts:
            if cut > done:
                parts.append(self._step(toks[done:cut], cache))
            keep[after + cut] = self._snapshot(cache)
            done = cut
        self.sessions[session] = keep
        out = np.concatenate(parts, axis=0) if parts else np.zeros((0, self.n_vocab), np.float32)
        for start in range(0, out.shape[0], self.block_size):
            yield start, np.ascontiguousarray(out[start:start + self.block_size])

    def drop_sessions(self) -> None:
        """Forget every session's kept states."""
        self.sessions.clear()


def load_mlx(model_path: str | os.PathLike, overrides: Sequence[Override] = (), dtype: str = "float32", **settings: Any) -> MlxEngine:
    """The ``mlx`` engine for a qwen35 / qwen35moe GGUF (registry name ``mlx``).

    ``dtype`` ``float32`` (default), ``bfloat16`` or ``float16``; other settings: ``folder`` (a
    transformers folder to load instead of converting the GGUF; its tokenizer files, if any, are
    what ``tokenize_text`` uses), ``block_size``. Raises
    ``InvalidInput`` with the install command when mlx or mlx-lm is missing.
    """
    return MlxEngine(model_path, overrides, dtype=dtype, **settings)
