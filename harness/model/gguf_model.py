"""Open a qwen35 / qwen35moe GGUF with the `gguf` package: metadata, hyperparameters, tensors.

Tensors come back in NumPy order (the reverse of ggml's ``ne``): a ggml ``[d, ff]`` matrix is a
NumPy ``(ff, d)`` array, so ``W @ x`` applies it. Quantized tensors are dequantized by
``gguf.quants.dequantize``. Metadata overrides have llama.cpp's ``--override-kv KEY=TYPE:VALUE``
meaning: they change what the harness reads, never the file.

Sources: llama.cpp ``src/models/qwen35.cpp`` / ``qwen35moe.cpp`` (``load_arch_hparams``),
``gguf-py/gguf/constants.py`` (key names).
"""

from __future__ import annotations

import math
import os
import struct
from collections import OrderedDict
from dataclasses import asdict, dataclass
from functools import cached_property, lru_cache
from pathlib import Path
from typing import Any, Iterable

import numpy as np
from gguf import (
    GGML_QUANT_SIZES,
    GGMLQuantizationType,
    GGUFReader,
    GGUFValueType,
    LlamaFileType,
)
from gguf.gguf_reader import ReaderField
from gguf.quants import dequantize

from harness.errors import InvalidInput
from harness.provenance import sha256_file

SUPPORTED_ARCHES = ("qwen35", "qwen35moe")

OVERRIDE_TYPES = ("int", "float", "bool", "str")
INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1
"""llama.cpp stores an ``int`` override as ``int64_t`` (``llama_model_kv_override``)."""
LLAMA_MAX_LAYERS = 512
"""llama.cpp's ``LLAMA_MAX_LAYERS`` (``src/llama-hparams.h``): its per-layer arrays hold this many
entries and it refuses a larger ``block_count``."""
NOT_TENSOR_SIZES = ("context_length", "full_attention_interval")
"""Integer hyperparameters that are not sizes of any tensor (the rest are bounded by the file)."""

DEQUANT_CHUNK = 1 << 20
"""Elements per ``gguf.quants.dequantize`` call in ``GGUFModel.tensor`` (about 4 MB of float32)."""


@dataclass(frozen=True)
class Override:
    """One ``--override-kv KEY=TYPE:VALUE`` (llama.cpp ``common/arg.cpp`` syntax)."""

    key: str
    type: str
    value: Any

    def to_flag(self) -> str:
        v = self.value
        if self.type == "bool":
            v = "true" if v else "false"
        return f"{self.key}={self.type}:{v}"


def parse_override(text: str) -> Override:
    """Parse ``KEY=TYPE:VALUE`` (TYPE in int, float, bool, str) into an ``Override``.

    Raises ``InvalidInput`` (exit 2) with the accepted syntax on any malformed string, an int
    outside int64 or a float that is not finite.
    """
    key, sep, rest = text.partition("=")
    typ, sep2, raw = rest.partition(":")
    if not sep or not sep2 or not key or typ not in OVERRIDE_TYPES:
        raise InvalidInput(
            f"bad --override-kv {text!r}: expected KEY=TYPE:VALUE with TYPE one of {', '.join(OVERRIDE_TYPES)}"
        )
    try:
        if typ == "int":
            value: Any = int(raw) if len(raw.strip()) <= 20 else None
            if value is None or not INT64_MIN <= value <= INT64_MAX:
                raise InvalidInput(f"bad --override-kv {text[:80]!r}: an int override must fit in 64 bits (llama.cpp's int64_t)")
        elif typ == "float":
            value = float(raw)
            if not math.isfinite(value):
                raise InvalidInput(f"bad --override-kv {text!r}: {raw!r} is not a finite float")
        elif typ == "bool":
            if raw.lower() not in ("true", "false"):
                raise ValueError(raw)
            value = raw.lower() == "true"
        else:
            value = raw
    except ValueError:
        raise InvalidInput(f"bad --override-kv {text!r}: {raw!r} is not a valid {typ}") from None
    return Override(key, typ, value)


def parse_overrides(texts: Iterable[str] | None) -> list[Override]:
    """Parse several ``--override-kv`` strings; see ``parse_override``."""
    return [parse_override(t) for t in (texts or [])]


RECURRENT, ATTENTION, MTP, GLOBAL = "recurrent", "attention", "mtp", "global"
"""Where a tensor or activation sits, the one vocabulary every module uses (lint's tables,
fixtures, mutants, localization): a Gated DeltaNet layer (llama.cpp ``hparams.is_recurrent(il)``),
a gated full-attention layer, an MTP (nextn) block after the trunk (``Qwen35HParams.layer_kind``),
or outside every block (``token_embd``, ``output_norm``, ``output``, the final logits)."""
MOE = "moe"
"""What localization calls the layer type of an MoE FFN op (a part of a layer, not a layer kind),
stated here so the mutant table and localization share it."""


