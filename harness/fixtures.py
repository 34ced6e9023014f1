"""Deterministic synthetic qwen35 / qwen35moe GGUF fixtures, addressable as ``fixture:NAME``.

No real weights can be downloaded, so the harness builds real GGUF files with the `gguf`
package's ``GGUFWriter`` from a seed: the same seed gives the same bytes (same sha256). Files are
cached in a user cache dir (``$HARNESS_CACHE_DIR`` or platformdirs' user cache). Quantized
variants are made by llama.cpp's own quantizer (``llama_model_quantize`` via llama-cpp-python) in
a worker process. Trained fixtures (``trained-*``) are committed under ``harness/data/fixtures``.

Tensor shapes follow llama.cpp ``src/models/qwen35.cpp`` / ``qwen35moe.cpp``
(``load_arch_tensors``); NumPy arrays are written in NumPy order, the reverse of ggml's ``ne``.
Conventions baked in as llama.cpp's converter does (``convert_hf_to_gguf.py`` Qwen3.5 classes):
shifted RMSNorm weights (mean ≈ 1), ``ssm_a = -exp(A_log) < 0``, unshifted ``ssm_norm``.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import re
import subprocess
import sys
from collections import Counter
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable

import numpy as np

from harness.errors import EngineError, InvalidInput

FIXTURE_PREFIX = "fixture:"
GENERATOR_VERSION = 1  # bump when the bytes a spec produces change
DATA_DIR = Path(__file__).parent / "data"
TRAINED_DIR = DATA_DIR / "fixtures"


@dataclass(frozen=True)
class FixtureSpec:
    """Everything that determines a synthetic fixture's bytes.

    Sizes are element counts; ``full_attention_interval`` 4 puts full attention at layers 3, 7.
    ``n_expert`` > 0 makes a ``qwen35moe``. ``nextn`` writes that many MTP blocks;
    ``nextn_declared_absent`` counts them in the metadata but writes no tensors for them.
    ``quant`` names a llama.cpp file type applied after writing F32 (``F16``, ``Q8_0``, ``Q4_K_M``).
    """

    name: str
    description: str
    seed: int = 0
    n_layer: int = 8
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
    nextn: int = 0
    nextn_declared_absent: bool = False
    n_vocab_pad_to: int = 0
    tie_output: bool = False
    quant: str | None = None
    base: str | None = None  # the F32 fixture a quantized one is made from
    context_length: int = 4096

    @property
    def arch(self) -> str:
        return "qwen35moe" if self.n_expert > 0 else "qwen35"


def _spec_list() -> list[FixtureSpec]:
    tiny = FixtureSpec(
        name="tiny-qwen35",
        description="8 layers (attention at 3, 7), d 64, ff 128, 4/2 heads x 32, DeltaNet n_k 2 < n_v 4, F32",
        seed=1,
    )
    moe = replace(
        tiny,
        name="tiny-qwen35moe",
        description="tiny trunk with MoE FFN: 4 experts, 2 used, gated shared expert, F32",
        seed=2,
        n_expert=4,
        n_expert_used=2,
        n_ff_exp=64,
        n_ff_shexp=96,
    )
    small = replace(
        tiny,
        name="small-qwen35",
        description="d 256 (every matmul width a multiple of 256 so K-quants apply), 8 layers, F32",
        seed=3,
        n_embd=256,
        n_ff=512,
        n_head=4,
        n_head_kv=2,
        head_dim=64,
        n_rot=16,
        rope_sections=(4, 2, 2, 0),
        ssm_d_state=64,
    )
    specs = [
        tiny,
        moe,
        small,
        replace(tiny, name="tiny-qwen35-mtp", description="tiny trunk + one MTP (nextn) block", nextn=1),
        replace(
            tiny,
            name="mtp-declared-absent",
            description="packaging defect: block_count counts an MTP block, nextn_predict_layers=1, no MTP tensors",
            nextn=1,
            nextn_declared_absent=True,
        ),
        replace(
            tiny,
            name="tiny-qwen35-v248k",
            description="tiny trunk with Qwen3.5's real vocab size (248,320 rows), output tied to token_embd",
            n_vocab_pad_to=248_320,
            tie_output=True,
        ),
    ]
    for q in ("F16", "Q8_0", "Q4_K_M"):
        specs.append(
            replace(small, name=f"small-qwen35-{q}", description=f"small-qwen35 quantized to {q} by llama.cpp", quant=q, base="small-qwen35")
        )
    return specs


SPECS: dict[str, FixtureSpec] = {s.name: s for s in _spec_list()}


# ---------------------------------------------------------------------------------------------
# Byte-level BPE vocabulary (GPT-2 byte↔unicode mapping, tokenizer.ggml.model = "gpt2")
# ---------------------------------------------------------------------------------------------
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
N_MERGES = 256
# The pre-tokenizer regex of GPT-2 (close enough to qwen2's for learning merges on a corpus).
_PRETOKENIZE = re.compile(r"""'s|'t|'re|'ve|'m|'ll|'d| ?[^\W\d_]+| ?\d| ?[^\s\w]+|\s+(?!\S)|\s+""")


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte → printable unicode character table (openai/gpt-2 encoder.py)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, (chr(c) for c in cs)))


