"""External engines through the command protocol (``command:NAME``; docs/engine-protocol.md).

Protocol 2 (``protocol = 2`` in the engine's table) keeps one process per model and exchanges
JSON lines (``harness.engines.persistent``); the request objects (schema
``harness-engine-request/v2``) are protocol 1's plus ``op``, ``id``, ``out_dir``, ``settings``,
``sequences``, ``session`` and ``n_tokens``, and the outputs are read by the same bounded readers
(op ``draft`` adds ``draft_logits.npy`` and ``hidden.npy``, read by ``load_matrix``; a
``generate`` with ``speculative`` adds ``speculative.json``, read by ``parse_speculation``).
Protocol 1, below, runs one process per request.

The harness writes a request JSON (schema ``harness-engine-request/v1``: model path, token ids,
chunking, overrides, what to return) into a fresh directory and runs the configured command
template — an argument list, never a shell — with placeholders ``{request}``, ``{out_dir}``,
``{model}`` and ``{python}`` substituted as whole arguments (token data and file names travel only
inside the request file, so they cannot inject arguments). The engine writes ``logits.npy``
(float32 ``[T, V]``), optionally ``activations.npz`` and ``info.json``.

Timeouts, non-zero exits, missing or unreadable files and wrong shapes are ``EngineError`` with
the engine's stderr tail; a logits width different from the model's vocab is ``NotComparable``;
NaN/Inf inside well-formed logits is passed through (the parity gate FAILs that position).
Outputs are read by ``read_outputs``, with every resource bounded (``harness.engines.process``):
each must be a regular file (a FIFO, socket, directory or a link to a device is refused before it
is opened), ``info.json`` at most ``INFO_MAX_BYTES`` of finite JSON, ``activations.npz`` at most
what the model's activations can hold, arrays read with ``np.load(allow_pickle=False)``. The
engine's process group is killed on every exit path and its files live in the run's temporary
directory.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import zipfile
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any, Iterator, Sequence

import numpy as np

from harness.config import HarnessConfig, configured_engine, did_you_mean, engine_table, load_config
from harness.engines.base import (
    BlockPool,
    COMPUTE_CLASSES,
    FIRST_ROW,
    MTP_CHAIN,
    MTP_CONVENTIONS,
    ChainedDrafts,
    Drafts,
    EngineInfo,
    Speculation,
    LogitBlock,
    check_given,
    checked_token_ids,
    from_row,
    npy_rows,
    shifted,
    validate_chunks,
)
from harness.engines.persistent import PersistentProcess, serve_for
from harness.engines.ring import LogitRing, ring_dir
from harness.engines.process import (
    check_timeout,
    exit_status,
    read_small_file,
    regular_file,
    run_process,
    start_error,
)
from harness.errors import EngineError, InvalidInput, NotComparable
from harness.model.gguf_model import GGUFModel, Override, Qwen35HParams
from harness.rundir import run_dir, scratch_dir
from harness.validation import unique_keys

REQUEST_SCHEMA = "harness-engine-request/v1"
RENDER_MAX_BYTES = 1 << 20
"""The largest ``rendered.txt`` (op ``render``) read: a rendered conversation is a prompt, not a corpus."""
REQUEST_SCHEMA_V2 = "harness-engine-request/v2"
SPEC_KEYS = ("command", "timeout_s", "capabilities", "cwd", "env", "compute_class", "protocol")
V2_CAPABILITIES = ("multi_seq", "n_ubatch", "generate", "prefix_reuse", "tokenize", "chat_template", "mtp", "mtp_chain", "speculative",
                   "serve", "logits_ring", "first_row")
CAPABILITIES = ("chunks", "activations", "dequantized_weights", *V2_CAPABILITIES)
"""Every capability a ``[engines.NAME]`` table may declare (docs/engine-protocol.md); another
value is refused, never left for a probe to find missing."""
"""Capabilities only a persistent (``protocol = 2``) engine can have: they need requests that
protocol 1 has no field for."""
V2_FILES = ("logits.npy", "activations.npz", "info.json", "tokens.json", "draft_logits.npy", "hidden.npy", "draft2_logits.npy",
            "rendered.txt", "speculative.json", "serve.json", "serve_logits.npy")
"""The files a protocol-2 reply may name (each in the request's ``out_dir``): ``draft_logits.npy``
and ``hidden.npy`` answer op ``draft`` (capability ``mtp``), ``draft2_logits.npy`` its depth 2
(capability ``mtp_chain``), ``rendered.txt`` op ``render``
(capability ``chat_template``), ``speculative.json`` a speculative ``generate`` (capability
``speculative``), ``serve.json`` and ``serve_logits.npy`` op ``serve`` (capability ``serve``)."""
SERVE_JSON_MAX_BYTES = 16 << 20
"""The largest ``serve.json`` (op ``serve``) read: a step log and token lists, not logits."""
SETTINGS = ("n_ubatch",)
"""Settings a request may carry (``with_settings``), sent as ``settings`` in protocol 2."""
INFO_MAX_BYTES = 1 << 20
"""``info.json`` larger than this (1 MiB) is refused: it is a few hundred bytes of settings."""
INFO_MAX_DEPTH = 32


@dataclass
class CommandSpec:
    """One ``[tool.harness.engines.NAME]`` table.

    ``command``: argument list with placeholders; ``timeout_s``: wall-clock limit per request
    (finite, positive); ``capabilities``: protocol features the engine supports (``chunks``,
    ``activations``); ``cwd``: working directory (default: the config file's directory); ``env``:
    extra variables; ``compute_class``: the precision it computes in (``f64``, ``f32``, ``bf16``,
    ``f16``, ``mixed``), which picks its calibrated gates (its ``info.json`` may state it instead);
    ``protocol``: 1 (one process per request) or 2 (one persistent process per model, JSON lines).
    """

    name: str
    command: list[str]
    timeout_s: float = 600.0
    capabilities: list[str] = field(default_factory=list)
    cwd: Path | None = None
    env: dict[str, str] = field(default_factory=dict)
    compute_class: str | None = None
    protocol: int = 1


def _spec(name: str, t: Any, cfg: HarnessConfig) -> CommandSpec:
    """One engine table, validated; ``InvalidInput`` names the engine and the field."""
    where = engine_table(cfg, "engines", name, t, SPEC_KEYS)
    cmd = t.get("command")
    if not isinstance(cmd, list) or not cmd or not all(isinstance(a, str) and "\x00" not in a for a in cmd):
        raise InvalidInput(f"{where}.command must be a non-empty list of strings without NUL (no shell)")
    timeout = check_timeout(t.get("timeout_s", 600), f"{where}.timeout_s")
    caps = t.get("capabilities", [])
    if not isinstance(caps, list) or not all(isinstance(c, str) for c in caps):
        raise InvalidInput(f"{where}.capabilities must be a list of strings")
    if bad := next((c for c in caps if c not in CAPABILITIES), None):
        raise InvalidInput(f"{where}.capabilities: unknown capability {bad!r}{did_you_mean(bad, CAPABILITIES)}; known: {', '.join(CAPABILITIES)}")
    raw_cwd = t.get("cwd")
    if raw_cwd is not None and (not isinstance(raw_cwd, str) or "\x00" in raw_cwd):
        raise InvalidInput(f"{where}.cwd must be a string (a directory)")
    cwd = Path(raw_cwd) if raw_cwd is not None else cfg.base_dir
    if not cwd.is_absolute():
        cwd = cfg.base_dir / cwd
    env = t.get("env", {})
    if not isinstance(env, dict) or not all(isinstance(v, (str, int, float)) and not isinstance(v, bool) and "\x00" not in str(v)
                                            and k and "=" not in k and "\x00" not in k for k, v in env.items()):
        raise InvalidInput(f"{where}.env must be a table of variable = \"value\" (strings or numbers)")
    cls = t.get("compute_class")
    if cls is not None and cls not in COMPUTE_CLASSES:
        raise InvalidInput(f"{where}.compute_class must be one of {', '.join(COMPUTE_CLASSES)}")
    protocol = t.get("protocol", 1)
    if protocol not in (1, 2) or isinstance(protocol, bool):
        raise InvalidInput(f"{where}.protocol must be 1 (one process per request) or 2 (persistent, JSON lines)")
    if "mtp_chain" in caps and "mtp" not in caps:
        raise InvalidInput(f"{where}: capability 'mtp_chain' (depth-2 drafts) needs 'mtp' too (docs/engine-protocol.md, op draft)")
    if protocol == 1 and any(c in V2_CAPABILITIES for c in caps):
        bad = next(c for c in caps if c in V2_CAPABILITIES)
        raise InvalidInput(f"{where}: capability {bad!r} needs protocol = 2 (persistent mode, docs/engine-protocol.md)")
    if protocol == 2 and any(a in ("{request}", "{out_dir}") for a in cmd):
        raise InvalidInput(f"{where}.command: protocol 2 sends the request and out_dir on stdin; {{request}} and {{out_dir}} are protocol 1 placeholders")
    return CommandSpec(name, list(cmd), timeout, list(caps), cwd, {str(k): str(v) for k, v in env.items()}, cls, int(protocol))


def configured_commands(config: HarnessConfig | None = None) -> dict[str, CommandSpec]:
    """Every command engine in the configuration, validated.

    Raises ``InvalidInput`` naming the engine and field for a malformed table (unknown keys, a
    command that is not an argument list, a timeout that is not a finite positive number, an
    ``env`` that is not a table of strings, ...).
    """
    cfg = config or load_config()
    engines = cfg.get("engines", {}) or {}
    if not isinstance(engines, dict):
        raise InvalidInput(f"{cfg.source}: engines must be a table of [engines.NAME] tables")
    return {name: _spec(name, t, cfg) for name, t in engines.items()}


def _substitute(arg: str, values: dict[str, str]) -> str:
    """Replace a placeholder argument; placeholders only ever stand as a whole argument."""
    return values.get(arg, arg)


# ------------------------------------------------------------------------------ reading outputs


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a finite number")


def _depth(obj: Any, limit: int) -> int:
    """Nesting depth of a parsed JSON value, stopping at ``limit + 1`` (iterative)."""
    deepest, stack = 0, [(obj, 1)]
    while stack:
        o, d = stack.pop()
        deepest = max(deepest, d)
        if deepest > limit:
            break
        if isinstance(o, dict):
            stack.extend((v, d + 1) for v in o.values())
        elif isinstance(o, list):
            stack.extend((v, d + 1) for v in o)
    return deepest


def parse_info(raw: bytes, who: str) -> dict[str, Any]:
    """An engine's ``info.json`` bytes as a dict, validated before it goes near a receipt:
    UTF-8 JSON object, finite numbers only (NaN/Infinity refused), no lone surrogate escapes,
    nested at most ``INFO_MAX_DEPTH`` deep, ``name``/``version`` strings or numbers, ``settings`` an object.
    Raises ``EngineError`` naming ``who``."""
    try:
        info = json.loads(raw.decode("utf-8"), parse_constant=_refuse_constant, object_pairs_hook=unique_keys)
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        msg = "nested too deeply" if isinstance(e, RecursionError) else str(e).splitlines()[0] if str(e) else type(e).__name__
        raise EngineError(f"{who} wrote an unreadable info.json ({msg})") from None
    if not isinstance(info, dict):
        raise EngineError(f"{who} wrote an info.json that is not a JSON object")
    try:
        json.dumps(info, ensure_ascii=False).encode("utf-8")
    except (UnicodeEncodeError, RecursionError):
        raise EngineError(f"{who} wrote an info.json holding a lone surrogate escape or nested too deeply") from None
    if _depth(info, INFO_MAX_DEPTH) > INFO_MAX_DEPTH:
        raise EngineError(f"{who} wrote an info.json nested more than {INFO_MAX_DEPTH} levels deep")
    for key in ("name", "version"):
        if key in info and (isinstance(info[key], bool) or not isinstance(info[key], (str, int, float))):
            raise EngineError(f"{who} wrote an info.json whose {key!r} is not a string")
    if "settings" in info and not isinstance(info["settings"], dict):
        raise EngineError(f"{who} wrote an info.json whose 'settings' is not an object")
    if info.get("compute_class") is not None and info["compute_class"] not in COMPUTE_CLASSES:
        raise EngineError(f"{who} wrote an info.json whose compute_class {str(info['compute_class'])[:40]!r} is not one of "
                          f"{', '.join(COMPUTE_CLASSES)}")
    return info


def activation_bytes_cap(h: Qwen35HParams, n_tokens: int) -> int:
    """The most ``activations.npz`` may hold for ``n_tokens`` positions (uncompressed bytes):
    per position, 64 float64 tensors per block (and the output) as wide as the widest row the
    model has (embedding, vocab, FFN, attention or recurrent width). Far above any real capture,
    and finite: a zip bomb or an engine gone wild is refused before anything is decompressed."""
    widest = max(h.n_embd, h.n_vocab, h.n_ff, h.n_ff_exp * max(h.n_expert, 1), 2 * h.n_head * h.head_dim, h.conv_dim, 1)
    return max(n_tokens, 1) * (h.n_layer_all + 1) * 64 * widest * 8


def _required_output(out_dir: Path, name: str, who: str, stderr_tail: str) -> Path:
    """``out_dir/name``, which must exist and be a regular file: ``EngineError`` (with the
    engine's stderr tail) otherwise."""
    path = out_dir / name
    try:
        st = regular_file(path, who)
    except EngineError as e:
        raise EngineError(str(e), stderr_tail) from None
    if st is None:
        raise EngineError(f"{who} wrote no {name}", stderr_tail)
    return path


def _first_line(e: BaseException) -> str:
    """An exception's first message line, or its type's name when it has no message."""
    return str(e).splitlines()[0] if str(e) else type(e).__name__


def load_matrix(out_dir: Path, name: str, who: str, n_rows: int, n_cols: int, stderr_tail: str = "", *,
                what: str | None = None, cols: str = "V", vocab: bool = True) -> np.ndarray:
    """``out_dir/name`` memory-mapped, a float32 ``[n_rows, n_cols]`` array (``np.save`` format,
    read with ``allow_pickle=False``; a header claiming more rows than the file holds is refused
    by ``np.load`` before anything is read). ``what`` names the array in messages (default: the
    file name), ``cols`` its column count's symbol (``V``, ``n_embd``).

    Raises ``EngineError`` (missing, not a regular file, unreadable, pickled, not one array, wrong
    dtype, not 2-D, wrong row count; with ``vocab`` False also a wrong column count) and, with
    ``vocab`` True, ``NotComparable`` for a column count other than ``n_cols`` (the model's vocab).
    """
    what = what or name
    path = _required_output(out_dir, name, who, stderr_tail)
    try:
        arr = np.load(path, mmap_mode="r", allow_pickle=False)
    except (ValueError, OSError, EOFError) as e:
        raise EngineError(f"{who} wrote an unreadable {name} ({_first_line(e)})", stderr_tail) from None
    if not isinstance(arr, np.ndarray):
        raise EngineError(f"{who} wrote a {name} that is not one array", stderr_tail)
    if arr.dtype != np.float32:
        raise EngineError(f"{who} wrote {what} of dtype {arr.dtype}; the protocol requires float32", stderr_tail)
    if arr.ndim != 2 or arr.shape[0] != n_rows or (not vocab and arr.shape[1] != n_cols):
        expect = f"[{n_rows}, {cols}]" if vocab else f"[{n_rows}, {n_cols}] ([rows, {cols}])"
        raise EngineError(f"{who} wrote {what} of shape {arr.shape}; expected {expect}", stderr_tail)
    if arr.shape[1] != n_cols:
        raise NotComparable(f"{who} {what} have {arr.shape[1]} columns but the model's vocab has {n_cols}")
    return arr


def load_logits(out_dir: Path, who: str, n_tokens: int, n_vocab: int, stderr_tail: str = "") -> np.ndarray:
    """``out_dir/logits.npy`` memory-mapped (float32 ``[n_tokens, n_vocab]``; ``load_matrix``).

    Raises ``EngineError`` (missing, not a regular file, unreadable, pickled, wrong dtype or
    shape) and ``NotComparable`` (a column count other than ``n_vocab``).
    """
    return load_matrix(out_dir, "logits.npy", who, n_tokens, n_vocab, stderr_tail, what="logits")


def mtp_convention_of(info: dict[str, Any], who: str) -> str:
    """The ``settings.mtp_convention`` an engine's ``info.json`` states (one of
    ``harness.engines.base.MTP_CONVENTIONS``: ``llama.cpp`` or ``vllm``). Raises ``EngineError``
    naming the two legal values when it is missing or anything else."""
    settings = info.get("settings") if isinstance(info.get("settings"), dict) else {}
    conv = settings.get("mtp_convention")
    if conv not in MTP_CONVENTIONS:
        legal = " or ".join(repr(c) for c in MTP_CONVENTIONS)
        said = "states no settings.mtp_convention" if conv is None else f"states settings.mtp_convention {str(conv)[:40]!r}"
        raise EngineError(f"{who}'s info.json {said}; a draft reply must state {legal} (docs/engine-protocol.md, op draft)")
    return str(conv)


def load_info(out_dir: Path, who: str, stderr_tail: str = "") -> dict[str, Any]:
    """``out_dir/info.json`` parsed by ``parse_info`` ({} when absent); ``EngineError`` when it
    is not a regular file, larger than ``INFO_MAX_BYTES`` or invalid."""
    try:
        raw = read_small_file(out_dir / "info.json", who, INFO_MAX_BYTES)
        return {} if raw is None else parse_info(raw, who)
    except EngineError as e:
        raise EngineError(str(e), stderr_tail) from None


def load_activations(out_dir: Path, who: str, n_tokens: int, max_bytes: int, stderr_tail: str = "") -> dict[str, np.ndarray]:
    """``out_dir/activations.npz`` as ``{name: array}``; the zip's declared uncompressed sizes
    must total at most ``max_bytes`` (zipfile never inflates a member past its declared size).
    Raises ``EngineError`` (missing, not a regular file, unreadable, pickled, too large)."""
    path = _required_output(out_dir, "activations.npz", who, stderr_tail)
    try:
        with zipfile.ZipFile(path) as zf:
            total = sum(i.file_size for i in zf.infolist())
        if total > max_bytes:
            raise EngineError(f"{who} wrote an activations.npz holding {total:,} bytes; at most {max_bytes:,} for {n_tokens} positions", stderr_tail)
        with np.load(path, allow_pickle=False) as z:
            return {k: np.array(z[k]) for k in z.files}
    except (ValueError, OSError, EOFError, zipfile.BadZipFile, zipfile.LargeZipFile, NotImplementedError) as e:
        raise EngineError(f"{who} wrote an unreadable activations.npz ({_first_line(e)})", stderr_tail) from None


def given_request(given: Sequence[int], n_tokens: int, draft_max: int, n_vocab: int, who: str) -> dict[str, Any]:
    """The ``speculative`` object of a request with drafts the harness gives: ``{"draft": "given",
    "draft_max": k, "tokens": [...]}`` (docs/engine-protocol.md "Given drafts"). Raises
    ``EngineError`` naming ``who`` before anything is sent: a draft outside [0, n_vocab), more
    drafts than ``n_tokens``, a draft_max above ``SPEC_GIVEN_MAX``."""
    toks = check_given(given, n_tokens, draft_max, n_vocab, who)
    return {"draft": "given", "draft_max": int(draft_max), "tokens": toks}


def parse_speculation(raw_tokens: bytes | None, raw_counts: bytes | None, who: str, n_seqs: int, n_tokens: int, draft_max: int,
                      n_vocab: int, draft: str = "mtp") -> list[Speculation]:
    """The reply of a speculative ``generate`` (docs/engine-protocol.md, "Op generate with
    speculative") as one ``Speculation`` per sequence. ``raw_tokens``: ``tokens.json``, a list of
    at most ``n_tokens`` ids in ``[0, n_vocab)`` (one sequence) or ``n_seqs`` such lists (a
    ``sequences`` request); ``raw_counts``: ``speculative.json``, ``{"draft": "mtp", "draft_max":
    k, "sequences": [{"accepted": [...], "rejected": [...]}, ...]}`` with one entry per sequence,
    per step non-negative ints with accepted + rejected ≤ ``draft_max``, and exactly the steps its
    tokens need: the prefill gives the first token and step i gives ``accepted[i] + 1``, so with
    n ≥ 1 tokens 1 + Σ_{i<S−1}(a_i + 1) < n ≤ 1 + Σ_i(a_i + 1) (no step with no token of its own).
    Raises ``EngineError`` naming ``who`` and the first thing wrong (either file missing, not
    UTF-8 JSON, another shape, counts that contradict the tokens)."""
    if raw_tokens is None:
        raise EngineError(f"{who} wrote no tokens.json for a speculative generate request")
    if raw_counts is None:
        raise EngineError(f"{who} wrote no speculative.json for a speculative generate request")
    try:
        ids = json.loads(raw_tokens.decode("utf-8"), parse_constant=_refuse_constant)
        counts = json.loads(raw_counts.decode("utf-8"), parse_constant=_refuse_constant, object_pairs_hook=unique_keys)
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        twice = f" ({e})" if "appears twice" in str(e) else ""
        raise EngineError(f"{who} wrote a tokens.json or speculative.json that is not UTF-8 JSON{twice}") from None
    per = ids if n_seqs > 1 else [ids]
    if n_seqs > 1 and (not isinstance(ids, list) or len(ids) != n_seqs):
        raise EngineError(f"{who} wrote a tokens.json that is not {n_seqs} lists of token ids (one per sequence)")
    for q in per:
        if (not isinstance(q, list) or len(q) > n_tokens
                or not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < n_vocab for t in q)):
            raise EngineError(f"{who} wrote a tokens.json that is not a list of at most {n_tokens} token ids in [0, {n_vocab})")
    if not isinstance(counts, dict) or counts.get("draft") != draft or counts.get("draft_max") != draft_max:
        raise EngineError(f"{who} wrote a speculative.json that is not an object with draft \"{draft}\" and draft_max {draft_max}")
    seqs = counts.get("sequences")
    if not isinstance(seqs, list) or len(seqs) != n_seqs:
        raise EngineError(f"{who} wrote a speculative.json whose sequences is not a list of {n_seqs} entries")
    out = []
    for i, (q, c) in enumerate(zip(per, seqs)):
        acc, rej = (c.get(x) if isinstance(c, dict) else None for x in ("accepted", "rejected"))
        ok = (isinstance(acc, list) and isinstance(rej, list) and len(acc) == len(rej)
              and all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in acc + rej))
        if not ok or any(a + r > draft_max for a, r in zip(acc, rej)):
            raise EngineError(f"{who} wrote a speculative.json whose sequence {i} is not per-step non-negative accepted/rejected "
                              f"counts with accepted + rejected <= draft_max {draft_max}")
        made = 1 + sum(a + 1 for a in acc)
        if (not q and acc) or (q and not (made - (acc[-1] + 1 if acc else 1) < len(q) <= made)):
            raise EngineError(f"{who} wrote a speculative.json whose sequence {i} has {len(acc)} steps giving {made if q else 0} "
                              f"tokens, but {len(q)} tokens in tokens.json")
        out.append(Speculation([int(t) for t in q], [int(a) for a in acc], [int(r) for r in rej]))
    return out


class CommandEngine:
    """An engine run as an external command (see module docstring): one process per request
    (``protocol = 1``) or one persistent process per model spoken to in JSON lines
    (``protocol = 2``, ``harness.engines.persistent``), which adds several sequences per request
    (``logits_multi``), settings (``with_settings(n_ubatch=...)``), greedy generation
    (``generate``), sessions (``session_logits``), the MTP head's draft logits (``draft``,
    ``draft_multi``: op ``draft``) and speculative generation (``speculative``,
    ``speculative_multi``: op ``generate`` with ``speculative``), each only with its capability
    declared.
    """

    def __init__(self, spec: CommandSpec, model_path: str | os.PathLike, overrides: Sequence[Override] = (), block_size: int = 256,
                 settings: dict[str, Any] | None = None):
        self.spec = spec
        self.model_path = Path(model_path).resolve()
        self.overrides = list(overrides)
        self.block_size = block_size
        self.settings = dict(settings or {})
        self._last_info: dict[str, Any] = {}
        self._reply_files: list[str] = []  # the files the latest protocol-2 reply named
        self._ring_pool = BlockPool()  # the blocks read from every request's ring (``_open_ring``)

    @property
    def who(self) -> str:
        return f"command:{self.spec.name}"

    @cached_property
    def _hparams(self) -> Qwen35HParams:
        return GGUFModel(self.model_path, self.overrides).hparams

    @property
    def n_vocab(self) -> int:
        return self._hparams.n_vocab

    @property
    def info(self) -> EngineInfo:
        reported = self._server().last_info if self.spec.protocol == 2 else self._last_info
        settings = {"command": self.spec.command, "timeout_s": self.spec.timeout_s, "reported": reported.get("settings", {}),
                    "overrides": [o.to_flag() for o in self.overrides]}
        if self.spec.protocol == 2:
            settings.update(protocol=2, **self.settings)
        conv = (reported.get("settings") or {}).get("mtp_convention")
        if "mtp" in self.spec.capabilities and conv in MTP_CONVENTIONS:
            settings["mtp_convention"] = conv  # where the head's rows sit (base.MTP_CONVENTIONS), as the engine stated it
        return EngineInfo(
            name=self.who,
            version=str(reported.get("version", "unknown")),
            settings=settings,
            capabilities=list(self.spec.capabilities),
            build={"reported_name": reported.get("name")},
            compute_class=reported.get("compute_class") or self.spec.compute_class,
        )

    def _need(self, capability: str) -> None:
        if capability not in self.spec.capabilities:
            raise EngineError(f"{self.who} does not declare the {capability!r} capability")

    def _argv(self, values: dict[str, str]) -> list[str]:
        if self.spec.cwd is not None and not self.spec.cwd.is_dir():
            raise InvalidInput(f"{self.who}: cwd {self.spec.cwd} is not a directory")
        return [_substitute(a, {**values, "{model}": str(self.model_path), "{python}": sys.executable}) for a in self.spec.command]

    # -- protocol 1: one process per request --------------------------------------------------
    def _run(self, tokens: list[int], chunks: list[int] | None, want: list[str], workdir: Path) -> tuple[Path, str]:
        """Run the engine once in ``workdir``; return its output folder and stderr tail."""
        out_dir = workdir / "out"
        out_dir.mkdir()
        request = {
            "schema": REQUEST_SCHEMA,
            "model": str(self.model_path),
            "tokens": tokens,
            "chunks": chunks,
            "overrides": [o.to_flag() for o in self.overrides],
            "want": want,
        }
        req_path = workdir / "request.json"
        req_path.write_text(json.dumps(request))
        argv = self._argv({"{request}": str(req_path), "{out_dir}": str(out_dir)})
        try:
            res = run_process(argv, timeout_s=self.spec.timeout_s, workdir=workdir, cwd=self.spec.cwd, env={**os.environ, **self.spec.env})
        except OSError as e:
            raise start_error(self.who, argv[0], e) from None
        if res.returncode is None:
            raise EngineError(f"{self.who} timed out after {self.spec.timeout_s:g} s", res.tail)
        if res.returncode != 0:
            raise EngineError(f"{self.who} {exit_status(res.returncode)}", res.tail)
        self._last_info = load_info(out_dir, self.who, res.tail)
        return out_dir, res.tail

    def prestart(self) -> None:
        """A protocol-2 engine's process started before its first request
        (``harness.engines.base.prestart``); a start that fails is left to that request to
        report. Nothing for protocol 1 (a process per request)."""
        if self.spec.protocol == 2:
            try:
                self._server().start()
            except EngineError:
                pass

    # -- protocol 2: one persistent process per model -----------------------------------------
    def _server(self) -> PersistentProcess:
        key = (self.spec.name, tuple(self.spec.command), str(self.spec.cwd), str(self.model_path), tuple(o.to_flag() for o in self.overrides))
        return serve_for(key, self.who, self._argv({}), self.spec.cwd, {**os.environ, **self.spec.env})

    @contextmanager
    def _exchange(self, body: dict[str, Any]) -> Iterator[tuple[Path, str]]:
        """One protocol-2 request: yields the request's output folder (removed after) and the
        engine's stderr tail; the reply's ``info.json`` becomes what ``info`` reports."""
        server = self._server()
        out_dir = server.out_dir()
        try:
            reply = server.request(self._v2_body(body), out_dir, self.spec.timeout_s)
            yield out_dir, self._accept_reply(server, out_dir, reply)
        finally:
            shutil.rmtree(out_dir, ignore_errors=True)

    def _v2_body(self, body: dict[str, Any]) -> dict[str, Any]:
        """A protocol-2 request: the fields every request carries (schema, model, overrides,
        settings) and ``body``'s."""
        return {"schema": REQUEST_SCHEMA_V2, "model": str(self.model_path), "overrides": [o.to_flag() for o in self.overrides],
                "settings": dict(self.settings), **body}

    def _accept_reply(self, server: Any, out_dir: Path, reply: dict[str, Any]) -> str:
        """Check a final reply's files (only the protocol's), keep its ``info.json`` as what
        ``info`` reports; returns the engine's stderr tail. Raises ``EngineError``."""
        bad = [f for f in reply.get("files", []) if f not in V2_FILES]
        if bad:
            raise EngineError(f"{self.who} named {bad[0][:60]!r} among its files; the protocol's files are {', '.join(V2_FILES)}")
        self._reply_files = list(reply.get("files", []))
        tail = server.tail()
        info = load_info(out_dir, self.who, tail)
        if info:
            server.last_info = info
        return tail

    def _v2_logits(self, body: dict[str, Any], n_rows: int) -> Iterator[LogitBlock]:
        if "logits_ring" in self.spec.capabilities and body.get("want") == ["logits"]:
            yield from self._ring_logits(body, n_rows)
            return
        with self._exchange(body) as (out_dir, tail):
            arr = load_logits(out_dir, self.who, n_rows, self.n_vocab, tail)
            for start in range(0, n_rows, self.block_size):
                yield start, npy_rows(arr, start, start + self.block_size)
            del arr

    def _ring_logits(self, body: dict[str, Any], n_rows: int) -> Iterator[LogitBlock]:
        """A ``logits`` request answered through a shared-memory ring (capability ``logits_ring``,
        ``harness.engines.ring``): each announced block is read from its slot and yielded as
        ``(start, float32 [n, V])``, in position order. Raises ``EngineError`` (the process
        killed) for a block out of order, outside the ring or past ``n_rows``, and for a final
        reply before ``n_rows`` rows."""
        server = self._server()
        out_dir = server.out_dir()
        try:
            with self._open_ring(out_dir) as ring:
                blocks = server.request_blocks(self._v2_body({**body, "logits_ring": ring.spec}), out_dir, self.spec.timeout_s)
                expect = 0
                try:
                    while True:
                        try:
                            block = next(blocks)
                        except StopIteration as stop:
                            reply = stop.value
                            break
                        slot, start, rows = (block.get(k) for k in ("slot", "start", "rows"))
                        if not all(type(v) is int for v in (slot, start, rows)) or start != expect or not (0 <= slot < ring.slots) \
                                or not (0 < rows <= ring.rows) or expect + rows > n_rows:
                            tail = server.tail()
                            raise EngineError(f"{self.who} announced ring block {str(block)[:80]!r}; expected rows from {expect} "
                                              f"(at most {ring.rows}, {n_rows} in all) in a slot below {ring.slots}", tail)
                        yield start, self._ring_read(ring, slot, rows, server)
                        expect += rows
                finally:
                    blocks.close()  # before the final reply: the engine is mid-request and is killed
                self._ring_reply(server, out_dir, reply, expect, n_rows)
        finally:
            shutil.rmtree(out_dir, ignore_errors=True)

    def _open_ring(self, out_dir: Path) -> LogitRing:
        """A ring in ``/dev/shm`` (``ring_dir``), else, when that cannot be made (no space), in the
        request's folder; ``EngineError`` when neither can."""
        where = ring_dir(out_dir)
        try:
            return LogitRing(where, self.n_vocab, pool=self._ring_pool, sealed=True)
        except OSError as e:
            if where != out_dir:
                try:
                    return LogitRing(out_dir, self.n_vocab, pool=self._ring_pool)
                except OSError:
                    pass
            raise EngineError(f"{self.who}: cannot make the logits ring in {where} ({e.strerror or e})") from None

    def _ring_read(self, ring: LogitRing, slot: int, rows: int, server: Any) -> np.ndarray:
        try:
            return ring.read(slot, rows)
        except OSError as e:
            raise EngineError(f"{self.who}: reading the logits ring failed ({e})", server.tail()) from None

    def _ring_reply(self, server: Any, out_dir: Path, reply: dict[str, Any], got: int, n_rows: int) -> None:
        """Check a ring request's final reply: every row announced, then ``_accept_reply``."""
        if got != n_rows:
            raise EngineError(f"{self.who} finished a ring request after {got} of {n_rows} rows", server.tail())
        self._accept_reply(server, out_dir, reply)

    # -- the engine protocol ------------------------------------------------------------------
    logits_first_row = True
    """``logits`` takes ``first_row`` (``harness.engines.base.logits_each``): sent to an engine
    that declares capability ``first_row``, else its full rows are cut here."""

    def logits(self, tokens: Sequence[int], chunks: Sequence[int] | None = None, first_row: int = 0) -> Iterator[LogitBlock]:
        """``Engine.logits``: blocks ``(start, float32 [B, V])`` in position order. ``first_row`` >
        0: positions ``first_row`` .. T − 1 alone, blocks' starts positions: a protocol-2 engine
        that declares ``first_row`` is sent it (``"first_row": k``, no ``chunks``) and returns
        those T − k rows alone; any other returns every row and the ones before are dropped
        here. Raises ``EngineError`` (a malformed reply, a capability not declared)."""
        tokens = [int(t) for t in tokens]
        first = int(first_row)
        if first and FIRST_ROW in self.spec.capabilities and self.spec.protocol == 2 and chunks is None and 0 < first < len(tokens):
            body = {"op": "logits", "tokens": tokens, "chunks": None, "want": ["logits"], "first_row": first}
            yield from shifted(self._v2_logits(body, len(tokens) - first), first)
            return
        if first:
            yield from from_row(self.logits(tokens, chunks), first)
            return
        pieces = validate_chunks(len(tokens), chunks) if chunks is not None else None
        if pieces is not None:
            self._need("chunks")
        if self.spec.protocol == 2:
            yield from self._v2_logits({"op": "logits", "tokens": tokens, "chunks": pieces, "want": ["logits"]}, len(tokens))
            return
        with scratch_dir("cmd-") as d:
            out_dir, tail = self._run(tokens, pieces, ["logits"], d)
            arr = load_logits(out_dir, self.who, len(tokens), self.n_vocab, tail)
            for start in range(0, len(tokens), self.block_size):
                yield start, npy_rows(arr, start, start + self.block_size)
            del arr

    def activations(self, tokens: Sequence[int], chunks: Sequence[int] | None = None) -> dict[str, np.ndarray]:
        """Named activations ``{name: [T, ...]}`` from ``activations.npz`` (capability ``activations``)."""
        self._need("activations")
        tokens = [int(t) for t in tokens]
        pieces = validate_chunks(len(tokens), chunks) if chunks is not None else None
        cap = activation_bytes_cap(self._hparams, len(tokens))
        if self.spec.protocol == 2:
            with self._exchange({"op": "logits", "tokens": tokens, "chunks": pieces, "want": ["logits", "activations"]}) as (out_dir, tail):
                return load_activations(out_dir, self.who, len(tokens), cap, tail)
        with scratch_dir("cmd-") as d:
            out_dir, tail = self._run(tokens, pieces, ["logits", "activations"], d)
            return load_activations(out_dir, self.who, len(tokens), cap, tail)

    def logits_multi(self, sequences: Sequence[Sequence[int]], chunks: Sequence[Sequence[int] | None] | None = None) -> Iterator[LogitBlock]:
        """Several sequences decoded together (capability ``multi_seq``; ``harness.engines.base.Engine``),
        each optionally in its own ``chunks``; rows are the sequences' rows concatenated."""
        self._need("multi_seq")
        seqs = [[int(t) for t in q] for q in sequences]
        if not seqs or any(not q for q in seqs):
            raise EngineError(f"{self.who}: logits_multi needs at least one non-empty sequence")
        per = list(chunks) if chunks is not None else [None] * len(seqs)
        if len(per) != len(seqs):
            raise EngineError(f"{self.who}: {len(per)} chunk lists for {len(seqs)} sequences")
        items = [{"tokens": q, "chunks": validate_chunks(len(q), c) if c is not None else None} for q, c in zip(seqs, per)]
        yield from self._v2_logits({"op": "logits", "sequences": items, "want": ["logits"]}, sum(len(q) for q in seqs))

    def draft(self, tokens: Sequence[int], chunks: Sequence[int] | None = None) -> Drafts:
        """The engine's MTP (nextn) head, teacher forced through its own prefill (op ``draft``,
        capability ``mtp``, protocol 2; docs/engine-protocol.md): ``tokens`` fed in ``chunks``
        (capability ``chunks`` too) → ``Drafts`` with ``logits`` float32 [T−1, V] (row t: the head's
        logits for tokens[t+2]) from ``draft_logits.npy``, and ``hidden`` float32 [T, n_embd] (the
        h_t the head was fed) from ``hidden.npy`` when the engine wrote it, else None. The rows sit
        where ``info.settings["mtp_convention"]`` says (``llama.cpp`` or ``vllm``), which the reply's
        ``info.json`` must state. Raises ``EngineError`` (capability not declared, fewer than 2
        tokens, a refusal, a missing or malformed file, a missing or unknown convention) and
        ``NotComparable`` (draft logits as wide as something other than the vocab)."""
        self._need("mtp")
        tokens = [int(t) for t in tokens]
        pieces = validate_chunks(len(tokens), chunks) if chunks is not None else None
        if pieces is not None:
            self._need("chunks")
        return self._v2_drafts({"op": "draft", "tokens": tokens, "chunks": pieces, "want": ["draft_logits", "hidden"]}, [tokens])[0]

    def draft_multi(self, sequences: Sequence[Sequence[int]]) -> list[Drafts]:
        """``draft`` of several sequences decoded together, one sequence id (state slot) each
        (capabilities ``mtp`` and ``multi_seq``): one ``Drafts`` per sequence, in order, cut from
        ``draft_logits.npy`` [Σ(T_i − 1), V] and ``hidden.npy`` [Σ T_i, n_embd] (the sequences'
        rows concatenated). Raises as ``draft`` does, and ``EngineError`` for no sequences."""
        self._need("mtp")
        self._need("multi_seq")
        seqs = [[int(t) for t in q] for q in sequences]
        if not seqs:
            raise EngineError(f"{self.who}: draft_multi needs at least one sequence")
        items = [{"tokens": q, "chunks": None} for q in seqs]
        return self._v2_drafts({"op": "draft", "sequences": items, "want": ["draft_logits", "hidden"]}, seqs)

    def draft_chain(self, tokens: Sequence[int], draft_tokens: Sequence[int] | None = None) -> ChainedDrafts:
        """Teacher-forced drafts at depth 1 and 2 (op ``draft`` with ``"depth": 2``, capability
        ``mtp_chain``; docs/engine-protocol.md, "Depth 2"), the prompt fed whole: ``draft_tokens``
        (the T − 1 step-1 tokens d_t; None: the argmax of this engine's own depth-1 rows, one
        ``draft`` exchange more) are sent, and ``draft_logits.npy`` and ``draft2_logits.npy`` are
        read, float32 [T − 1, V] each (``harness.engines.base.ChainedDrafts``). Raises
        ``EngineError`` (a capability not declared, fewer than 2 tokens, ``draft_tokens`` of
        another length or outside the vocabulary, a refusal, a missing or malformed file, no
        convention stated) and ``NotComparable`` (logits as wide as something other than the vocab)."""
        self._need("mtp")
        self._need(MTP_CHAIN)
        tokens = [int(t) for t in tokens]
        if len(tokens) < 2:
            raise EngineError(f"{self.who}: draft logits need at least 2 tokens per sequence (row t predicts tokens[t+2])")
        d = [int(x) for x in (np.argmax(self.draft(tokens).logits, axis=1) if draft_tokens is None else draft_tokens)]
        n = len(tokens) - 1
        if len(d) != n or any(not 0 <= x < self.n_vocab for x in d):
            raise EngineError(f"{self.who}: {len(d)} draft_tokens for {n} draft rows; one id in [0, {self.n_vocab}) per row is needed")
        body = {"op": "draft", "tokens": tokens, "chunks": None, "depth": 2, "draft_tokens": d, "want": ["draft_logits", "draft2_logits"]}
        with self._exchange(body) as (out_dir, tail):
            mtp_convention_of(self._server().last_info, self.who)
            d1 = npy_rows(load_matrix(out_dir, "draft_logits.npy", self.who, n, self.n_vocab, tail, what="draft logits"), 0, n)
            d2 = npy_rows(load_matrix(out_dir, "draft2_logits.npy", self.who, n, self.n_vocab, tail, what="depth-2 draft logits"), 0, n)
        return ChainedDrafts(d1, d2, np.asarray(d, np.int64))

    def _v2_drafts(self, body: dict[str, Any], seqs: list[list[int]]) -> list[Drafts]:
        """One op-``draft`` exchange for ``seqs``; its files read, checked and cut per sequence."""
        if any(len(q) < 2 for q in seqs):
            raise EngineError(f"{self.who}: draft logits need at least 2 tokens per sequence (row t predicts tokens[t+2])")
        n_rows, n_tok, n_embd = sum(len(q) - 1 for q in seqs), sum(len(q) for q in seqs), self._hparams.n_embd
        with self._exchange(body) as (out_dir, tail):
            mtp_convention_of(self._server().last_info, self.who)
            logits = load_matrix(out_dir, "draft_logits.npy", self.who, n_rows, self.n_vocab, tail, what="draft logits")
            logits = npy_rows(logits, 0, n_rows)
            hidden = None
            try:
                has_hidden = regular_file(out_dir / "hidden.npy", self.who) is not None
            except EngineError as e:
                raise EngineError(str(e), tail) from None
            if "hidden.npy" in self._reply_files and not has_hidden:
                raise EngineError(f"{self.who} named hidden.npy among its files but wrote none", tail)
            if has_hidden:
                mapped = load_matrix(out_dir, "hidden.npy", self.who, n_tok, n_embd, tail, what="hidden states", cols="n_embd", vocab=False)
                hidden = npy_rows(mapped, 0, n_tok)
                del mapped
        out, r, t = [], 0, 0
        for q in seqs:
            out.append(Drafts(logits[r : r + len(q) - 1], None if hidden is None else hidden[t : t + len(q)]))
            r, t = r + len(q) - 1, t + len(q)
        return out

    def with_settings(self, **changes: Any) -> "CommandEngine":
        """The same engine and process with settings changed (capability ``n_ubatch``:
        ``n_ubatch=N``, a positive int); raises ``EngineError`` for any other setting."""
        self._need("n_ubatch")
        unknown = [k for k in changes if k not in SETTINGS]
        if unknown:
            raise EngineError(f"{self.who}: no setting {unknown[0]!r}; settings a request may carry: {', '.join(SETTINGS)}")
        for k, v in changes.items():
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise EngineError(f"{self.who}: setting {k} must be a positive integer, not {v!r}")
        return CommandEngine(self.spec, self.model_path, self.overrides, self.block_size, {**self.settings, **changes})

    def generate(self, tokens: Sequence[int], n_tokens: int) -> list[int]:
        """Greedy free-running continuation (capability ``generate``): the engine's ``tokens.json``,
        a JSON list of at most ``n_tokens`` ids in the vocab, else ``EngineError``."""
        self._need("generate")
        tokens, n = [int(t) for t in tokens], int(n_tokens)
        with self._exchange({"op": "generate", "tokens": tokens, "n_tokens": n}) as (out_dir, tail):
            raw = read_small_file(out_dir / "tokens.json", self.who, 32 * n + 64)
            if raw is None:
                raise EngineError(f"{self.who} wrote no tokens.json for a generate request", tail)
            try:
                ids = json.loads(raw.decode("utf-8"))
            except (UnicodeDecodeError, ValueError):
                ids = None
        if (not isinstance(ids, list) or len(ids) > n
                or not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < self.n_vocab for t in ids)):
            raise EngineError(f"{self.who} wrote a tokens.json that is not a list of at most {n} token ids in [0, {self.n_vocab})")
        return ids

    def speculative(self, tokens: Sequence[int], n_tokens: int, *, draft_max: int, chunks: Sequence[int] | None = None,
                    session: dict[str, Any] | None = None, given: Sequence[int] | None = None) -> Speculation:
        """Greedy speculative continuation with drafts from the engine's MTP head (capability
        ``speculative``, protocol 2; ``harness.engines.base.Engine``): op ``generate`` with
        ``"speculative": {"draft": "mtp", "draft_max": k}``, ``tokens`` fed in ``chunks``
        (capability ``chunks`` too) and, with ``session`` (``{"id", "parent", "after"}``), the state
        kept or continued from. Returns a ``Speculation`` (at most ``n_tokens`` ids; the accepted and
        rejected drafts per verification step) read from ``tokens.json`` and ``speculative.json``
        by ``parse_speculation``. ``given``: drafts the harness gives (``"speculative": {"draft":
        "given", "draft_max": k, "tokens": given}``, docs/engine-protocol.md "Given drafts"); the
        reply's ``logits.npy`` (float32 [len(tokens), V], the row that chose each token), when named,
        becomes ``Speculation.logits``. Raises ``EngineError`` (capability not declared, draft_max not an
        int ≥ 1, an empty prompt, a refusal, a missing or malformed reply file)."""
        self._need("speculative")
        tokens = [int(t) for t in tokens]
        pieces = validate_chunks(len(tokens), chunks) if chunks is not None else None
        if pieces is not None:
            self._need("chunks")
        body: dict[str, Any] = {"tokens": tokens, "chunks": pieces}
        if session:
            body["session"] = {"id": None if session.get("id") is None else str(session["id"]),
                               "parent": None if session.get("parent") is None else str(session["parent"]),
                               "after": int(session.get("after", 0))}
        return self._v2_speculative(body, 1, n_tokens, draft_max, given)[0]

    def speculative_multi(self, sequences: Sequence[Sequence[int]], n_tokens: int, *, draft_max: int) -> list[Speculation]:
        """``speculative`` of several sequences generated together, one sequence id (state slot)
        each (capabilities ``speculative`` and ``multi_seq``): the request's ``sequences``,
        ``tokens.json`` one list per sequence, ``speculative.json`` one entry per sequence; one
        ``Speculation`` per sequence, in order. Raises as ``speculative`` does, and ``EngineError``
        for no sequences."""
        self._need("speculative")
        self._need("multi_seq")
        seqs = [[int(t) for t in q] for q in sequences]
        if not seqs:
            raise EngineError(f"{self.who}: speculative_multi needs at least one sequence")
        return self._v2_speculative({"sequences": [{"tokens": q, "chunks": None} for q in seqs]}, len(seqs), n_tokens, draft_max)

    def _v2_speculative(self, body: dict[str, Any], n_seqs: int, n_tokens: int, draft_max: int,
                        given: Sequence[int] | None = None) -> list[Speculation]:
        """One speculative-``generate`` exchange for ``n_seqs`` sequences; its two files read
        (bounded) and checked by ``parse_speculation``; with ``given``, the drafts the harness gives
        (checked by ``given_request``) and a ``logits.npy`` of the verify rows read when named."""
        if isinstance(draft_max, bool) or not isinstance(draft_max, (int, np.integer)) or draft_max < 1:
            raise EngineError(f"{self.who}: draft_max must be an integer >= 1, not {draft_max!r}")
        seqs = [q["tokens"] for q in body["sequences"]] if "sequences" in body else [body["tokens"]]
        if any(not q for q in seqs):
            raise EngineError(f"{self.who}: speculative generation needs at least one prompt token per sequence")
        n, k = int(n_tokens), int(draft_max)
        spec: dict[str, Any] = {"draft": "mtp", "draft_max": k}
        if given is not None:
            spec = given_request(given, n, k, self.n_vocab, self.who)
        req = {"op": "generate", **body, "n_tokens": n, "speculative": spec, "want": ["logits"]}
        with self._exchange(req) as (out_dir, tail):
            try:
                raw_ids = read_small_file(out_dir / "tokens.json", self.who, n_seqs * (32 * n + 8) + 64)
                raw_counts = read_small_file(out_dir / "speculative.json", self.who, n_seqs * (48 * n + 64) + 256)
                out = parse_speculation(raw_ids, raw_counts, self.who, n_seqs, n, k, self.n_vocab, spec["draft"])
                if n_seqs == 1 and "logits.npy" in self._reply_files:
                    out[0].logits = np.array(load_logits(out_dir, self.who, len(out[0].tokens), self.n_vocab, tail))
                return out
            except EngineError as e:
                raise EngineError(str(e), tail) from None

    def tokenize_text(self, text: str, add_special: bool = False) -> list[int]:
        """The engine's own token ids for ``text`` (capability ``tokenize``, protocol 2: op
        ``tokenize`` with ``text`` and ``add_special``, reply file ``tokens.json``, a JSON list of
        ids in the vocab). Raises ``EngineError`` for a missing, oversized or malformed reply."""
        self._need("tokenize")
        with self._exchange({"op": "tokenize", "text": str(text), "add_special": bool(add_special)}) as (out_dir, tail):
            raw = read_small_file(out_dir / "tokens.json", self.who, 16 * (len(str(text).encode("utf-8")) + 16) + 64)
            if raw is None:
                raise EngineError(f"{self.who} wrote no tokens.json for a tokenize request", tail)
            try:
                ids = json.loads(raw.decode("utf-8"))
            except (UnicodeDecodeError, ValueError):
                ids = None
        return checked_token_ids(ids, self.n_vocab, self.who, "tokens.json")

    def render_chat(self, conversation: dict[str, Any]) -> str:
        """The engine's own rendering of a chat conversation (capability ``chat_template``,
        protocol 2: op ``render`` with ``messages``, ``tools``, ``add_generation_prompt`` and
        ``template_kwargs`` (template options, ``{}`` without: e.g. ``enable_thinking``), reply
        file ``rendered.txt``, the prompt text in UTF-8, at most ``RENDER_MAX_BYTES``). Raises
        ``EngineError`` for a missing, oversized or non-UTF-8 reply."""
        self._need("chat_template")
        body = {"op": "render", "messages": conversation["messages"], "tools": conversation.get("tools"),
                "add_generation_prompt": bool(conversation.get("add_generation_prompt", True)),
                "template_kwargs": dict(conversation.get("template_kwargs") or {})}
        with self._exchange(body) as (out_dir, tail):
            raw = read_small_file(out_dir / "rendered.txt", self.who, RENDER_MAX_BYTES)
            if raw is None:
                raise EngineError(f"{self.who} wrote no rendered.txt for a render request", tail)
            try:
                return raw.decode("utf-8")
            except UnicodeDecodeError:
                raise EngineError(f"{self.who} wrote a rendered.txt that is not UTF-8") from None

    def session_logits(self, tokens: Sequence[int], *, session: str, parent: str | None = None, after: int = 0,
                       checkpoints: Sequence[int] = ()) -> Iterator[LogitBlock]:
        """Logits of ``tokens`` fed after session ``parent``'s state at ``after`` tokens, kept as
        ``session`` with ``checkpoints`` (capability ``prefix_reuse``; ``harness.engines.base.Engine``)."""
        self._need("prefix_reuse")
        tokens = [int(t) for t in tokens]
        body = {"op": "logits", "tokens": tokens, "chunks": None, "want": ["logits"],
                "session": {"id": str(session), "parent": parent, "after": int(after), "checkpoints": [int(k) for k in checkpoints]}}
        yield from self._v2_logits(body, len(tokens))

    def serve(self, scenario: Any) -> Any:
        """Op ``serve`` (capability ``serve``; docs/engine-protocol.md, "Op serve"): the whole
        ``harness.engines.serving.ServeScenario`` in one request, answered with ``serve.json`` (per
        request its prompt, tokens, slot, cached prefix tokens and rows; the step log) and
        ``serve_logits.npy``. Returns the ``ServeResult`` (content checked by
        ``check_serve_result`` in the probe). Raises ``EngineError``."""
        self._need("serve")
        if self.spec.protocol != 2:
            raise EngineError(f"{self.who}: op serve needs protocol = 2")
        keep = Path(tempfile.mkdtemp(dir=run_dir())) / "serve_logits.npy"
        with self._exchange({"op": "serve", "tokens": [], "chunks": None, "want": ["logits"], **scenario.to_json()}) as (out_dir, tail):
            return _serve_reply(self, out_dir, tail, scenario, keep)

    def restart(self) -> None:
        """Start the engine's process afresh for its next request (the serving probe's solo runs
        run on a freshly started engine); protocol 1 starts one per request anyway."""
        if self.spec.protocol == 2:
            self._server().close()

    def drop_sessions(self) -> None:
        """Ask the engine to free every session it keeps (capability ``prefix_reuse`` or
        ``speculative``, whose requests may keep sessions too)."""
        if "speculative" not in self.spec.capabilities:
            self._need("prefix_reuse")
        with self._exchange({"op": "drop", "sessions": None}):
            pass