def interval_schedule(n_layer: int, n_layer_all: int, full_attention_interval: int) -> tuple[bool, ...]:
    """``recurrent[il]`` for every block when no ``attention.recurrent_layers`` array is given:
    full attention where ``(il + 1) % full_attention_interval == 0`` (layers 3, 7, ... at 4), Gated
    DeltaNet elsewhere in the trunk, never recurrent in the ``n_layer_all - n_layer`` MTP blocks
    (llama.cpp ``src/models/qwen35.cpp`` ``load_arch_hparams``)."""
    return tuple(il < n_layer and (il + 1) % full_attention_interval != 0 for il in range(n_layer_all))


@dataclass(frozen=True)
class Qwen35HParams:
    """Hyperparameters of a qwen35 / qwen35moe GGUF (names follow llama.cpp's ``llama_hparams``).

    ``n_layer`` counts trunk layers (``block_count - nextn_predict_layers``); ``n_layer_all`` is
    ``block_count``. ``recurrent[i]`` is True for Gated DeltaNet layers, False for full attention
    (MTP layers are never recurrent). Lengths are element counts; ``rope_freq_base`` is θ.
    """

    arch: str
    n_vocab: int
    n_embd: int
    n_layer_all: int
    n_layer_nextn: int
    n_ff: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_rot: int
    rope_sections: tuple[int, int, int, int]
    rope_freq_base: float
    rms_eps: float
    ssm_d_conv: int
    ssm_d_state: int
    ssm_n_group: int
    ssm_dt_rank: int
    ssm_d_inner: int
    recurrent: tuple[bool, ...]
    full_attention_interval: int | None = None
    n_expert: int = 0
    n_expert_used: int = 0
    n_ff_exp: int = 0
    n_ff_shexp: int = 0
    context_length: int = 0

    @property
    def n_layer(self) -> int:
        return self.n_layer_all - self.n_layer_nextn

    @property
    def is_moe(self) -> bool:
        return self.arch == "qwen35moe"

    @property
    def head_v_dim(self) -> int:
        return self.ssm_d_inner // self.ssm_dt_rank

    @property
    def conv_dim(self) -> int:
        return 2 * self.ssm_n_group * self.ssm_d_state + self.ssm_d_inner

    def is_recurrent(self, il: int) -> bool:
        return self.recurrent[il]

    def layer_kind(self, il: int) -> str:
        """``MTP`` for a block after the trunk, else ``RECURRENT`` or ``ATTENTION``."""
        if il >= self.n_layer:
            return MTP
        return RECURRENT if self.recurrent[il] else ATTENTION

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["n_layer"] = self.n_layer
        return d


# (field, key suffix, expected python type, required). One table: every key the harness reads.
HPARAM_KEYS: list[tuple[str, str, type, bool]] = [
    ("n_embd", "embedding_length", int, True),
    ("n_layer_all", "block_count", int, True),
    ("n_layer_nextn", "nextn_predict_layers", int, False),
    ("n_ff", "feed_forward_length", int, False),
    ("n_head", "attention.head_count", int, True),
    ("n_head_kv", "attention.head_count_kv", int, True),
    ("head_dim", "attention.key_length", int, True),
    ("n_rot", "rope.dimension_count", int, True),
    ("rope_freq_base", "rope.freq_base", float, False),
    ("rms_eps", "attention.layer_norm_rms_epsilon", float, True),
    ("ssm_d_conv", "ssm.conv_kernel", int, True),
    ("ssm_d_state", "ssm.state_size", int, True),
    ("ssm_n_group", "ssm.group_count", int, True),
    ("ssm_dt_rank", "ssm.time_step_rank", int, True),
    ("ssm_d_inner", "ssm.inner_size", int, True),
    ("full_attention_interval", "full_attention_interval", int, False),
    ("n_expert", "expert_count", int, False),
    ("n_expert_used", "expert_used_count", int, False),
    ("n_ff_exp", "expert_feed_forward_length", int, False),
    ("n_ff_shexp", "expert_shared_feed_forward_length", int, False),
    ("context_length", "context_length", int, False),
]


