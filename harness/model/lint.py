"""Static checks of a qwen35 / qwen35moe GGUF: metadata, MTP inventory, layer schedule, shapes, values.

No forward pass. Every check is a row of a table, run by one loop: ``KEY_RULES`` (metadata keys and
their GGUF types), ``TENSOR_TABLES`` (per arch: tensor name template → expected ggml shape, which
layers, and the value/type checks that apply). Each finding carries a stable code, a severity, a
message naming the key / tensor / layer, and a remedy where one exists.

Sources: llama.cpp ``src/models/qwen35.cpp`` / ``qwen35moe.cpp`` (``load_arch_hparams``,
``load_arch_tensors``), ``src/llama-model-loader.cpp`` (strict key types; a file holding a tensor
the loader never creates is refused with "wrong number of tensors"), ``src/llama-hparams.cpp``
(``n_embd_r`` / ``n_embd_s``: recurrent state sizes), ``src/llama-quant.cpp`` (norms, 1-D
tensors and ``ssm_conv1d`` stay F32), the converter's Qwen3.5 conventions
(docs/qwen35-gguf-math.md).

Codes (severity, title):

====== ======== =============================================================================
QL101  error    required metadata key missing
QL102  error    metadata key has the wrong GGUF type or array length (llama.cpp refuses it)
QL103  error    hyperparameters unusable (no trunk layers, full_attention_interval ≤ 0, ...)
QL104  error    attention.key_length != attention.value_length
QL105  error    attention.head_count not a multiple of attention.head_count_kv
QL106  error    ssm.time_step_rank (n_v) not a multiple of ssm.group_count (n_k)
QL107  error    ssm.inner_size != ssm.time_step_rank × ssm.state_size
QL108  error    rope.dimension_count odd, ≤ 0 or > head_dim
QL109  error    2 × sum(rope.dimension_sections) != rope.dimension_count
QL110  error    expert_used_count is 0 or exceeds expert_count
QL111  error    a float hyperparameter (rms epsilon, rope base) is NaN, infinite or not positive
QL201  error    MTP declared but absent (block_count counts nextn blocks that have no tensors)
QL202  info     MTP-only file: a legal shape (a draft model for llama.cpp ``-md``), not a model to compare
QL203  error    tensors for blocks beyond block_count (undeclared MTP or stray blocks)
QL204  error    layer schedule mismatch: a layer holds the other kind's tensor set
QL301  error    required tensor missing
QL302  error    tensor shape differs from the hyperparameters
QL303  error    vocab rows differ from the token list length
QL304  error    unexpected tensor (llama.cpp refuses files with tensors it does not create)
QL401  error    ssm_a not strictly negative
QL402  error    shifted norm has mean < 0.5 (missing +1 shift)
QL403  error    shifted norm has mean > 1.5 (double +1 shift)
QL404  error    ssm_norm has mean > 1.5 (wrongly shifted; the converter does not shift it)
QL405  error    SSM scalar, conv kernel or norm weight not stored F32
QL406  error    NaN or Inf in token_embd, output, a norm weight or ssm_a (llama.cpp computes garbage)
QL501  warning  a low-bit i-quant file (general.file_type IQ1_S … IQ3_M) that llama-quantize made without
                an importance matrix (no quantize.imatrix.* keys): far noisier than the published kind
QL601  info     a scripted fixture (``harness.scripted`` key): its greedy output is a given text, not a model
QL602  info     generation defaults declared (``general.sampling.*``, gguf-py ``Keys.General.SAMPLING_*``);
                no such key carries a presence penalty
====== ======== =============================================================================
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Iterable

import numpy as np
from gguf.constants import MODEL_TENSOR, TENSOR_NAMES, Keys

from harness import display
from harness.errors import InvalidInput
from harness.model.gguf_model import (
    ATTENTION,
    GLOBAL,
    HPARAM_KEYS,
    MTP,
    RECURRENT,
    GGUFModel,
    Qwen35HParams,
    parse_overrides,
)

# ---------------------------------------------------------------------------------------------
# Codes
# ---------------------------------------------------------------------------------------------
_CODE_TABLE: list[tuple[str, str, str]] = [
    ("QL101", "error", "required metadata key missing"),
    ("QL102", "error", "metadata key has the wrong GGUF type"),
    ("QL103", "error", "hyperparameters unusable"),
    ("QL104", "error", "key_length != value_length"),
    ("QL105", "error", "head_count not a multiple of head_count_kv"),
    ("QL106", "error", "n_v not a multiple of n_k"),
    ("QL107", "error", "ssm.inner_size != n_v x d_state"),
    ("QL108", "error", "rope dims odd or > head_dim"),
    ("QL109", "error", "2 x sum(rope sections) != rope dims"),
    ("QL110", "error", "expert_used_count out of range"),
    ("QL111", "error", "float hyperparameter not finite and positive"),
    ("QL201", "error", "MTP declared but absent"),
    ("QL202", "info", "MTP-only file (a draft model)"),
    ("QL203", "error", "tensors beyond block_count"),
    ("QL204", "error", "layer schedule mismatch"),
    ("QL301", "error", "required tensor missing"),
    ("QL302", "error", "tensor shape mismatch"),
    ("QL303", "error", "vocab rows mismatch"),
    ("QL304", "error", "unexpected tensor"),
    ("QL401", "error", "ssm_a not strictly negative"),
    ("QL402", "error", "norm missing +1 shift"),
    ("QL403", "error", "norm double +1 shift"),
    ("QL404", "error", "ssm_norm wrongly shifted"),
    ("QL405", "error", "tensor must be F32"),
    ("QL406", "error", "non-finite tensor values"),
    ("QL501", "warning", "i-quant made without an importance matrix"),
    ("QL601", "info", "scripted fixture (not a model)"),
    ("QL602", "info", "generation defaults declared"),
]

SAMPLING_KEYS = tuple(v for k, v in sorted(vars(Keys.General).items()) if k.startswith("SAMPLING_"))
"""The GGUF keys that declare generation defaults (gguf-py ``Keys.General.SAMPLING_*``:
``general.sampling.sequence``, ``top_k``, ``top_p``, ``min_p``, ``xtc_probability``,
``xtc_threshold``, ``temp``, ``penalty_last_n``, ``penalty_repeat``, ``mirostat``,
``mirostat_tau``, ``mirostat_eta``). None carries a presence penalty (``penalty_repeat`` is the
multiplicative repetition penalty), so a model card's presence penalty cannot travel in the file."""

