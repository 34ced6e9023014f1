"""External engines through the command protocol (``command:NAME``; docs/engine-protocol.md).

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
import signal
import sys
import zipfile
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any, Iterator, Sequence

import numpy as np

from harness.config import HarnessConfig, load_config
from harness.engines.base import (
    COMPUTE_CLASSES,
    EngineInfo,
    LogitBlock,
    npy_rows,
    validate_chunks,
)
from harness.engines.process import (
    check_timeout,
    read_small_file,
    regular_file,
    run_process,
)
from harness.errors import EngineError, InvalidInput, NotComparable
from harness.model.gguf_model import GGUFModel, Override, Qwen35HParams
from harness.rundir import scratch_dir

REQUEST_SCHEMA = "harness-engine-request/v1"
SPEC_KEYS = ("command", "timeout_s", "capabilities", "cwd", "env", "compute_class")
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
    ``f16``, ``mixed``), which picks its calibrated gates (its ``info.json`` may state it instead).
    """

    name: str
    command: list[str]
    timeout_s: float = 600.0
    capabilities: list[str] = field(default_factory=list)
    cwd: Path | None = None
    env: dict[str, str] = field(default_factory=dict)
    compute_class: str | None = None


def _spec(name: str, t: Any, cfg: HarnessConfig) -> CommandSpec:
    """One engine table, validated; ``InvalidInput`` names the engine and the field."""
    where = f"{cfg.source}: engines.{name}"
    if not isinstance(t, dict):
        raise InvalidInput(f"{where} must be a table")
    unknown = [k for k in t if k not in SPEC_KEYS]
    if unknown:
        raise InvalidInput(f"{where}: unknown key {unknown[0]!r}; known: {', '.join(SPEC_KEYS)}")
    cmd = t.get("command")
    if not isinstance(cmd, list) or not cmd or not all(isinstance(a, str) and "\x00" not in a for a in cmd):
        raise InvalidInput(f"{where}.command must be a non-empty list of strings without NUL (no shell)")
    timeout = check_timeout(t.get("timeout_s", 600), f"{where}.timeout_s")
    caps = t.get("capabilities", [])
    if not isinstance(caps, list) or not all(isinstance(c, str) for c in caps):
        raise InvalidInput(f"{where}.capabilities must be a list of strings")
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
    return CommandSpec(name, list(cmd), timeout, list(caps), cwd, {str(k): str(v) for k, v in env.items()}, cls)


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
        info = json.loads(raw.decode("utf-8"), parse_constant=_refuse_constant)
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


def load_logits(out_dir: Path, who: str, n_tokens: int, n_vocab: int, stderr_tail: str = "") -> np.ndarray:
    """``out_dir/logits.npy`` memory-mapped (float32 ``[n_tokens, n_vocab]``).

    Raises ``EngineError`` (missing, not a regular file, unreadable, pickled, wrong dtype or
    shape) and ``NotComparable`` (a column count other than ``n_vocab``).
    """
    path = out_dir / "logits.npy"
    try:
        st = regular_file(path, who)
    except EngineError as e:
        raise EngineError(str(e), stderr_tail) from None
    if st is None:
        raise EngineError(f"{who} wrote no logits.npy", stderr_tail)
    try:
        arr = np.load(path, mmap_mode="r", allow_pickle=False)
    except (ValueError, OSError, EOFError) as e:
        raise EngineError(f"{who} wrote an unreadable logits.npy ({str(e).splitlines()[0] if str(e) else type(e).__name__})", stderr_tail) from None
    if not isinstance(arr, np.ndarray):
        raise EngineError(f"{who} wrote a logits.npy that is not one array", stderr_tail)
    if arr.dtype != np.float32:
        raise EngineError(f"{who} wrote logits of dtype {arr.dtype}; the protocol requires float32", stderr_tail)
    if arr.ndim != 2 or arr.shape[0] != n_tokens:
        raise EngineError(f"{who} wrote logits of shape {arr.shape}; expected [{n_tokens}, V]", stderr_tail)
    if arr.shape[1] != n_vocab:
        raise NotComparable(f"{who} logits have {arr.shape[1]} columns but the model's vocab has {n_vocab}")
    return arr


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
    path = out_dir / "activations.npz"
    try:
        st = regular_file(path, who)
    except EngineError as e:
        raise EngineError(str(e), stderr_tail) from None
    if st is None:
        raise EngineError(f"{who} wrote no activations.npz", stderr_tail)
    try:
        with zipfile.ZipFile(path) as zf:
            total = sum(i.file_size for i in zf.infolist())
        if total > max_bytes:
            raise EngineError(f"{who} wrote an activations.npz holding {total:,} bytes; at most {max_bytes:,} for {n_tokens} positions", stderr_tail)
        with np.load(path, allow_pickle=False) as z:
            return {k: np.array(z[k]) for k in z.files}
    except (ValueError, OSError, EOFError, zipfile.BadZipFile, zipfile.LargeZipFile, NotImplementedError) as e:
        raise EngineError(f"{who} wrote an unreadable activations.npz ({str(e).splitlines()[0] if str(e) else type(e).__name__})", stderr_tail) from None