@dataclass(frozen=True, kw_only=True)
class HParamsSpec:
    """The hyperparameters one chooses to make a qwen35 / qwen35moe model (the synthetic and the
    trained fixtures), named as ``Qwen35HParams`` (llama.cpp's ``llama_hparams``); the rest follows
    from them (``hparams``). Transformers' names appear only where a config crosses into
    transformers (``harness.fixtures.convert.hparams_to_config``).

    ``n_layer`` counts trunk layers, ``n_layer_nextn`` the MTP blocks after them; ``n_rot`` the
    rotated dims per head (``rope_sections`` its split, 2 x sum = n_rot); the DeltaNet value head
    size is ``ssm_d_state`` (as llama.cpp takes it), so ``ssm_d_inner = ssm_dt_rank x ssm_d_state``;
    ``full_attention_interval`` 4 puts full attention at layers 3, 7, ...; ``n_expert`` > 0 makes a
    ``qwen35moe``. Sizes are element counts; ``rope_freq_base`` is θ.
    """

    n_layer: int = 8
    n_layer_nextn: int = 0
    n_embd: int = 64
    n_ff: int = 128
    n_head: int = 4
    n_head_kv: int = 2
    head_dim: int = 32
    n_rot: int = 8
    rope_sections: tuple[int, int, int, int] = (2, 1, 1, 0)
    rope_freq_base: float = 10_000_000.0
    rms_eps: float = 1e-6
    full_attention_interval: int = 4
    ssm_n_group: int = 2
    ssm_dt_rank: int = 4
    ssm_d_state: int = 32
    ssm_d_conv: int = 4
    n_expert: int = 0
    n_expert_used: int = 0
    n_ff_exp: int = 0
    n_ff_shexp: int = 0
    context_length: int = 4096

    @property
    def arch(self) -> str:
        return "qwen35moe" if self.n_expert > 0 else "qwen35"

    def hparams(self, n_vocab: int) -> Qwen35HParams:
        """The ``Qwen35HParams`` a GGUF written from this spec reads back, for ``n_vocab`` tokens."""
        n_all = self.n_layer + self.n_layer_nextn
        return Qwen35HParams(
            arch=self.arch, n_vocab=n_vocab, n_embd=self.n_embd, n_layer_all=n_all, n_layer_nextn=self.n_layer_nextn,
            n_ff=self.n_ff, n_head=self.n_head, n_head_kv=self.n_head_kv, head_dim=self.head_dim, n_rot=self.n_rot,
            rope_sections=tuple(self.rope_sections), rope_freq_base=self.rope_freq_base, rms_eps=self.rms_eps,
            ssm_d_conv=self.ssm_d_conv, ssm_d_state=self.ssm_d_state, ssm_n_group=self.ssm_n_group,
            ssm_dt_rank=self.ssm_dt_rank, ssm_d_inner=self.ssm_dt_rank * self.ssm_d_state,
            recurrent=interval_schedule(self.n_layer, n_all, self.full_attention_interval),
            full_attention_interval=self.full_attention_interval, n_expert=self.n_expert,
            n_expert_used=self.n_expert_used, n_ff_exp=self.n_ff_exp, n_ff_shexp=self.n_ff_shexp,
            context_length=self.context_length,
        )


@dataclass
class TensorInfo:
    """A tensor's ggml description: ``ne`` in ggml order (first dim is the input dim), type name."""

    name: str
    ne: tuple[int, ...]
    type: str
    n_bytes: int
    data_offset: int


LAZY_ARRAY_MIN = 64
"""Metadata arrays longer than this are parsed only when read (``PlainReader``, ``LazyArrayField``)."""


class LazyArrayField(ReaderField):
    """A metadata array whose elements gguf-py parses on first use of ``parts``/``data``
    (``contents()``), with ``GGUFReader``'s own ``_get_field_parts``: the same parts, data
    indices and values as an eager parse. ``length`` is the element count from the header."""

    @property
    def parts(self) -> list:
        return self._eager()[0]

    @property
    def data(self) -> list:
        return self._eager()[1]

    def _eager(self) -> tuple[list, list]:
        if self.__dict__.get("_parsed") is None:
            _, parts, idxs, _ = GGUFReader._get_field_parts(self._reader, self._value_offs, GGUFValueType.ARRAY)
            self._parsed = (self._head + parts, [i + len(self._head) for i in idxs])
        return self._parsed

    def strings(self) -> "StringArray":
        """The elements of a string array as a lazy sequence (``StringArray``): one string is
        decoded when indexed, without gguf-py's per-element parts. Raises ``ValueError`` for
        an array of another element type."""
        if self.types[-1] != GGUFValueType.STRING:
            raise ValueError(f"{self.name} is an array of {self.types[-1].name}, not of strings")
        if self.__dict__.get("_strings") is None:
            self._strings = StringArray(self._reader, self._value_offs + 12, self.length, self.__dict__.get("_starts"))
        return self._strings