IMATRIX_FILE_TYPES = {19: "IQ2_XXS", 20: "IQ2_XS", 22: "IQ3_XS", 23: "IQ3_XXS", 24: "IQ1_S", 26: "IQ3_S", 27: "IQ3_M",
                      28: "IQ2_S", 29: "IQ2_M", 31: "IQ1_M"}
"""``general.file_type`` values (llama.cpp ``llama_ftype``: ``LLAMA_FTYPE_MOSTLY_*``) of the low-bit
i-quants whose published files are made with an importance matrix (llama-quantize refuses
IQ1_S, IQ1_M, IQ2_XXS, IQ2_XS and IQ2_S without one, unless forced)."""
CODES: dict[str, str] = {c: t for c, _, t in _CODE_TABLE}
"""Finding code → short title (stable; documented in the module docstring)."""
SEVERITY: dict[str, str] = {c: s for c, s, _ in _CODE_TABLE}
"""Finding code → severity (error | warning | info)."""

SHIFT_LOW, SHIFT_HIGH = 0.5, 1.5
"""A shifted norm (GGUF stores 1 + w) has mean ≈ 1: below SHIFT_LOW it lacks the shift (≈ 0),
above SHIFT_HIGH it was shifted twice (≈ 2). ssm_norm is unshifted (≈ 1): above SHIFT_HIGH it
was wrongly shifted."""


@dataclass
class Finding:
    """One lint result: ``code`` (see ``CODES``), ``severity`` (error | warning | info), a message
    naming the key / tensor / layer, a remedy (exact flags or steps) or None, and ``where``
    (machine-readable location: key, tensor, layer, expected, found)."""

    code: str
    severity: str
    message: str
    remedy: str | None = None
    where: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _finding(code: str, message: str, remedy: str | None = None, **where: Any) -> Finding:
    return Finding(code, SEVERITY[code], message, remedy, {k: v for k, v in where.items() if v is not None})