def _merge_corpus() -> str:
    from harness.prompts import load_prompts

    return "\n".join(p.text for p in load_prompts(None) if p.text)


@functools.lru_cache(maxsize=4)
def learn_bpe(text: str, n_merges: int) -> list[tuple[str, str]]:
    """Learn ``n_merges`` byte-level BPE merges from ``text`` (deterministic: ties broken by pair)."""
    b2u = bytes_to_unicode()
    words = Counter("".join(b2u[b] for b in w.encode("utf-8")) for w in _PRETOKENIZE.findall(text))
    seqs = {w: list(w) for w in words}
    merges: list[tuple[str, str]] = []
    for _ in range(n_merges):
        pairs: Counter = Counter()
        for w, c in words.items():
            s = seqs[w]
            for a, b in zip(s, s[1:]):
                pairs[(a, b)] += c
        if not pairs:
            break
        best = min(pairs.items(), key=lambda kv: (-kv[1], kv[0]))[0]
        merges.append(best)
        for w, s in seqs.items():
            i, out = 0, []
            while i < len(s):
                if i + 1 < len(s) and (s[i], s[i + 1]) == best:
                    out.append(s[i] + s[i + 1])
                    i += 2
                else:
                    out.append(s[i])
                    i += 1
            seqs[w] = out
    return merges


def build_vocab(pad_to: int = 0) -> tuple[list[str], list[int], list[str]]:
    """Tokens, token types and merges of the fixtures' byte-level BPE vocabulary.

    256 byte tokens, ``N_MERGES`` learned merges, the special tokens, then (``pad_to``) unused
    padding tokens up to ``pad_to`` rows.
    """
    from gguf import TokenType

    b2u = bytes_to_unicode()
    tokens = [b2u[b] for b in range(256)]
    merges = list(learn_bpe(_merge_corpus(), N_MERGES))
    seen = set(tokens)
    for a, b in merges:
        if a + b not in seen:
            tokens.append(a + b)
            seen.add(a + b)
    types = [int(TokenType.NORMAL)] * len(tokens)
    for s in SPECIAL_TOKENS:
        tokens.append(s)
        types.append(int(TokenType.CONTROL))
    i = 0
    while len(tokens) < pad_to:
        tokens.append(f"[PAD{i}]")
        types.append(int(TokenType.UNUSED))
        i += 1
    return tokens, types, [f"{a} {b}" for a, b in merges]


# ---------------------------------------------------------------------------------------------
# Weights
# ---------------------------------------------------------------------------------------------
def _norm_weight(rng: np.random.Generator, n: int) -> np.ndarray:
    """A shifted RMSNorm weight as the converter stores it: 1 + w, spread around 1."""
    return (1.0 + 0.2 * rng.standard_normal(n)).astype(np.float32)


def _matrix(rng: np.random.Generator, n_out: int, n_in: int, gain: float = 1.0) -> np.ndarray:
    return (gain * rng.standard_normal((n_out, n_in)) / np.sqrt(n_in)).astype(np.float32)


