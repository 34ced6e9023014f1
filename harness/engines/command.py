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
Outputs are read with ``np.load(allow_pickle=False)``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any, Iterator, Sequence

import numpy as np

from harness.config import HarnessConfig, load_config
from harness.engines.base import EngineInfo, LogitBlock, npy_rows, validate_chunks
from harness.errors import EngineError, InvalidInput, NotComparable
from harness.model.gguf_model import GGUFModel, Override

REQUEST_SCHEMA = "harness-engine-request/v1"


@dataclass
class CommandSpec:
    """One ``[tool.harness.engines.NAME]`` table.

    ``command``: argument list with placeholders; ``timeout_s``: wall-clock limit per request;
    ``capabilities``: protocol features the engine supports (``chunks``, ``activations``);
    ``cwd``: working directory (default: the config file's directory); ``env``: extra variables.
    """

    name: str
    command: list[str]
    timeout_s: float = 600.0
    capabilities: list[str] = field(default_factory=list)
    cwd: Path | None = None
    env: dict[str, str] = field(default_factory=dict)


def configured_commands(config: HarnessConfig | None = None) -> dict[str, CommandSpec]:
    """Every command engine in the configuration, validated.

    Raises ``InvalidInput`` naming the engine and field for a malformed table.
    """
    cfg = config or load_config()
    engines = cfg.get("engines", {}) or {}
    out = {}
    for name, t in engines.items():
        where = f"{cfg.source}: engines.{name}"
        if not isinstance(t, dict):
            raise InvalidInput(f"{where} must be a table")
        cmd = t.get("command")
        if not isinstance(cmd, list) or not cmd or not all(isinstance(a, str) for a in cmd):
            raise InvalidInput(f"{where}.command must be a non-empty list of strings (no shell)")
        timeout = t.get("timeout_s", 600)
        if not isinstance(timeout, (int, float)) or timeout <= 0:
            raise InvalidInput(f"{where}.timeout_s must be a positive number")
        caps = t.get("capabilities", [])
        if not isinstance(caps, list) or not all(isinstance(c, str) for c in caps):
            raise InvalidInput(f"{where}.capabilities must be a list of strings")
        cwd = Path(t["cwd"]) if "cwd" in t else cfg.base_dir
        if not cwd.is_absolute():
            cwd = cfg.base_dir / cwd
        env = {str(k): str(v) for k, v in (t.get("env") or {}).items()}
        out[name] = CommandSpec(name, list(cmd), float(timeout), list(caps), cwd, env)
    return out


def _substitute(arg: str, values: dict[str, str]) -> str:
    """Replace a placeholder argument; placeholders only ever stand as a whole argument."""
    return values.get(arg, arg)


def _tail(path: Path, n: int = 8) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return ""
    return "\n".join(text.strip().splitlines()[-n:])