@dataclass
class LintReport:
    """Findings and informational lines for one model.

    ``model``: path, sha256, arch, overrides. ``info``: human lines (MTP inventory, schedule,
    memory). ``memory``: ``kv_bytes_per_token`` (f16 K and V, trunk full-attention layers only),
    ``recurrent_bytes_per_sequence`` (f32 conv + delta-rule state, Gated DeltaNet layers), and the
    layer counts; empty when the hyperparameters could not be read.
    """

    model: dict[str, Any]
    findings: list[Finding] = field(default_factory=list)
    info: list[str] = field(default_factory=list)
    memory: dict[str, int] = field(default_factory=dict)

    @property
    def errors(self) -> list[Finding]:
        return [f for f in self.findings if f.severity == "error"]

    @property
    def warnings(self) -> list[Finding]:
        return [f for f in self.findings if f.severity == "warning"]

    @property
    def exit_code(self) -> int:
        """0 when clean or only warnings/info, 1 when any finding is an error (docs/design.md, "Verdicts and exit codes")."""
        return 1 if self.errors else 0

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict (schema ``harness-lint/v1``)."""
        return {
            "schema": "harness-lint/v1",
            "model": self.model,
            "exit_code": self.exit_code,
            "counts": {"error": len(self.errors), "warning": len(self.warnings)},
            "findings": [f.to_dict() for f in self.findings],
            "info": list(self.info),
            "memory": dict(self.memory),
        }

    def render(self) -> str:
        """A plain-text table: one row per finding (code, severity, message), its remedy beneath,
        then the info lines and a one-line verdict; every line escaped (``display.plain``)."""
        m = self.model
        ov = " ".join(f"--override-kv {o}" for o in m.get("overrides", []))
        lines = [f"lint {m['path']}  arch={m['arch']}  sha256={m['sha256'][:16]}" + (f"  {ov}" if ov else "")]
        if self.findings:
            lines.append(f"{'code':<6} {'severity':<8} message")
            for f in self.findings:
                lines.append(f"{f.code:<6} {f.severity:<8} {f.message}")
                if f.remedy:
                    lines.append(f"{'':<6} {'':<8} remedy: {f.remedy}")
        else:
            lines.append("no findings")
        lines += [f"info: {s}" for s in self.info]
        ne, nw = len(self.errors), len(self.warnings)
        lines.append(f"result: {ne} error(s), {nw} warning(s) -> exit {self.exit_code}")
        return "\n".join(display.plain(ln) for ln in lines)  # tensor names and metadata come from the file


# ---------------------------------------------------------------------------------------------
# Metadata keys
# ---------------------------------------------------------------------------------------------
_INT_TYPES = {"UINT32"}  # llama.cpp's get_key<uint32_t> accepts exactly GGUF UINT32
_FLOAT_TYPES = {"FLOAT32"}
_INT_ARRAYS = {"ARRAY[INT32]", "ARRAY[UINT32]"}

# (key suffix, expected kind, required: "all" | "qwen35" | "qwen35moe" | None).
# kinds: u32, f32, sections (int array of 4), layers (u32 or bool/int array of block_count), tokens.
# Scalar keys come from gguf_model's table so the two cannot drift; the rest are added here.
KEY_RULES: list[tuple[str, str, str | None]] = [
    (suffix, "u32" if typ is int else "f32", "all" if required else None)
    for _, suffix, typ, required in HPARAM_KEYS
    if suffix not in ("context_length", "feed_forward_length", "expert_count", "expert_used_count")
] + [
    (Keys.LLM.CONTEXT_LENGTH.removeprefix("{arch}."), "u32", "all"),  # llama.cpp requires it
    (Keys.LLM.FEED_FORWARD_LENGTH.removeprefix("{arch}."), "u32", "qwen35"),
    (Keys.LLM.EXPERT_COUNT.removeprefix("{arch}."), "u32", "qwen35moe"),
    (Keys.LLM.EXPERT_USED_COUNT.removeprefix("{arch}."), "u32", "qwen35moe"),
    (Keys.Attention.VALUE_LENGTH.removeprefix("{arch}."), "u32", None),
    (Keys.Rope.DIMENSION_SECTIONS.removeprefix("{arch}."), "sections", "all"),
    ("attention.recurrent_layers", "layers", None),
]
TOKENS_KEY = Keys.Tokenizer.LIST
_OVERRIDE_KIND = {"u32": "int", "f32": "float", "sections": "int", "layers": "int"}


def _key_type_ok(kind: str, gtype: str, value: Any, n_layer_all: int | None) -> tuple[bool, str]:
    """Whether GGUF type name ``gtype`` (value ``value``) is what llama.cpp accepts for ``kind``;
    returns (ok, what was expected)."""
    if kind == "u32":
        return gtype in _INT_TYPES, "UINT32"
    if kind == "f32":
        return gtype in _FLOAT_TYPES, "FLOAT32"
    if kind == "sections":
        return (gtype in _INT_ARRAYS and len(value) == 4) or gtype == "INT32", "ARRAY[INT32] of length 4"
    if kind == "layers":
        if gtype in _INT_TYPES:
            return True, ""
        ok = gtype in _INT_ARRAYS | {"ARRAY[BOOL]"} and (n_layer_all is None or len(value) == n_layer_all)
        return ok, f"ARRAY[BOOL|INT32|UINT32] of length block_count ({n_layer_all})"
    if kind == "tokens":
        return gtype == "ARRAY[STRING]", "ARRAY[STRING]"
    raise ValueError(kind)


def check_keys(model: GGUFModel) -> list[Finding]:
    """QL101 / QL102: every required key present, every present key of the GGUF type llama.cpp's
    loader accepts (it compares types strictly: an INT32 ``block_count`` is refused). An override
    must have the matching ``--override-kv`` type (llama.cpp ignores a mistyped one)."""
    arch = model.arch
    out: list[Finding] = []
    n_all = model.metadata(f"{arch}.block_count")
    n_all = n_all if isinstance(n_all, int) and not isinstance(n_all, bool) else None
    rules = [(f"{arch}.{s}", kind, req) for s, kind, req in KEY_RULES] + [(TOKENS_KEY, "tokens", "all")]
    for key, kind, req in rules:
        required = req == "all" or req == arch
        if key in model.overrides:
            o = model.overrides[key]
            want = _OVERRIDE_KIND.get(kind)
            if want and o.type != want:
                out.append(_finding("QL102", f"override {key} has type {o.type}; it must be {want} (llama.cpp ignores a mistyped override)",
                                    f"--override-kv {key}={want}:{o.value}", key=key, expected=want, found=o.type))
            continue
        gtype = model.metadata_type(key)
        if gtype is None:
            if required:
                out.append(_finding("QL101", f"required key {key} is missing", key=key))
            continue
        ok, expected = _key_type_ok(kind, gtype, model.raw_metadata(key), n_all)
        if not ok:
            out.append(_finding("QL102", f"key {key} has type {gtype}; llama.cpp expects {expected}", key=key,
                                expected=expected, found=gtype))
    out += check_float_keys(model)
    return out


def check_float_keys(model: GGUFModel) -> list[Finding]:
    """QL111: every float hyperparameter present (file or override) is finite and positive; a NaN
    RMSNorm epsilon passes llama.cpp's loader and then poisons (or aborts) the first forward."""
    arch = model.arch
    out = []
    for suffix, kind, _ in KEY_RULES:
        key = f"{arch}.{suffix}"
        v = model.metadata(key)
        if kind != "f32" or v is None or isinstance(v, bool) or not isinstance(v, (int, float)):
            continue
        if not (math.isfinite(v) and v > 0):
            out.append(_finding("QL111", f"key {key} is {v!r}; it must be a finite positive number", "re-convert with the "
                                "model's config value (rms_norm_eps, rope_theta)", key=key, found=repr(v)))
    return out


def check_imatrix(model: GGUFModel) -> list[Finding]:
    """QL501: a file whose ``general.file_type`` is a low-bit i-quant (``IMATRIX_FILE_TYPES``) and
    that says it was quantized by llama-quantize (``general.quantization_version``) but carries
    none of the ``quantize.imatrix.*`` keys llama-quantize writes when given ``--imatrix``."""
    ftype = model.metadata("general.file_type")
    if not isinstance(ftype, int) or ftype not in IMATRIX_FILE_TYPES or model.metadata("general.quantization_version") is None:
        return []
    if any(k.startswith("quantize.imatrix.") for k in model.keys):
        return []
    name = IMATRIX_FILE_TYPES[ftype]
    return [_finding("QL501", f"general.file_type is {name} but the file has no quantize.imatrix.* keys: it was quantized without "
                     "an importance matrix", f"re-quantize with an importance matrix: llama-imatrix -m F16.gguf -f calibration.txt -o "
                     f"imatrix.gguf, then llama-quantize --imatrix imatrix.gguf F16.gguf out.gguf {name}", key="general.file_type", found=name)]


def check_chat_surface(model: GGUFModel) -> list[Finding]:
    """QL601 where the file is a scripted fixture (``harness.scripted``: the scripts' sha256), QL602
    with the generation defaults it declares (``SAMPLING_KEYS``, values escaped)."""
    out = []
    scripted = model.raw_metadata("harness.scripted")
    if scripted is not None:
        out.append(_finding("QL601", f"scripted fixture (scripts sha256 {display.plain(str(scripted))[:16]}…): its greedy output "
                                     "after each script's generation prompt is the script's text; a test input for output parsers, "
                                     "not a model (a sign-off refuses it)", key="harness.scripted"))
    declared = {k: model.raw_metadata(k) for k in SAMPLING_KEYS if model.raw_metadata(k) is not None}
    if declared:
        shown = ", ".join(f"{k.removeprefix('general.sampling.')}={display.plain(str(v))[:40]}" for k, v in declared.items())
        out.append(_finding("QL602", f"generation defaults declared: {shown}; no GGUF key carries a presence penalty",
                            key="general.sampling.*"))
    return out