def make_tensors(spec: FixtureSpec, n_vocab: int) -> dict[str, np.ndarray]:
    """All tensors of ``spec`` in NumPy order, generated from ``spec.seed`` layer by layer.

    Trunk tensors are drawn before MTP tensors, so a fixture with an MTP block has the same trunk
    as its trunk-only twin of the same seed.
    """
    rng = np.random.default_rng(spec.seed)
    d = spec.n_embd
    t: dict[str, np.ndarray] = {}
    t["token_embd.weight"] = rng.standard_normal((n_vocab, d)).astype(np.float32)
    t["output_norm.weight"] = _norm_weight(rng, d)
    if not spec.tie_output:
        t["output.weight"] = _matrix(rng, n_vocab, d, gain=3.0)
    n_k, n_v, dk = spec.ssm_n_group, spec.ssm_dt_rank, spec.ssm_d_state
    dv = dk
    conv_dim = 2 * n_k * dk + n_v * dv
    hd, nh, nkv = spec.head_dim, spec.n_head, spec.n_head_kv

    def attention_block(p: str) -> None:
        t[f"{p}.attn_q.weight"] = _matrix(rng, 2 * nh * hd, d)
        t[f"{p}.attn_k.weight"] = _matrix(rng, nkv * hd, d)
        t[f"{p}.attn_v.weight"] = _matrix(rng, nkv * hd, d)
        t[f"{p}.attn_q_norm.weight"] = _norm_weight(rng, hd)
        t[f"{p}.attn_k_norm.weight"] = _norm_weight(rng, hd)
        t[f"{p}.attn_output.weight"] = _matrix(rng, d, nh * hd)

    def dense_ffn(p: str) -> None:
        t[f"{p}.ffn_gate.weight"] = _matrix(rng, spec.n_ff, d)
        t[f"{p}.ffn_up.weight"] = _matrix(rng, spec.n_ff, d)
        t[f"{p}.ffn_down.weight"] = _matrix(rng, d, spec.n_ff)

    for il in range(spec.n_layer):
        p = f"blk.{il}"
        t[f"{p}.attn_norm.weight"] = _norm_weight(rng, d)
        t[f"{p}.post_attention_norm.weight"] = _norm_weight(rng, d)
        if (il + 1) % spec.full_attention_interval == 0:
            attention_block(p)
        else:
            t[f"{p}.attn_qkv.weight"] = _matrix(rng, conv_dim, d)
            t[f"{p}.attn_gate.weight"] = _matrix(rng, n_v * dv, d)
            t[f"{p}.ssm_conv1d.weight"] = (0.5 * rng.standard_normal((conv_dim, spec.ssm_d_conv))).astype(np.float32)
            # decays exp(g) spread from near 0 to near 1: A = exp(A_log) over three decades
            a_log = np.linspace(np.log(0.02), np.log(20.0), n_v) + 0.1 * rng.standard_normal(n_v)
            t[f"{p}.ssm_a"] = (-np.exp(a_log)).astype(np.float32)
            t[f"{p}.ssm_dt.bias"] = (0.5 + 0.8 * rng.standard_normal(n_v)).astype(np.float32)
            t[f"{p}.ssm_alpha.weight"] = _matrix(rng, n_v, d)
            t[f"{p}.ssm_beta.weight"] = _matrix(rng, n_v, d)
            t[f"{p}.ssm_norm.weight"] = _norm_weight(rng, dv)
            t[f"{p}.ssm_out.weight"] = _matrix(rng, d, n_v * dv)
        if spec.n_expert:
            e, ffe, ffs = spec.n_expert, spec.n_ff_exp, spec.n_ff_shexp
            t[f"{p}.ffn_gate_inp.weight"] = _matrix(rng, e, d, gain=2.0)
            t[f"{p}.ffn_gate_exps.weight"] = (rng.standard_normal((e, ffe, d)) / np.sqrt(d)).astype(np.float32)
            t[f"{p}.ffn_up_exps.weight"] = (rng.standard_normal((e, ffe, d)) / np.sqrt(d)).astype(np.float32)
            t[f"{p}.ffn_down_exps.weight"] = (rng.standard_normal((e, d, ffe)) / np.sqrt(ffe)).astype(np.float32)
            t[f"{p}.ffn_gate_inp_shexp.weight"] = _matrix(rng, 1, d, gain=2.0).reshape(d)
            t[f"{p}.ffn_gate_shexp.weight"] = _matrix(rng, ffs, d)
            t[f"{p}.ffn_up_shexp.weight"] = _matrix(rng, ffs, d)
            t[f"{p}.ffn_down_shexp.weight"] = _matrix(rng, d, ffs)
        else:
            dense_ffn(p)

    for il in range(spec.n_layer, spec.n_layer + spec.nextn):
        p = f"blk.{il}"
        before = set(t)
        t[f"{p}.attn_norm.weight"] = _norm_weight(rng, d)
        t[f"{p}.post_attention_norm.weight"] = _norm_weight(rng, d)
        attention_block(p)
        dense_ffn(p)
        t[f"{p}.nextn.eh_proj.weight"] = _matrix(rng, d, 2 * d)
        t[f"{p}.nextn.enorm.weight"] = _norm_weight(rng, d)
        t[f"{p}.nextn.hnorm.weight"] = _norm_weight(rng, d)
        if spec.nextn_declared_absent:
            for k in set(t) - before:  # drawn (so the rng stream matches) but not written
                del t[k]
    return t