class CommandEngine:
    """An engine run as an external command per request (see module docstring)."""

    def __init__(self, spec: CommandSpec, model_path: str | os.PathLike, overrides: Sequence[Override] = (), block_size: int = 256):
        self.spec = spec
        self.model_path = Path(model_path).resolve()
        self.overrides = list(overrides)
        self.block_size = block_size
        self._last_info: dict[str, Any] = {}

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
        reported = self._last_info
        return EngineInfo(
            name=self.who,
            version=str(reported.get("version", "unknown")),
            settings={"command": self.spec.command, "timeout_s": self.spec.timeout_s, "reported": reported.get("settings", {}),
                      "overrides": [o.to_flag() for o in self.overrides]},
            capabilities=list(self.spec.capabilities),
            build={"reported_name": reported.get("name")},
            compute_class=reported.get("compute_class") or self.spec.compute_class,
        )

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
        values = {"{request}": str(req_path), "{out_dir}": str(out_dir), "{model}": str(self.model_path), "{python}": sys.executable}
        argv = [_substitute(a, values) for a in self.spec.command]
        if self.spec.cwd is not None and not self.spec.cwd.is_dir():
            raise InvalidInput(f"{self.who}: cwd {self.spec.cwd} is not a directory")
        try:
            res = run_process(argv, timeout_s=self.spec.timeout_s, workdir=workdir, cwd=self.spec.cwd, env={**os.environ, **self.spec.env})
        except FileNotFoundError:
            raise EngineError(f"{self.who}: program {argv[0]!r} not found") from None
        except PermissionError:
            raise EngineError(f"{self.who}: program {argv[0]!r} is not executable") from None
        except OSError as e:
            raise EngineError(f"{self.who}: program {argv[0]!r} cannot be started ({e.strerror or e})") from None
        if res.returncode is None:
            raise EngineError(f"{self.who} timed out after {self.spec.timeout_s:g} s", res.tail)
        if res.returncode != 0:
            rc = res.returncode
            try:
                what = f"died with {signal.Signals(-rc).name}" if rc < 0 else f"exited {rc}"
            except ValueError:
                what = f"died with signal {-rc}"
            raise EngineError(f"{self.who} {what}", res.tail)
        self._last_info = load_info(out_dir, self.who, res.tail)
        return out_dir, res.tail

    def logits(self, tokens: Sequence[int], chunks: Sequence[int] | None = None) -> Iterator[LogitBlock]:
        tokens = [int(t) for t in tokens]
        pieces = validate_chunks(len(tokens), chunks) if chunks is not None else None
        if pieces is not None and "chunks" not in self.spec.capabilities:
            raise EngineError(f"{self.who} does not declare the 'chunks' capability")
        with scratch_dir("cmd-") as d:
            out_dir, tail = self._run(tokens, pieces, ["logits"], d)
            arr = load_logits(out_dir, self.who, len(tokens), self.n_vocab, tail)
            for start in range(0, len(tokens), self.block_size):
                yield start, npy_rows(arr, start, start + self.block_size)
            del arr

    def activations(self, tokens: Sequence[int], chunks: Sequence[int] | None = None) -> dict[str, np.ndarray]:
        """Named activations ``{name: [T, ...]}`` from ``activations.npz`` (capability ``activations``)."""
        if "activations" not in self.spec.capabilities:
            raise EngineError(f"{self.who} does not declare the 'activations' capability")
        tokens = [int(t) for t in tokens]
        pieces = validate_chunks(len(tokens), chunks) if chunks is not None else None
        with scratch_dir("cmd-") as d:
            out_dir, tail = self._run(tokens, pieces, ["logits", "activations"], d)
            return load_activations(out_dir, self.who, len(tokens), activation_bytes_cap(self._hparams, len(tokens)), tail)


def load_command_engine(name: str, model_path: str | os.PathLike, overrides: Sequence[Override] = ()) -> CommandEngine:
    """The configured command engine ``name`` bound to ``model_path``.

    Raises ``InvalidInput`` when no such engine is configured (naming the configured ones).
    """
    cfg = load_config()
    specs = configured_commands(cfg)
    if name not in specs:
        known = ", ".join(f"command:{n}" for n in specs) or "none"
        where = cfg.source or "no pyproject.toml or $HARNESS_CONFIG found"
        raise InvalidInput(f"no command engine {name!r} configured in [tool.harness.engines] ({where}); configured: {known}")
    return CommandEngine(specs[name], model_path, overrides)