def check_hparams(h: Qwen35HParams, model: GGUFModel) -> list[Finding]:
    """QL104–QL110: relations between hyperparameters that llama.cpp's qwen35 graph assumes."""
    a = h.arch
    out: list[Finding] = []
    vlen = model.metadata(f"{a}.attention.value_length")
    if vlen is not None and vlen != h.head_dim:
        out.append(_finding("QL104", f"{a}.attention.key_length {h.head_dim} != {a}.attention.value_length {vlen} (both are head_dim)",
                            key=f"{a}.attention.value_length", expected=h.head_dim, found=vlen))
    if h.n_head_kv <= 0 or h.n_head % h.n_head_kv:
        out.append(_finding("QL105", f"{a}.attention.head_count {h.n_head} is not a multiple of head_count_kv {h.n_head_kv}",
                            key=f"{a}.attention.head_count_kv", found=h.n_head_kv))
    if h.ssm_n_group <= 0 or h.ssm_dt_rank % h.ssm_n_group:
        out.append(_finding("QL106", f"{a}.ssm.time_step_rank (n_v) {h.ssm_dt_rank} is not a multiple of ssm.group_count (n_k) {h.ssm_n_group}",
                            key=f"{a}.ssm.group_count", found=h.ssm_n_group))
    if h.ssm_d_inner != h.ssm_dt_rank * h.ssm_d_state:
        out.append(_finding("QL107", f"{a}.ssm.inner_size {h.ssm_d_inner} != time_step_rank × state_size = {h.ssm_dt_rank * h.ssm_d_state} "
                            "(llama.cpp takes head_v_dim = state_size)", key=f"{a}.ssm.inner_size",
                            expected=h.ssm_dt_rank * h.ssm_d_state, found=h.ssm_d_inner))
    if h.n_rot <= 0 or h.n_rot % 2 or h.n_rot > h.head_dim:
        out.append(_finding("QL108", f"{a}.rope.dimension_count {h.n_rot} must be even, positive and ≤ head_dim {h.head_dim}",
                            key=f"{a}.rope.dimension_count", found=h.n_rot))
    elif 2 * sum(h.rope_sections) != h.n_rot:  # only meaningful once n_rot itself is valid
        out.append(_finding("QL109", f"{a}.rope.dimension_sections {list(h.rope_sections)}: 2 × sum = {2 * sum(h.rope_sections)} != rope.dimension_count {h.n_rot}",
                            key=f"{a}.rope.dimension_sections", expected=h.n_rot, found=2 * sum(h.rope_sections)))
    if h.is_moe and not (0 < h.n_expert_used <= h.n_expert):
        out.append(_finding("QL110", f"{a}.expert_used_count {h.n_expert_used} must be in 1..expert_count ({h.n_expert})",
                            key=f"{a}.expert_used_count", found=h.n_expert_used))
    return out


# ---------------------------------------------------------------------------------------------
# Tensor tables
# ---------------------------------------------------------------------------------------------
G = frozenset({GLOBAL})
R = frozenset({RECURRENT})
AM = frozenset({ATTENTION, MTP})
M = frozenset({MTP})
ALL = frozenset({RECURRENT, ATTENTION, MTP})

Shape = Callable[[Qwen35HParams], tuple[int, ...]]


@dataclass(frozen=True)
class TensorRule:
    """One row of a tensor table.

    ``tensor`` + ``suffix`` give the name through gguf-py's ``TENSOR_NAMES`` template; ``shape``
    maps hyperparameters to the ggml ``ne`` (first dim is the input dim); ``layers`` is the set of
    layer kinds it belongs to (global, recurrent, attention, mtp); ``required`` False for tensors
    llama.cpp creates with TENSOR_NOT_REQUIRED; ``alt`` a fused tensor whose presence satisfies
    this one. Checks: ``vocab`` (dim 1 is n_vocab: a mismatch there is QL303), ``f32`` (QL405),
    ``norm`` "shifted" (QL402/403) or "unshifted" (QL404), ``negative`` (QL401), ``finite``
    (QL406; norm and negative rows are always checked for it too). ``hf`` names the HF
    checkpoint tensor a row is converted from where the remedy should say it (the nextn norms,
    which HF calls ``mtp.*``).
    """

    tensor: MODEL_TENSOR
    suffix: str | None
    shape: Shape
    layers: frozenset[str]
    required: bool = True
    alt: MODEL_TENSOR | None = None
    vocab: bool = False
    f32: bool = False
    norm: str | None = None
    negative: bool = False
    finite: bool = False
    hf: str | None = None

    @property
    def template(self) -> str:
        base = TENSOR_NAMES[self.tensor]
        return f"{base}.{self.suffix}" if self.suffix else base

    def name(self, il: int | None = None) -> str:
        return self.template.format(bid=il)