def make_metadata(spec: FixtureSpec, tokens: list[str], types: list[int], merges: list[str]) -> dict[str, tuple[str, Any]]:
    """The GGUF metadata of ``spec`` as ``{key: (gguf value kind, value)}`` (kinds: u32, f32,
    str, bool, arr_i32, arr_str, arr_i32t)."""
    a = spec.arch
    m: dict[str, tuple[str, Any]] = {
        "general.name": ("str", spec.name),
        "general.file_type": ("u32", 0),
        f"{a}.block_count": ("u32", spec.n_layer + spec.nextn),
        f"{a}.context_length": ("u32", spec.context_length),
        f"{a}.embedding_length": ("u32", spec.n_embd),
        f"{a}.attention.head_count": ("u32", spec.n_head),
        f"{a}.attention.head_count_kv": ("u32", spec.n_head_kv),
        f"{a}.attention.key_length": ("u32", spec.head_dim),
        f"{a}.attention.value_length": ("u32", spec.head_dim),
        f"{a}.attention.layer_norm_rms_epsilon": ("f32", spec.rms_eps),
        f"{a}.rope.dimension_count": ("u32", spec.n_rot),
        f"{a}.rope.dimension_sections": ("arr_i32", list(spec.rope_sections)),
        f"{a}.rope.freq_base": ("f32", spec.rope_freq_base),
        f"{a}.full_attention_interval": ("u32", spec.full_attention_interval),
        f"{a}.ssm.conv_kernel": ("u32", spec.ssm_d_conv),
        f"{a}.ssm.state_size": ("u32", spec.ssm_d_state),
        f"{a}.ssm.group_count": ("u32", spec.ssm_n_group),
        f"{a}.ssm.time_step_rank": ("u32", spec.ssm_dt_rank),
        f"{a}.ssm.inner_size": ("u32", spec.ssm_dt_rank * spec.ssm_d_state),
    }
    if spec.n_expert:
        m[f"{a}.expert_count"] = ("u32", spec.n_expert)
        m[f"{a}.expert_used_count"] = ("u32", spec.n_expert_used)
        m[f"{a}.expert_feed_forward_length"] = ("u32", spec.n_ff_exp)
        m[f"{a}.expert_shared_feed_forward_length"] = ("u32", spec.n_ff_shexp)
    else:
        m[f"{a}.feed_forward_length"] = ("u32", spec.n_ff)
    if spec.nextn:
        m[f"{a}.nextn_predict_layers"] = ("u32", spec.nextn)
    eot = tokens.index("<|endoftext|>")
    m.update(
        {
            "tokenizer.ggml.model": ("str", "gpt2"),
            "tokenizer.ggml.pre": ("str", "qwen35"),
            "tokenizer.ggml.tokens": ("arr_str", tokens),
            "tokenizer.ggml.token_type": ("arr_i32t", types),
            "tokenizer.ggml.merges": ("arr_str", merges),
            "tokenizer.ggml.eos_token_id": ("u32", tokens.index("<|im_end|>")),
            "tokenizer.ggml.bos_token_id": ("u32", eot),
            "tokenizer.ggml.padding_token_id": ("u32", eot),
            "tokenizer.ggml.add_bos_token": ("bool", False),
        }
    )
    return m


Defect = Callable[[dict, dict], None]
"""A function ``(metadata, tensors) -> None`` that plants a defect in place before writing."""