class StringArray:
    """``Sequence[str]`` over a GGUF string array (each element a uint64 byte length then UTF-8
    bytes) in a ``PlainReader``'s map: the element offsets are those ``PlainReader._lazy_array``
    found when it sized the array at open (``starts``; else one walk over the lengths, about 0.1 s
    for 248,320 tokens, against seconds for gguf-py's parse of every element), and an element is
    decoded when read. Bytes that are not UTF-8 decode as surrogate escapes (gguf-py's
    ``contents()`` raises on them). A report needs a handful of token texts, not the vocabulary."""

    def __init__(self, reader: Any, start: int, length: int, starts: np.ndarray | None = None):
        self._buf, self._fmt = reader._plain, "<Q" if reader.byte_order == "I" else ">Q"
        if starts is None or len(starts) != length:
            found, pos = [], start
            for _ in range(length):  # bounds were checked when the array was sized at open
                found.append(pos)
                pos += 8 + struct.unpack_from(self._fmt, self._buf, pos)[0]
            starts = np.array(found, dtype=np.int64)
        self._offs = starts

    def __len__(self) -> int:
        return int(self._offs.shape[0])

    def __getitem__(self, i: int) -> str:
        pos = int(self._offs[i])
        n = struct.unpack_from(self._fmt, self._buf, pos)[0]
        return bytes(self._buf[pos + 8 : pos + 8 + n]).decode("utf-8", errors="surrogateescape")


class PlainReader(GGUFReader):
    """The reader class: ``gguf.GGUFReader`` slicing a plain ndarray view of its memory map rather
    than the ``np.memmap`` object: each ``np.memmap`` slice runs Python code (``__array_finalize__``),
    and the metadata of a 248,320-token vocab is a million slices. Same parse, same values,
    about 3x faster and half the memory. A read past the end of the file raises instead of
    returning a short array: gguf-py would loop forever on an array whose length field
    points past the end (empty element reads never advance), growing memory until killed."""

    def _get(self, offset: int, dtype: Any, count: int = 1, override_order: Any = None) -> np.ndarray:
        plain = self.__dict__.get("_plain")
        if plain is None:
            plain = self._plain = self.data.view(np.ndarray)
        count = int(count)
        need = np.dtype(dtype).itemsize * count
        raw = plain[offset : offset + need]
        if raw.nbytes < need:
            raise ValueError(f"truncated: {need} bytes at offset {offset} run past the end of the file ({plain.nbytes} bytes)")
        arr = raw.view(dtype=dtype)[:count]
        return arr.view(arr.dtype.newbyteorder(self.byte_order if override_order is None else override_order))

    def _get_field_parts(self, orig_offs: int, raw_type: int) -> Any:
        # An array's length is checked against the bytes left before gguf-py walks it element
        # by element (each element read creates an array: a length field of 2**40 would fill
        # the memory long before the end of the file is reached).
        if raw_type == GGUFValueType.ARRAY:
            itype = GGUFValueType(int(self._get(orig_offs, np.uint32)[0]))
            alen = int(self._get(orig_offs + 4, np.uint64)[0])
            scalar = self.gguf_scalar_to_np.get(itype)
            least = np.dtype(scalar).itemsize if scalar is not None else (8 if itype == GGUFValueType.STRING else 12)
            left = self._plain.nbytes - (orig_offs + 12)
            if alen * least > left:
                raise ValueError(f"truncated: an array of {alen} {itype.name} at offset {orig_offs} needs at least "
                                 f"{alen * least} bytes; {max(left, 0)} are left in the file")
        return super()._get_field_parts(orig_offs, raw_type)

    def _build_fields(self, offs: int, count: int) -> int:
        # gguf-py's loop over the key-value pairs, except that an array of more than
        # LAZY_ARRAY_MIN scalars or strings is only measured here (its byte size) and parsed
        # when read: a 248,320-token vocab is a million gguf-py parts (seconds) that a parity
        # run never reads. Everything else goes through gguf-py's _get_field_parts.
        for _ in range(count):
            orig_offs = offs
            kv_klen, kv_kdata = self._get_str(offs)
            offs += int(kv_klen.nbytes + kv_kdata.nbytes)
            raw_kv_type = self._get(offs, np.uint32)
            offs += int(raw_kv_type.nbytes)
            head = [kv_klen, kv_kdata, raw_kv_type]
            name = str(bytes(kv_kdata), encoding="utf-8")
            lazy = self._lazy_array(offs) if raw_kv_type[0] == GGUFValueType.ARRAY else None
            if lazy is not None:
                size, itype, length, starts = lazy
                field = LazyArrayField(orig_offs, name, [], [], [GGUFValueType.ARRAY, itype])
                field._reader, field._value_offs, field._head, field.length = self, offs, head, length
                field._starts = starts
            else:
                size, parts, idxs, types = self._get_field_parts(offs, raw_kv_type[0])
                field = ReaderField(orig_offs, name, head + parts, [i + len(head) for i in idxs], types)
            self._push_field(field, skip_sum=True)
            offs += size
        return offs

    def _lazy_array(self, offs: int) -> tuple[int, Any, int, np.ndarray | None] | None:
        """(byte size, element type, length, element offsets) of a long array of scalars or
        strings at ``offs``, found without parsing its elements (strings: by stepping over their
        lengths, whose offsets ``StringArray`` then reuses; None for scalars); None for a short
        array or one of arrays. Raises ``ValueError`` for an unknown element type or an array that
        runs past the end of the file."""
        raw = int(self._get(offs, np.uint32)[0])
        alen = int(self._get(offs + 4, np.uint64)[0])
        if alen <= LAZY_ARRAY_MIN or raw == GGUFValueType.ARRAY:
            return None
        itype = GGUFValueType(raw)  # ValueError for an unknown type, as gguf-py raises
        scalar = self.gguf_scalar_to_np.get(itype)
        start = offs + 12
        end = self._plain.nbytes
        if scalar is not None:
            size = alen * np.dtype(scalar).itemsize
            if start + size > end:
                raise ValueError(f"truncated: an array of {alen} {itype.name} at offset {offs} runs past the end of the file")
            return 12 + size, itype, alen, None
        if itype != GGUFValueType.STRING:
            raise ValueError(f"Unknown/unhandled field type {itype}")
        buf, fmt, pos = self._plain, "<Q" if self.byte_order == "I" else ">Q", start
        starts: list[int] = []
        mark = starts.append
        for _ in range(alen):
            if pos + 8 > end:
                raise ValueError(f"truncated: string array at offset {offs} runs past the end of the file")
            mark(pos)
            pos += 8 + struct.unpack_from(fmt, buf, pos)[0]
        if pos > end:
            raise ValueError(f"truncated: string array at offset {offs} runs past the end of the file")
        return pos - offs, itype, alen, np.array(starts, dtype=np.int64)  # 8 bytes per element, not a list of ints