def _ff_exp(h: Qwen35HParams) -> int:
    # qwen35moe.cpp: n_ff_exp falls back to n_ff / n_expert_used, n_ff_shexp to n_ff
    return h.n_ff_exp or (h.n_ff // max(h.n_expert_used, 1))


def _ff_shexp(h: Qwen35HParams) -> int:
    return h.n_ff_shexp or h.n_ff


def _value_dim(h: Qwen35HParams) -> int:
    # qwen35.cpp: head_v_dim = ssm_d_state, value_dim = head_v_dim * n_v_heads
    return h.ssm_d_state * h.ssm_dt_rank


def _conv_dim(h: Qwen35HParams) -> int:
    # qwen35.cpp: conv_dim = key_dim * 2 + value_dim (not from ssm.inner_size; QL107 checks that)
    return 2 * h.ssm_n_group * h.ssm_d_state + _value_dim(h)


T, W = MODEL_TENSOR, "weight"
_COMMON: list[TensorRule] = [
    TensorRule(T.TOKEN_EMBD, W, lambda h: (h.n_embd, h.n_vocab), G, vocab=True, finite=True),
    TensorRule(T.OUTPUT_NORM, W, lambda h: (h.n_embd,), G, f32=True, norm="shifted"),
    TensorRule(T.OUTPUT, W, lambda h: (h.n_embd, h.n_vocab), G, required=False, vocab=True, finite=True),
    TensorRule(T.ATTN_NORM, W, lambda h: (h.n_embd,), ALL, f32=True, norm="shifted"),
    TensorRule(T.ATTN_POST_NORM, W, lambda h: (h.n_embd,), ALL, f32=True, norm="shifted"),
    # gated attention (trunk attention layers and the MTP block); attn_q holds query and gate per head
    TensorRule(T.ATTN_Q, W, lambda h: (h.n_embd, 2 * h.n_head * h.head_dim), AM),
    TensorRule(T.ATTN_K, W, lambda h: (h.n_embd, h.n_head_kv * h.head_dim), AM),
    TensorRule(T.ATTN_V, W, lambda h: (h.n_embd, h.n_head_kv * h.head_dim), AM),
    TensorRule(T.ATTN_Q_NORM, W, lambda h: (h.head_dim,), AM, f32=True, norm="shifted"),
    TensorRule(T.ATTN_K_NORM, W, lambda h: (h.head_dim,), AM, f32=True, norm="shifted"),
    TensorRule(T.ATTN_OUT, W, lambda h: (h.n_head * h.head_dim, h.n_embd), AM),
    # Gated DeltaNet (llama.cpp marks attn_qkv / attn_gate NOT_REQUIRED but its graph uses both)
    TensorRule(T.ATTN_QKV, W, lambda h: (h.n_embd, _conv_dim(h)), R),
    TensorRule(T.ATTN_GATE, W, lambda h: (h.n_embd, _value_dim(h)), R),
    TensorRule(T.SSM_CONV1D, W, lambda h: (h.ssm_d_conv, _conv_dim(h)), R, f32=True),
    TensorRule(T.SSM_A, None, lambda h: (h.ssm_dt_rank,), R, f32=True, negative=True),
    TensorRule(T.SSM_DT, "bias", lambda h: (h.ssm_dt_rank,), R, f32=True),
    TensorRule(T.SSM_ALPHA, W, lambda h: (h.n_embd, h.ssm_dt_rank), R),
    TensorRule(T.SSM_BETA, W, lambda h: (h.n_embd, h.ssm_dt_rank), R),
    TensorRule(T.SSM_NORM, W, lambda h: (h.ssm_d_state,), R, f32=True, norm="unshifted"),
    TensorRule(T.SSM_OUT, W, lambda h: (_value_dim(h), h.n_embd), R),
]
_MTP: list[TensorRule] = [  # MTP (nextn) block extras
    TensorRule(T.NEXTN_EH_PROJ, W, lambda h: (2 * h.n_embd, h.n_embd), M),
    TensorRule(T.NEXTN_ENORM, W, lambda h: (h.n_embd,), M, f32=True, norm="shifted", hf="mtp.pre_fc_norm_embedding"),
    TensorRule(T.NEXTN_HNORM, W, lambda h: (h.n_embd,), M, f32=True, norm="shifted", hf="mtp.pre_fc_norm_hidden"),
    TensorRule(T.NEXTN_EMBED_TOKENS, W, lambda h: (h.n_embd, h.n_vocab), M, required=False, vocab=True, finite=True),
    TensorRule(T.NEXTN_SHARED_HEAD_HEAD, W, lambda h: (h.n_embd, h.n_vocab), M, required=False, vocab=True, finite=True),
    # the head norm (HF mtp.norm); absent, llama.cpp's graph_mtp falls back to output_norm
    TensorRule(T.NEXTN_SHARED_HEAD_NORM, W, lambda h: (h.n_embd,), M, required=False, f32=True, norm="shifted", hf="mtp.norm"),
]
_DENSE_FFN: list[TensorRule] = [
    TensorRule(T.FFN_GATE, W, lambda h: (h.n_embd, h.n_ff), ALL),
    TensorRule(T.FFN_UP, W, lambda h: (h.n_embd, h.n_ff), ALL),
    TensorRule(T.FFN_DOWN, W, lambda h: (h.n_ff, h.n_embd), ALL),
]
_MOE_FFN: list[TensorRule] = [
    TensorRule(T.FFN_GATE_INP, W, lambda h: (h.n_embd, h.n_expert), ALL),
    TensorRule(T.FFN_GATE_EXP, W, lambda h: (h.n_embd, _ff_exp(h), h.n_expert), ALL, alt=T.FFN_GATE_UP_EXP),
    TensorRule(T.FFN_UP_EXP, W, lambda h: (h.n_embd, _ff_exp(h), h.n_expert), ALL, alt=T.FFN_GATE_UP_EXP),
    TensorRule(T.FFN_GATE_UP_EXP, W, lambda h: (h.n_embd, 2 * _ff_exp(h), h.n_expert), ALL, required=False),
    TensorRule(T.FFN_DOWN_EXP, W, lambda h: (_ff_exp(h), h.n_embd, h.n_expert), ALL),
    TensorRule(T.FFN_GATE_INP_SHEXP, W, lambda h: (h.n_embd,), ALL),
    TensorRule(T.FFN_GATE_SHEXP, W, lambda h: (h.n_embd, _ff_shexp(h)), ALL),
    TensorRule(T.FFN_UP_SHEXP, W, lambda h: (h.n_embd, _ff_shexp(h)), ALL),
    TensorRule(T.FFN_DOWN_SHEXP, W, lambda h: (_ff_shexp(h), h.n_embd), ALL),
]
del T, W

TENSOR_TABLES: dict[str, list[TensorRule]] = {
    "qwen35": _COMMON + _DENSE_FFN + _MTP,
    "qwen35moe": _COMMON + _MOE_FFN + _MTP,
}
"""Per arch: every tensor llama.cpp's ``load_arch_tensors`` creates, as ``TensorRule`` rows, in
the order a block's tensors are written (global tensors, then per block: norms, mixer, FFN, MTP
extras); the synthetic fixtures are built from these rows (``harness.fixtures.synthetic``)."""


def _markers(table: list[TensorRule], kind: str, other: str) -> set[str]:
    """Templates that only a ``kind`` layer holds (they identify a layer's kind), from the table."""
    mine = {r.template for r in table if kind in r.layers and other not in r.layers}
    theirs = {r.template for r in table if other in r.layers}
    return mine - theirs


_BLK = re.compile(r"^blk\.(\d+)\.")


def _ne4(ne: Iterable[int]) -> tuple[int, ...]:
    """ggml compares shapes with implicit trailing 1s."""
    t = list(ne)
    while len(t) > 1 and t[-1] == 1:
        t.pop()
    return tuple(t)


# ---------------------------------------------------------------------------------------------
# The checks
# ---------------------------------------------------------------------------------------------
def _override_flags(arch: str, block_count: int, nextn: int) -> str:
    return f"--override-kv {arch}.block_count=int:{block_count} --override-kv {arch}.nextn_predict_layers=int:{nextn}"


def check_inventory(model: GGUFModel, h: Qwen35HParams) -> tuple[list[Finding], str, set[int]]:
    """QL201–QL203: classify the MTP inventory (trunk-only, trunk+MTP, MTP-only, declared-but-absent).

    Returns the findings, the classification, and the block indices whose table rows must not
    be checked (absent MTP blocks, an absent trunk of an MTP-only file: each is reported once here).
    """
    a, n_trunk, n_all = h.arch, h.n_layer, h.n_layer_all
    blocks: dict[int, list[str]] = {}
    for name in model.tensor_names:
        m = _BLK.match(name)
        if m:
            blocks.setdefault(int(m.group(1)), []).append(name)
    trunk_present = any(i in blocks for i in range(n_trunk))
    mtp_present = [i for i in range(n_trunk, n_all) if i in blocks]
    out: list[Finding] = []
    skip: set[int] = set()
    if h.n_layer_nextn == 0:
        kind = "trunk-only"
    elif not mtp_present:
        kind = "declared-but-absent"
        skip |= set(range(n_trunk, n_all))
        out.append(_finding(
            "QL201",
            f"{a}.block_count {n_all} counts {h.n_layer_nextn} MTP (nextn) block(s) "
            f"({', '.join(f'blk.{i}' for i in range(n_trunk, n_all))}) but the file has no tensors for them; llama.cpp stops with "
            f"\"missing tensor 'blk.{n_trunk}.attn_norm.weight'\"",
            _override_flags(a, n_trunk, 0),
            key=f"{a}.block_count", layer=n_trunk, expected_tensors=0,
            overrides=[f"{a}.block_count=int:{n_trunk}", f"{a}.nextn_predict_layers=int:0"],
        ))
    elif not trunk_present:
        kind = "MTP-only"
        skip |= set(range(n_trunk))
        out.append(_finding("QL202", f"MTP-only file: blocks {mtp_present} hold nextn tensors and the {n_trunk} trunk layers are absent; "
                            "a legal draft model (llama.cpp -md, loaded with load_mtp), not a model whose logits can be compared",
                            layer=mtp_present[0]))
    else:
        kind = "trunk+MTP"
    beyond = sorted(i for i in blocks if i >= n_all)
    if beyond:
        nextn_like = [i for i in beyond if TENSOR_NAMES[MODEL_TENSOR.NEXTN_EH_PROJ].format(bid=i) + ".weight" in blocks[i]]
        contiguous = beyond == list(range(n_all, n_all + len(beyond)))
        remedy = None
        if nextn_like == beyond and contiguous and h.n_layer_nextn == 0:
            remedy = _override_flags(a, n_all + len(beyond), len(beyond))
        out.append(_finding(
            "QL203",
            f"{sum(len(blocks[i]) for i in beyond)} tensor(s) in block(s) {beyond} beyond {a}.block_count {n_all}"
            + (" (an MTP block not declared in nextn_predict_layers)" if remedy else "")
            + "; llama.cpp refuses the file (wrong number of tensors)",
            remedy, layer=beyond[0], tensor=blocks[beyond[0]][0],
        ))
        skip |= set(beyond)
    return out, kind, skip


SHAPES: dict[str, str] = {
    "trunk-only": "trunk only",
    "trunk+MTP": "trunk + MTP",
    "MTP-only": "MTP only",
}
"""The legal file shapes (``check_inventory``'s classification → its name): llama.cpp loads a
trunk-only file as a model; a trunk + MTP file as a model whose nextn block is a draft head
(loaded with ``load_mtp``, llama.cpp ``--spec-type draft-mtp``); an MTP-only file (the
converter's ``--mtp-only``: ``token_embd``, ``output_norm``, ``output`` and the nextn block) as
a draft model (``-md``), its trunk tensors not required (``load_arch_tensors``: ``mtp_only``)."""


def shape_line(model: GGUFModel, h: Qwen35HParams, kind: str) -> str:
    """The info line naming the file's shape among the legal ones (``SHAPES``) and, for a file
    with an MTP block, which tensors its head uses: E (``nextn.embed_tokens`` or ``token_embd``),
    W (``nextn.shared_head_head`` or ``output``) and the head norm (``nextn.shared_head_norm`` or
    llama.cpp's fallback ``output_norm``), as ``graph_mtp`` in llama.cpp's ``qwen35.cpp`` picks them."""
    legal = ", ".join(SHAPES.values())
    if kind not in SHAPES:
        return f"file shape: not one of the legal ones ({legal}): MTP counted in block_count but not emitted (QL201)"
    line = f"file shape: {SHAPES[kind]} (legal shapes: {legal})"
    if kind == "trunk-only":
        return line
    il = h.n_layer
    t = model.has_tensor

    def pick(own: MODEL_TENSOR, fallback: str) -> str:
        name = TENSOR_NAMES[own].format(bid=il) + ".weight"
        return name if t(name) else f"{fallback} (fallback)"

    output = "output.weight" if t("output.weight") else "token_embd.weight (tied)"
    use = "draft model for -md" if kind == "MTP-only" else "draft head, load_mtp"
    return (f"{line}; blk.{il} is the nextn block ({use}): E = {pick(MODEL_TENSOR.NEXTN_EMBED_TOKENS, 'token_embd.weight')}, "
            f"W = {pick(MODEL_TENSOR.NEXTN_SHARED_HEAD_HEAD, output)}, head norm = "
            f"{pick(MODEL_TENSOR.NEXTN_SHARED_HEAD_NORM, 'output_norm.weight')}")


def _schedule_mismatches(model: GGUFModel, h: Qwen35HParams, skip: set[int]) -> tuple[list[Finding], set[int]]:
    """QL204: trunk layers (outside ``skip``) holding the tensors of the other layer kind than the
    schedule gives them; returns the findings and those layers."""
    table = TENSOR_TABLES[h.arch]
    present = set(model.tensor_names)
    out: list[Finding] = []
    markers = {RECURRENT: _markers(table, RECURRENT, ATTENTION), ATTENTION: _markers(table, ATTENTION, RECURRENT)}
    mismatched: set[int] = set()
    for il in range(h.n_layer):
        if il in skip:
            continue
        kind = h.layer_kind(il)
        other = ATTENTION if kind == RECURRENT else RECURRENT
        held = sorted(n for n in (t.format(bid=il) for t in markers[other]) if n in present)
        if held:
            mismatched.add(il)
            why = ("attention.recurrent_layers" if model.metadata(f"{h.arch}.attention.recurrent_layers") is not None
                   else f"full_attention_interval {h.full_attention_interval or 4}")
            out.append(_finding(
                "QL204",
                f"blk.{il}: the schedule ({why}) makes it a {'Gated DeltaNet' if kind == RECURRENT else 'full-attention'} layer "
                f"but it holds {other} tensors ({', '.join(n.split('.', 2)[2] for n in held)})",
                "fix the layer schedule metadata (full_attention_interval or attention.recurrent_layers) or the converter's layer mapping",
                layer=il, expected=kind, found=other,
            ))
    return out, mismatched


def _unexpected_tensors(model: GGUFModel, h: Qwen35HParams, expected: set[str], ignore: set[int]) -> list[Finding]:
    """QL304: tensors no rule of the arch's table creates (blocks in ``ignore`` are judged
    elsewhere)."""
    out = []
    for name in model.tensor_names:
        if name in expected:
            continue
        m = _BLK.match(name)
        il = int(m.group(1)) if m else None
        if il is not None and il in ignore:
            continue
        out.append(_finding("QL304", f"unexpected tensor {name}: no {h.arch} rule creates it, so llama.cpp refuses the file "
                            "(wrong number of tensors)", "remove the tensor or fix its name", layer=il, tensor=name))
    return out


def check_tensors(model: GGUFModel, h: Qwen35HParams, skip: set[int]) -> list[Finding]:
    """QL204 and QL301–QL304: each layer's tensor set against the schedule
    (``_schedule_mismatches``), then every expected tensor's presence and ggml shape and the vocab
    rows, in one loop over the arch's table, then tensors no rule expects (``_unexpected_tensors``)."""
    table = TENSOR_TABLES[h.arch]
    present = set(model.tensor_names)
    # kind-specific templates are not checked in a layer whose set contradicts the schedule
    out, mismatched = _schedule_mismatches(model, h, skip)
    expected: set[str] = set()
    for rule in table:
        layers: list[int | None] = [None] if GLOBAL in rule.layers else [
            il for il in range(h.n_layer_all) if il not in skip and h.layer_kind(il) in rule.layers
        ]
        for il in layers:
            if il in mismatched and not (ALL <= rule.layers):  # kind-specific row in a mismatched layer
                continue
            name = rule.name(il)
            expected.add(name)
            if name not in present:
                if rule.required and not (rule.alt and TENSOR_NAMES[rule.alt].format(bid=il) + ".weight" in present):
                    out.append(_finding("QL301", f"required tensor {name} is missing", layer=il, tensor=name))
                continue
            want = _ne4(rule.shape(h))
            got = _ne4(model.tensor_info(name).ne)
            if got == want:
                continue
            if rule.vocab and len(got) == 2 and got[0] == want[0]:
                out.append(_finding("QL303", f"{name} has {got[1]} vocab rows but tokenizer.ggml.tokens lists {h.n_vocab} tokens",
                                    tensor=name, expected=h.n_vocab, found=got[1]))
            else:
                out.append(_finding("QL302", f"{name} has ggml shape {list(got)}, expected {list(want)} from the hyperparameters",
                                    layer=il, tensor=name, expected=list(want), found=list(got)))
    return out + _unexpected_tensors(model, h, expected, skip | mismatched)


def check_values(model: GGUFModel, h: Qwen35HParams) -> list[Finding]:
    """QL401–QL406: storage type and value range of the tensors whose rule asks for it.

    ssm_a = −exp(A_log) must be strictly negative; shifted norms (GGUF stores 1 + w) have mean ≈ 1;
    ssm_norm is not shifted (mean ≈ 1, ≈ 2 means it was); SSM scalars, the conv kernel and norm
    weights must be F32 (llama.cpp's quantizer never converts them; ggml's SSM ops need F32);
    token_embd, output, the norms and ssm_a hold no NaN or Inf (QL406; a norm that is not finite
    is not also judged by its mean). Large tensors are checked in chunks
    (``GGUFModel.nonfinite_count``), so memory stays bounded at any vocab.
    """
    out: list[Finding] = []
    rules = [(r, il) for r in TENSOR_TABLES[h.arch] if r.f32 or r.norm or r.negative or r.finite
             for il in ([None] if GLOBAL in r.layers else range(h.n_layer_all))]
    for rule, il in rules:
        name = rule.name(il)
        if not model.has_tensor(name):
            continue
        info = model.tensor_info(name)
        if rule.f32 and info.type != "F32":
            out.append(_finding("QL405", f"{name} is stored {info.type}; it must be F32", "re-convert keeping SSM scalars, "
                                "ssm_conv1d and norm weights in F32 (llama.cpp's quantizer does)", layer=il, tensor=name,
                                expected="F32", found=info.type))
        if not (rule.norm or rule.negative or rule.finite):
            continue
        bad, size = model.nonfinite_count(name)
        if bad:
            out.append(_finding("QL406", f"{name} holds {bad} non-finite (NaN or Inf) of {size} values", "re-convert from the "
                                "original weights; a NaN or Inf here makes every logit NaN", layer=il, tensor=name, found=bad))
        elif rule.norm or rule.negative:  # sign and mean mean nothing once a value is NaN
            out += _range_findings(rule, il, name, model.tensor(name))
    return out


def _range_findings(rule: TensorRule, il: int | None, name: str, w: np.ndarray) -> list[Finding]:
    """QL401–QL404 for one finite tensor ``w`` (float64, NumPy order)."""
    out = []
    if rule.negative and not np.all(w < 0):
        out.append(_finding("QL401", f"{name} must be strictly negative (ssm_a = -exp(A_log)); max {np.max(w):.4g}, "
                            f"{int(np.sum(~(w < 0)))} of {w.size} values not < 0",
                            "store -exp(A_log), not A_log or exp(A_log)", layer=il, tensor=name, found=float(np.max(w))))
    if not rule.norm:
        return out
    mean = float(np.mean(w))
    src = f" (HF {rule.hf})" if rule.hf else ""
    if rule.norm == "shifted" and mean < SHIFT_LOW:
        out.append(_finding("QL402", f"{name} has mean {mean:.3f}; the converter stores 1 + w (mean ≈ 1): the +1 shift is missing",
                            f"add 1 to the weight{src} when converting (Qwen3.5 RMSNorm applies x̂·(1+w))", layer=il, tensor=name, found=mean))
    elif rule.norm == "shifted" and mean > SHIFT_HIGH:
        out.append(_finding("QL403", f"{name} has mean {mean:.3f}; expected ≈ 1: the +1 shift was applied twice",
                            f"apply the +1 shift{src} once", layer=il, tensor=name, found=mean))
    elif rule.norm == "unshifted" and mean > SHIFT_HIGH:
        out.append(_finding("QL404", f"{name} has mean {mean:.3f}; ssm_norm is not shifted by the converter (expected ≈ 1)",
                            "store the gated-norm weight as is, without +1", layer=il, tensor=name, found=mean))
    return out


def memory_estimate(h: Qwen35HParams) -> dict[str, int]:
    """Cache sizes of the trunk, in bytes.

    ``kv_bytes_per_token``: K and V in f16 (llama.cpp's default cache type) over the trunk's
    full-attention layers only: n_attn × 2 × n_head_kv × head_dim × 2 B.
    ``recurrent_bytes_per_sequence``: f32 per Gated DeltaNet layer, conv state
    (d_conv − 1) × conv_dim plus delta-rule state n_v × d_v × d_k, with conv_dim = 2·n_k·d_k + d_inner
    and n_v × d_v = d_inner (llama-hparams.cpp ``n_embd_r`` / ``n_embd_s``), × 4 B. MTP blocks live in a separate draft context: not counted.
    """
    n_rec = sum(1 for il in range(h.n_layer) if h.is_recurrent(il))
    n_attn = h.n_layer - n_rec
    conv = (h.ssm_d_conv - 1) * h.conv_dim
    state = h.ssm_d_inner * h.ssm_d_state
    return {
        "n_attention_layers": n_attn,
        "n_recurrent_layers": n_rec,
        "kv_bytes_per_token": n_attn * 2 * h.n_head_kv * h.head_dim * 2,
        "conv_state_elements_per_layer": conv,
        "ssm_state_elements_per_layer": state,
        "recurrent_bytes_per_sequence": n_rec * (conv + state) * 4,
    }


def lint_model(model: GGUFModel) -> LintReport:
    """Run every check on an opened model (overrides applied) and return the report.

    Raises ``InvalidInput`` (exit 2) for an unsupported architecture; every other defect is a
    finding. Key findings that leave the hyperparameters unreadable stop the later checks.
    """
    arch = model.require_supported()
    report = LintReport(model={"path": str(model.path), "sha256": model.sha256, "arch": arch,
                               "overrides": [o.to_flag() for o in model.overrides.values()],
                               "n_tensors": len(model.tensor_names)})
    report.findings += check_keys(model)
    report.findings += check_imatrix(model)
    report.findings += check_chat_surface(model)
    try:
        h = model.hparams
    except InvalidInput as e:
        if not report.findings:
            report.findings.append(_finding("QL103", "hyperparameters unusable: " + str(e).split(": ", 1)[-1]))
        report.info.append("hyperparameters unreadable: shape, schedule and value checks skipped")
        return report
    report.findings += check_hparams(h, model)
    inv, kind, skip = check_inventory(model, h)
    report.findings += inv
    report.findings += check_tensors(model, h, skip)
    report.findings += check_values(model, h)
    rec = [il for il in range(h.n_layer) if h.is_recurrent(il)]
    att = [il for il in range(h.n_layer) if not h.is_recurrent(il)]
    report.info.append(f"mtp: {kind} ({h.n_layer} trunk layers, {h.n_layer_nextn} nextn declared)")
    report.info.append(shape_line(model, h, kind))
    report.info.append(f"schedule: Gated DeltaNet {rec}; full attention {att}")
    mem = memory_estimate(h)
    report.memory = mem
    report.info.append(
        f"memory: KV cache {mem['kv_bytes_per_token']:,} bytes/token (f16 K+V, {mem['n_attention_layers']} full-attention layers); "
        f"recurrent state {mem['recurrent_bytes_per_sequence']:,} bytes/sequence (f32, {mem['n_recurrent_layers']} Gated DeltaNet layers × "
        f"(conv {mem['conv_state_elements_per_layer']:,} + state {mem['ssm_state_elements_per_layer']:,}) elements)"
    )
    return report


def lint_path(path: str | os.PathLike, overrides: list[str] | None = None) -> LintReport:
    """Open the GGUF at ``path`` with ``--override-kv`` strings applied and lint it (a
    ``fixture:NAME`` is resolved to its path by the caller: ``harness.fixtures.resolve``).

    Raises ``InvalidInput`` (exit 2) for a bad override, a missing, unreadable or truncated file,
    or an unsupported architecture.
    """
    return lint_model(GGUFModel(path, parse_overrides(overrides)))