def write_gguf(path: Path, arch: str, metadata: dict[str, tuple[str, Any]], tensors: dict[str, np.ndarray]) -> None:
    """Write ``metadata`` and ``tensors`` (NumPy order) to ``path`` with ``gguf.GGUFWriter``.

    Metadata kinds: u32, i32, f32, str, bool, arr_i32, arr_str, arr_i32t (token types).
    """
    import gguf

    w = gguf.GGUFWriter(str(path), arch)
    adders = {
        "u32": w.add_uint32,
        "i32": w.add_int32,
        "f32": w.add_float32,
        "str": w.add_string,
        "bool": w.add_bool,
    }
    for key, (kind, value) in metadata.items():
        if kind in adders:
            adders[kind](key, value)
        elif kind == "arr_str":
            w.add_array(key, list(value))
        elif kind in ("arr_i32", "arr_i32t"):
            w.add_key_value(key, list(value), gguf.GGUFValueType.ARRAY, sub_type=gguf.GGUFValueType.INT32)
        elif kind == "arr_bool":
            w.add_key_value(key, list(value), gguf.GGUFValueType.ARRAY, sub_type=gguf.GGUFValueType.BOOL)
        else:
            raise ValueError(f"unknown metadata kind {kind!r} for {key}")
    for name, arr in tensors.items():
        w.add_tensor(name, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def build_fixture(spec: FixtureSpec, path: Path, defect: Defect | None = None) -> Path:
    """Write the F32 fixture ``spec`` (optionally with ``defect`` planted) to ``path`` atomically."""
    tokens, types, merges = build_vocab(spec.n_vocab_pad_to)
    meta = make_metadata(spec, tokens, types, merges)
    tensors = make_tensors(spec, len(tokens))
    if defect is not None:
        defect(meta, tensors)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        write_gguf(tmp, spec.arch, meta, tensors)
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    return path


# ---------------------------------------------------------------------------------------------
# Quantization with llama.cpp's own quantizer (in a worker: ggml may abort())
# ---------------------------------------------------------------------------------------------
_QUANT_WORKER = r"""
import sys, llama_cpp
src, dst, ftype = sys.argv[1], sys.argv[2], int(sys.argv[3])
p = llama_cpp.llama_model_quantize_default_params()
p.ftype = ftype
p.nthread = 2
rc = llama_cpp.llama_model_quantize(src.encode(), dst.encode(), p)
sys.exit(0 if rc == 0 else 10)
"""


def quantize(src: Path, dst: Path, qtype: str) -> Path:
    """Quantize ``src`` to ``dst`` as llama.cpp file type ``qtype`` (e.g. ``Q4_K_M``).

    Raises ``InvalidInput`` for an unknown type and ``EngineError`` when the quantizer fails.
    """
    from gguf import LlamaFileType

    try:
        ftype = int(LlamaFileType[f"MOSTLY_{qtype}"]) if qtype != "F32" else int(LlamaFileType.ALL_F32)
    except KeyError:
        raise InvalidInput(f"unknown quantization type {qtype!r}") from None
    tmp = dst.with_name(f".{dst.name}.{os.getpid()}.tmp")
    proc = subprocess.run(
        [sys.executable, "-c", _QUANT_WORKER, str(src), str(tmp), str(ftype)], capture_output=True, text=True
    )
    if proc.returncode != 0 or not tmp.exists():
        tmp.unlink(missing_ok=True)
        tail = "\n".join(proc.stderr.strip().splitlines()[-5:])
        raise EngineError(f"llama.cpp quantizer failed for {qtype} (exit {proc.returncode})", tail)
    os.replace(tmp, dst)
    return dst


# ---------------------------------------------------------------------------------------------
# Cache and names
# ---------------------------------------------------------------------------------------------
def cache_dir() -> Path:
    """Where built fixtures live: ``$HARNESS_CACHE_DIR`` or the platform user cache dir."""
    env = os.environ.get("HARNESS_CACHE_DIR")
    if env:
        base = Path(env)
    else:
        from platformdirs import user_cache_dir

        base = Path(user_cache_dir("qwen35-harness"))
    return base / f"fixtures-v{GENERATOR_VERSION}"


def trained_fixtures() -> dict[str, Path]:
    """Committed trained fixtures: ``harness/data/fixtures/NAME.gguf`` (with ``NAME.recipe.json``)."""
    if not TRAINED_DIR.is_dir():
        return {}
    return {p.stem: p for p in sorted(TRAINED_DIR.glob("*.gguf"))}


def fixture_names() -> list[str]:
    """Every fixture name: synthetic specs, committed trained fixtures, the trained quant ladder."""
    return list(SPECS) + [n for n in trained_fixtures() if n not in SPECS] + list(TRAINED_LADDER)


def fixture_path(name: str) -> Path:
    """Where fixture ``name`` lives (or will, once built), without building it."""
    trained = trained_fixtures()
    if name in trained:
        return trained[name]
    if name in TRAINED_LADDER:
        base = trained.get(TRAINED_LADDER[name][0])
        return cache_dir() / (f"{name}-{sha256_of(base)[:12]}.gguf" if base else f"{name}.gguf")
    return cache_dir() / f"{name}.gguf"


def build(name: str, force: bool = False) -> Path:
    """Return the path of fixture ``name``, building it (and its base) into the cache if needed.

    Raises ``InvalidInput`` naming the known fixtures when ``name`` is unknown.
    """
    trained = trained_fixtures()
    if name in trained:
        return trained[name]
    if name in TRAINED_LADDER:
        return build_trained_quant(name, force)
    if name not in SPECS:
        raise InvalidInput(f"unknown fixture {name!r}; known: {', '.join(fixture_names())}")
    spec = SPECS[name]
    path = cache_dir() / f"{name}.gguf"
    if path.exists() and not force:
        return path
    from filelock import FileLock

    path.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(path) + ".lock"):
        if path.exists() and not force:
            return path
        if spec.quant:
            assert spec.base is not None
            quantize(build(spec.base), path, spec.quant)
        else:
            build_fixture(spec, path)
    return path