class CommandEngine:
    """An engine run as an external command per request (see module docstring)."""

    def __init__(self, spec: CommandSpec, model_path: str | os.PathLike, overrides: Sequence[Override] = (), block_size: int = 256):
        self.spec = spec
        self.model_path = Path(model_path).resolve()
        self.overrides = list(overrides)
        self.block_size = block_size
        self._last_info: dict[str, Any] = {}

    @cached_property
    def n_vocab(self) -> int:
        return GGUFModel(self.model_path, self.overrides).hparams.n_vocab

    @property
    def info(self) -> EngineInfo:
        reported = self._last_info
        return EngineInfo(
            name=f"command:{self.spec.name}",
            version=str(reported.get("version", "unknown")),
            settings={"command": self.spec.command, "timeout_s": self.spec.timeout_s, "reported": reported.get("settings", {}),
                      "overrides": [o.to_flag() for o in self.overrides]},
            capabilities=list(self.spec.capabilities),
            build={"reported_name": reported.get("name")},
        )

    def _run(self, tokens: list[int], chunks: list[int] | None, want: list[str], workdir: Path) -> Path:
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
        err_path = workdir / "stderr.txt"
        env = {**os.environ, **self.spec.env}
        try:
            with open(err_path, "wb") as err:
                proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=err, stderr=err, cwd=self.spec.cwd, env=env,
                                        start_new_session=True)
                try:
                    rc = proc.wait(timeout=self.spec.timeout_s)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
                    raise EngineError(f"command:{self.spec.name} timed out after {self.spec.timeout_s:g} s", _tail(err_path)) from None
        except FileNotFoundError:
            raise EngineError(f"command:{self.spec.name}: program {argv[0]!r} not found") from None
        except PermissionError:
            raise EngineError(f"command:{self.spec.name}: program {argv[0]!r} is not executable") from None
        if rc != 0:
            what = f"died with {signal.Signals(-rc).name}" if rc < 0 else f"exited {rc}"
            raise EngineError(f"command:{self.spec.name} {what}", _tail(err_path))
        info_path = out_dir / "info.json"
        if info_path.exists():
            try:
                info = json.loads(info_path.read_text())
                self._last_info = info if isinstance(info, dict) else {}
            except (OSError, json.JSONDecodeError):
                raise EngineError(f"command:{self.spec.name} wrote an unreadable info.json", _tail(err_path)) from None
        return out_dir

    def _load_logits(self, out_dir: Path, n_tokens: int, stderr_tail: str) -> np.ndarray:
        path = out_dir / "logits.npy"
        if not path.exists():
            raise EngineError(f"command:{self.spec.name} wrote no logits.npy", stderr_tail)
        try:
            arr = np.load(path, mmap_mode="r", allow_pickle=False)
        except (ValueError, OSError, EOFError) as e:
            raise EngineError(f"command:{self.spec.name} wrote an unreadable logits.npy ({str(e).splitlines()[0] if str(e) else type(e).__name__})", stderr_tail) from None
        if arr.dtype != np.float32:
            raise EngineError(f"command:{self.spec.name} wrote logits of dtype {arr.dtype}; the protocol requires float32")
        if arr.ndim != 2 or arr.shape[0] != n_tokens:
            raise EngineError(f"command:{self.spec.name} wrote logits of shape {arr.shape}; expected [{n_tokens}, V]")
        if arr.shape[1] != self.n_vocab:
            raise NotComparable(f"command:{self.spec.name} logits have {arr.shape[1]} columns but the model's vocab has {self.n_vocab}")
        return arr

    def logits(self, tokens: Sequence[int], chunks: Sequence[int] | None = None) -> Iterator[LogitBlock]:
        tokens = [int(t) for t in tokens]
        pieces = validate_chunks(len(tokens), chunks) if chunks is not None else None
        if pieces is not None and "chunks" not in self.spec.capabilities:
            raise EngineError(f"command:{self.spec.name} does not declare the 'chunks' capability")
        with tempfile.TemporaryDirectory(prefix="harness-cmd-") as d:
            out_dir = self._run(tokens, pieces, ["logits"], Path(d))
            arr = self._load_logits(out_dir, len(tokens), _tail(Path(d) / "stderr.txt"))
            for start in range(0, len(tokens), self.block_size):
                yield start, npy_rows(arr, start, start + self.block_size)
            del arr

    def activations(self, tokens: Sequence[int], chunks: Sequence[int] | None = None) -> dict[str, np.ndarray]:
        """Named activations ``{name: [T, ...]}`` from ``activations.npz`` (capability ``activations``)."""
        if "activations" not in self.spec.capabilities:
            raise EngineError(f"command:{self.spec.name} does not declare the 'activations' capability")
        tokens = [int(t) for t in tokens]
        pieces = validate_chunks(len(tokens), chunks) if chunks is not None else None
        with tempfile.TemporaryDirectory(prefix="harness-cmd-") as d:
            out_dir = self._run(tokens, pieces, ["logits", "activations"], Path(d))
            path = out_dir / "activations.npz"
            if not path.exists():
                raise EngineError(f"command:{self.spec.name} wrote no activations.npz", _tail(Path(d) / "stderr.txt"))
            try:
                with np.load(path, allow_pickle=False) as z:
                    return {k: np.array(z[k]) for k in z.files}
            except (ValueError, OSError, EOFError) as e:
                raise EngineError(f"command:{self.spec.name} wrote an unreadable activations.npz ({e})") from None


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