def _serve_reply(engine: "CommandEngine", out_dir: Path, tail: str, scenario: Any, keep: Path) -> Any:
    """Read op ``serve``'s reply in ``out_dir`` (``serve.json``, optionally ``serve_logits.npy``,
    moved to ``keep`` so its rows can be read after the request's folder is removed); returns a
    ``harness.engines.serving.ServeResult``. Raises ``EngineError`` for a missing, oversized or
    malformed file."""
    from harness.engines.serving import parse_serve_reply

    path = _required_output(out_dir, "serve.json", engine.who, tail)
    if path.stat().st_size > SERVE_JSON_MAX_BYTES:
        raise EngineError(f"{engine.who} wrote a serve.json over {SERVE_JSON_MAX_BYTES >> 20} MiB", tail)
    try:
        doc = json.loads(path.read_bytes().decode("utf-8"), parse_constant=_refuse_constant, object_pairs_hook=unique_keys)
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise EngineError(f"{engine.who} wrote a serve.json that is not UTF-8 JSON", tail) from None
    rows_of = None
    if (out_dir / "serve_logits.npy").exists():
        n_rows = sum(int(r.get("logits", {}).get("rows", 0)) for r in doc.get("requests", []) if isinstance(r, dict)
                     and isinstance(r.get("logits"), dict) and isinstance(r["logits"].get("rows"), int)) if isinstance(doc, dict) else 0
        shutil.move(str(_required_output(out_dir, "serve_logits.npy", engine.who, tail)), keep)
        arr = load_matrix(keep.parent, keep.name, engine.who, n_rows, engine.n_vocab, tail, what="serve_logits.npy")

        def rows_of(first: int, n: int) -> Any:
            if first < 0 or first + n > n_rows:
                raise EngineError(f"{engine.who}: serve.json names rows {first}..{first + n} of serve_logits.npy's {n_rows}")
            return lambda a, b: npy_rows(arr, first + a, first + b)
    return parse_serve_reply(doc, scenario, rows_of, engine.who)


def load_command_engine(name: str, model_path: str | os.PathLike, overrides: Sequence[Override] = ()) -> CommandEngine:
    """The configured command engine ``name`` bound to ``model_path``.

    Raises ``InvalidInput`` when no such engine is configured (naming the configured ones).
    """
    cfg = load_config()
    return CommandEngine(configured_engine(configured_commands(cfg), name, "command", "engines", cfg), model_path, overrides)