def resolve_model(spec: str | os.PathLike) -> Path:
    """``fixture:NAME`` → the built fixture's path; anything else is taken as a file path.

    Raises ``InvalidInput`` for an unknown fixture or a missing file.
    """
    s = str(spec)
    if s.startswith(FIXTURE_PREFIX):
        return build(s[len(FIXTURE_PREFIX) :])
    p = Path(s)
    if not p.is_file():
        raise InvalidInput(f"{s}: no such model file (use a path or fixture:NAME; see `harness fixtures list`)")
    return p


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def describe(name: str) -> dict[str, Any]:
    """Name, description, arch, quant, seed and (when built) path and sha256 of a fixture."""
    if name in SPECS:
        s = SPECS[name]
        d: dict[str, Any] = {"name": name, "description": s.description, "arch": s.arch, "quant": s.quant or "F32", "seed": s.seed}
    elif name in TRAINED_LADDER:
        base, q = TRAINED_LADDER[name]
        d = {"name": name, "description": f"{base} quantized to {q} by llama.cpp (built on demand)", "arch": "qwen35", "quant": q, "seed": None}
    else:
        recipe = trained_fixtures()[name].with_suffix(".recipe.json")
        info = json.loads(recipe.read_text()) if recipe.exists() else {}
        d = {"name": name, "description": info.get("description", "trained fixture (committed)"), "arch": info.get("arch", "?"),
             "quant": info.get("quant", "?"), "seed": info.get("seed")}
    return d


def spec_as_dict(spec: FixtureSpec) -> dict[str, Any]:
    return dataclasses.asdict(spec)


# ---------------------------------------------------------------------------------------------
# Quantized ladder of the committed trained-qwen35-256 (built on demand by llama.cpp's quantizer)
# ---------------------------------------------------------------------------------------------
TRAINED_LADDER: dict[str, tuple[str, str]] = {
    f"trained-qwen35-256-{q}": ("trained-qwen35-256", q) for q in ("Q8_0", "Q6_K", "Q4_K_M")
}
"""``NAME -> (committed trained base, llama.cpp file type)``; every matmul input width of the base
is a multiple of 256, so the K-quants really apply (no silent fallback)."""


def build_trained_quant(name: str, force: bool = False) -> Path:
    """Quantize the committed base of ``TRAINED_LADDER[name]`` into the cache (path keyed by the
    base's sha256, so a retrained base never meets a stale quant). Raises ``InvalidInput`` when
    the base is not committed, ``EngineError`` when llama.cpp's quantizer fails."""
    base, qtype = TRAINED_LADDER[name]
    src = trained_fixtures().get(base)
    if src is None:
        raise InvalidInput(f"fixture {name!r} needs the committed trained fixture {base!r}, which is missing")
    path = cache_dir() / f"{name}-{sha256_of(src)[:12]}.gguf"
    if path.exists() and not force:
        return path
    from filelock import FileLock

    path.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(path) + ".lock"):
        if force or not path.exists():
            quantize(src, path, qtype)
    return path