@lru_cache(maxsize=8)
def _sha256_of(path: str, dev: int, ino: int, size: int, mtime_ns: int) -> str:
    """``sha256_file(path)`` once per file identity (the arguments after ``path`` are its key)."""
    return sha256_file(path)


_READERS: OrderedDict[tuple, tuple[bytes, Any]] = OrderedDict()
"""The last two files parsed: identity (device, inode, size, mtime) -> (bytes before the tensor
data, reader). A parity run opens its model twice (the harness and the in-process oracle); at
Qwen3.5's vocab one parse takes seconds. A hit is used only when the file still holds the same
bytes up to its tensor data, i.e. everything the parse depends on (tensor data is read live)."""


def _open_reader(path: Path) -> Any:
    st = path.stat()
    key = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
    hit = _READERS.get(key)
    if hit is not None:
        prefix, reader = hit
        with open(path, "rb") as f:
            if f.read(len(prefix)) == prefix:
                _READERS.move_to_end(key)
                return reader
    reader = PlainReader(path, "r")
    _READERS[key] = (bytes(reader.data[: reader.data_offset]), reader)
    while len(_READERS) > 2:
        _READERS.popitem(last=False)
    return reader


class GGUFModel:
    """A GGUF file opened read-only with ``gguf.GGUFReader`` plus in-memory metadata overrides.

    Raises ``InvalidInput`` (exit 2) with one line when the file is missing, not GGUF, truncated
    (header, metadata, tensor infos or tensor data past the end of the file) or malformed.
    """

    def __init__(self, path: str | os.PathLike, overrides: Iterable[Override] = ()):
        self.path = Path(path)
        self.overrides = {o.key: o for o in overrides}
        if not self.path.is_file():
            raise InvalidInput(f"{self.path}: no such file")
        size = self.path.stat().st_size
        try:
            self.reader = _open_reader(self.path)
        except Exception as e:  # the gguf reader raises ValueError, IndexError, KeyError, ...
            msg = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise InvalidInput(f"{self.path}: not a readable GGUF file ({type(e).__name__}: {msg})") from None
        names = [t.name for t in self.reader.tensors]
        if len(set(names)) != len(names):
            dup = sorted({n for n in names if names.count(n) > 1})[0]
            raise InvalidInput(f"{self.path}: duplicate tensor name {dup!r}")
        for t in self.reader.tensors:
            end = int(t.data_offset) + int(t.n_bytes)
            if end > size or t.data.nbytes != int(t.n_bytes):
                raise InvalidInput(
                    f"{self.path}: truncated: tensor {t.name!r} data ends at byte {end} but the file has {size} bytes"
                )
        self._tensors = {t.name: t for t in self.reader.tensors}

    # -- metadata ---------------------------------------------------------------------------
    def raw_metadata(self, key: str) -> Any:
        """The value of ``key`` as stored in the file (ignoring overrides), or None."""
        f = self.reader.get_field(key)
        if f is None:
            return None
        try:
            return f.contents()
        except Exception:
            raise InvalidInput(f"{self.path}: metadata key {key!r} is malformed") from None

    def metadata(self, key: str, default: Any = None) -> Any:
        """The value of ``key`` after ``--override-kv`` overrides, or ``default``."""
        if key in self.overrides:
            return self.overrides[key].value
        v = self.raw_metadata(key)
        return default if v is None else v

    def metadata_type(self, key: str) -> str | None:
        """The GGUF value type name of ``key`` (e.g. ``UINT32``, ``ARRAY[INT32]``), or None."""
        f = self.reader.get_field(key)
        if f is None or not f.types:
            return None
        if len(f.types) > 1:
            return f"{f.types[0].name}[{f.types[-1].name}]"
        return f.types[0].name

    @property
    def keys(self) -> list[str]:
        return list(self.reader.fields.keys())

    @cached_property
    def arch(self) -> str:
        arch = self.metadata("general.architecture")
        if not isinstance(arch, str):
            raise InvalidInput(f"{self.path}: general.architecture is missing")
        return arch

    def require_supported(self) -> str:
        """Return the arch, or raise ``InvalidInput`` naming the supported ones."""
        if self.arch not in SUPPORTED_ARCHES:
            raise InvalidInput(
                f"{self.path}: unsupported architecture {self.arch!r}; the harness supports {', '.join(SUPPORTED_ARCHES)}"
            )
        return self.arch

    def metadata_length(self, key: str) -> int | None:
        """The element count of array ``key`` as stored (without parsing a lazily read array's
        elements), or None when the key is absent or not an array."""
        f = self.reader.get_field(key)
        if f is None or not f.types or f.types[0].name != "ARRAY":
            return None
        return int(getattr(f, "length", None) if hasattr(f, "length") else len(f.data))

    @cached_property
    def tokens(self) -> list[str]:
        toks = self.raw_metadata("tokenizer.ggml.tokens")
        return list(toks) if toks else []

    @cached_property
    def token_texts(self) -> Any:
        """``tokenizer.ggml.tokens`` as a ``Sequence[str]`` read one token at a time (a long
        array: ``StringArray``; a short one: ``tokens``), for pages that show a few token texts
        at Qwen3.5's 248,320-token vocab. Empty when absent. Raises ``InvalidInput`` when the key
        is not an array of strings."""
        f = self.reader.get_field("tokenizer.ggml.tokens")
        if isinstance(f, LazyArrayField):
            try:
                return f.strings()
            except ValueError:
                raise InvalidInput(f"{self.path}: metadata key 'tokenizer.ggml.tokens' is not an array of strings") from None
        return self.tokens

    @cached_property
    def hparams(self) -> Qwen35HParams:
        """Typed hyperparameters. Raises ``InvalidInput`` on an unsupported arch, a missing or
        wrongly typed key, or a value beyond what the file holds (``_check_bounds``)."""
        arch = self.require_supported()
        vals: dict[str, Any] = {}
        for fname, suffix, typ, required in HPARAM_KEYS:
            key = f"{arch}.{suffix}"
            v = self.metadata(key)
            if v is None:
                if required:
                    raise InvalidInput(f"{self.path}: required key {key!r} is missing")
                continue
            if typ is int and (isinstance(v, bool) or not isinstance(v, int)):
                raise InvalidInput(f"{self.path}: key {key!r} should be an integer, found {v!r}")
            if typ is float and not isinstance(v, (int, float)):
                raise InvalidInput(f"{self.path}: key {key!r} should be a number, found {v!r}")
            vals[fname] = typ(v)
        vals.setdefault("n_layer_nextn", 0)
        vals.setdefault("rope_freq_base", 10000.0)
        vals.setdefault("n_ff", 0)
        sections = self.metadata(f"{arch}.rope.dimension_sections")
        sections = list(sections or [0, 0, 0, 0])
        if len(sections) < 4:
            sections = sections + [0] * (4 - len(sections))
        if not all(isinstance(x, (int, np.integer)) and not isinstance(x, bool) for x in sections[:4]):
            raise InvalidInput(f"{self.path}: key '{arch}.rope.dimension_sections' should hold integers")
        vals["rope_sections"] = tuple(int(s) for s in sections[:4])
        self._check_bounds(arch, vals)
        n_all = vals["n_layer_all"]
        n_trunk = n_all - vals["n_layer_nextn"]
        if n_trunk <= 0:
            raise InvalidInput(f"{self.path}: block_count {n_all} leaves no trunk layers after nextn")
        rec = self.metadata(f"{arch}.attention.recurrent_layers")
        if rec is not None:
            rec = [bool(x) for x in rec]
            if len(rec) < n_all:
                rec = rec + [False] * (n_all - len(rec))
            recurrent = tuple(rec[i] and i < n_trunk for i in range(n_all))
        else:
            interval = vals.get("full_attention_interval", 4)
            if interval <= 0:
                raise InvalidInput(f"{self.path}: full_attention_interval must be positive, found {interval}")
            recurrent = interval_schedule(n_trunk, n_all, interval)
        vals["recurrent"] = recurrent
        tok = self._tensors.get("token_embd.weight")
        n_vocab = self.metadata_length("tokenizer.ggml.tokens") or (int(tok.shape[1]) if tok is not None and len(tok.shape) > 1 else 0)
        vals["n_vocab"] = n_vocab
        return Qwen35HParams(arch=arch, **vals)

    @cached_property
    def max_tensor_dim(self) -> int:
        """The largest dimension of any tensor in the file (ggml ``ne``), 0 without tensors."""
        return max((int(x) for t in self.reader.tensors for x in t.shape), default=0)

    @cached_property
    def blocks_present(self) -> int:
        """1 + the highest block index ``blk.N.`` among the file's tensors (0 without blocks)."""
        idx = [int(n.split(".", 2)[1]) for n in self._tensors if n.startswith("blk.") and n.split(".", 2)[1].isdigit()]
        return max(idx, default=-1) + 1

    def _check_bounds(self, arch: str, vals: dict[str, Any]) -> None:
        """Every hyperparameter bounded by what the file holds, before anything is sized by it.

        Counts and sizes are non-negative and at most the largest tensor dimension in the file
        (an ``--override-kv qwen35.embedding_length=int:1000000000`` on a 2 MB model describes
        no tensor it has); ``block_count`` is in 1..``LLAMA_MAX_LAYERS`` and its trunk
        (``block_count - nextn_predict_layers``) has blocks in the file; the RMSNorm epsilon and
        rope base are finite and positive. Raises ``InvalidInput`` naming the key.
        """
        dim = self.max_tensor_dim
        for fname, suffix, typ, _ in HPARAM_KEYS:
            if fname not in vals:
                continue
            key, v = f"{arch}.{suffix}", vals[fname]
            if typ is float:
                if not (math.isfinite(v) and v > 0):
                    raise InvalidInput(f"{self.path}: key {key!r} is {v!r}; it must be a finite positive number")
            elif v < 0:
                raise InvalidInput(f"{self.path}: key {key!r} is {v}; it must not be negative")
            elif fname == "n_layer_all":
                if not 1 <= v <= LLAMA_MAX_LAYERS:
                    raise InvalidInput(f"{self.path}: key {key!r} is {v}; llama.cpp takes 1..{LLAMA_MAX_LAYERS} blocks")
            elif fname == "n_layer_nextn":
                continue  # bounded through the trunk below
            elif suffix not in NOT_TENSOR_SIZES and v > dim:
                raise InvalidInput(f"{self.path}: key {key!r} is {v}, larger than any tensor dimension in the file ({dim})")
        for i, sec in enumerate(vals["rope_sections"]):
            if not 0 <= sec <= dim:
                raise InvalidInput(f"{self.path}: key '{arch}.rope.dimension_sections'[{i}] is {sec}; it must be in 0..{dim}")
        n_trunk = vals["n_layer_all"] - vals["n_layer_nextn"]
        if n_trunk <= 0:
            raise InvalidInput(f"{self.path}: {arch}.block_count {vals['n_layer_all']} minus {arch}.nextn_predict_layers "
                               f"{vals['n_layer_nextn']} leaves no trunk layers")
        if n_trunk > self.blocks_present:
            raise InvalidInput(f"{self.path}: {arch}.block_count {vals['n_layer_all']} minus nextn_predict_layers "
                               f"{vals['n_layer_nextn']} counts {n_trunk} trunk blocks, but the file holds tensors for "
                               f"{self.blocks_present} block(s)")

    # -- tensors ----------------------------------------------------------------------------
    @property
    def tensor_names(self) -> list[str]:
        return list(self._tensors.keys())

    def has_tensor(self, name: str) -> bool:
        return name in self._tensors

    def tensor_info(self, name: str) -> TensorInfo:
        """ggml shape and type of ``name``; raises ``KeyError`` if absent."""
        t = self._tensors[name]
        return TensorInfo(
            name=name,
            ne=tuple(int(x) for x in t.shape),
            type=t.tensor_type.name,
            n_bytes=int(t.n_bytes),
            data_offset=int(t.data_offset),
        )

    def tensor(self, name: str, dtype: Any = np.float64, rows: np.ndarray | slice | None = None) -> np.ndarray:
        """Dequantized tensor ``name`` in NumPy order (reverse of ggml ``ne``), as ``dtype``.

        ``rows`` (indices or a slice of the first NumPy axis: a matrix's rows, a 3-D expert
        tensor's experts) reads only those; ggml quantizes along the last NumPy axis, so the
        selected rows dequantize to exactly the values they have in the whole tensor.
        Quantized data goes through ``gguf.quants.dequantize`` in pieces of about
        ``DEQUANT_CHUNK`` elements, each written straight into the result (gguf-py dequantizes
        block by block, so the pieces give the same values as one call, without a float32 copy
        of the whole tensor or gguf-py's per-16-rows loop). Raises ``KeyError`` if the tensor is
        absent and ``InvalidInput`` if the `gguf` package cannot dequantize its type.
        """
        t = self._tensors[name]
        shape = tuple(int(x) for x in reversed(t.shape))
        arr = np.asarray(t.data)
        if rows is not None:
            arr = arr[rows]
            shape = (int(arr.shape[0]),) + shape[1:]
        if t.tensor_type in (GGMLQuantizationType.F32, GGMLQuantizationType.F64, GGMLQuantizationType.F16):
            return np.asarray(arr, dtype=dtype).reshape(shape)
        block, type_size = GGML_QUANT_SIZES[t.tensor_type]
        raw = np.ascontiguousarray(arr).reshape(-1)
        out = np.empty(int(np.prod(shape)), dtype=dtype)
        step = max(1, DEQUANT_CHUNK // block) * type_size  # bytes of whole blocks per piece
        try:
            for b0 in range(0, raw.size, step):
                piece = raw[b0 : b0 + step]
                e0 = b0 // type_size * block
                out[e0 : e0 + piece.size // type_size * block] = dequantize(piece.reshape(1, -1), t.tensor_type).reshape(-1)
        except NotImplementedError:
            raise InvalidInput(f"{self.path}: cannot dequantize {name} of type {t.tensor_type.name}") from None
        return out.reshape(shape)

    def nonfinite_count(self, name: str, chunk_elements: int = 1 << 22) -> tuple[int, int]:
        """``(NaN or ±Inf values, all values)`` of tensor ``name`` after dequantization, read in
        chunks of about ``chunk_elements`` so memory stays bounded (a 248,320-row embedding is
        never materialised as float64). Raises ``KeyError`` if absent, ``InvalidInput`` if the
        `gguf` package cannot dequantize its type."""
        t = self._tensors[name]
        raw = np.asarray(t.data)
        size = int(np.prod([int(x) for x in t.shape]))
        plain_float = t.tensor_type in (GGMLQuantizationType.F32, GGMLQuantizationType.F64, GGMLQuantizationType.F16)
        rows = raw.reshape(-1) if plain_float else raw.reshape(-1, raw.shape[-1])
        per_row = 1 if plain_float else max(1, size // max(rows.shape[0], 1))
        step = max(1, chunk_elements // per_row)
        bad = 0
        for i in range(0, rows.shape[0], step):
            part = rows[i : i + step]
            if not plain_float:
                try:
                    part = dequantize(part, t.tensor_type)
                except NotImplementedError:
                    raise InvalidInput(f"{self.path}: cannot dequantize {name} of type {t.tensor_type.name}") from None
            bad += int(np.count_nonzero(~np.isfinite(part)))
        return bad, size

    @cached_property
    def sha256(self) -> str:
        """sha256 of the file's bytes (hex), hashed once per process and file identity (device,
        inode, size, mtime: a file rewritten in place is hashed again): a parity run opens its
        model twice (the harness and the in-process oracle), and a 248,320-token model is 70 MB."""
        try:
            st = os.stat(self.path)
        except OSError:
            return sha256_file(self.path)  # raises InvalidInput naming the file
        return _sha256_of(str(self.path), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)

    @property
    def file_type(self) -> str:
        """A short name of the weights' type: ``general.file_type`` as llama.cpp names it, else
        the most common tensor type."""
        ft = self.raw_metadata("general.file_type")
        if isinstance(ft, int):
            try:
                return LlamaFileType(ft).name.removeprefix("MOSTLY_")
            except ValueError:
                pass
        types = [t.tensor_type.name for t in self.reader.tensors]
        return max(set(types), key=types.count) if types else "unknown"

    @property
    def weights_key(self) -> str:
        """What the file's weights hold, as the calibrated gates are keyed: the sorted ggml type
        names of every tensor with two or more dimensions (matmul weights, embeddings, conv
        kernels), joined by ``+`` (e.g. ``F32``, ``F16+F32``, ``F32+Q4_K+Q6_K``). Two files of one
        ``general.file_type`` differ here when the quantizer fell back on narrow rows or when
        per-tensor type overrides were used, which is what changes the known-good floor."""
        types = {t.tensor_type.name for t in self.reader.tensors if sum(int(x) > 1 for x in t.shape) >= 2}
        return "+".join(sorted(types)) or "none"

    def describe(self) -> dict[str, Any]:
        """Model identity for receipts: path, sha256, arch, file type, tensor count, overrides."""
        return {
            "path": str(self.path),
            "sha256": self.sha256,
            "arch": self.arch,
            "file_type": self.file_type,
            "n_tensors": len(self._tensors),
            "overrides": [o.to_flag() for o in self.overrides.values()],
        }
