"""llama-cpp-python's OpenAI-compatible server (``python -m llama_cpp.server``, the ``server`` extra)
as a real server the harness starts: on a free loopback port, one thread, waiting for
``/v1/models``, stopped with its process group.

How it is started (llama-cpp-python 0.3.x ``llama_cpp/server/settings.py``): ``--model PATH
--model_alias ALIAS --host 127.0.0.1 --port PORT --n_threads 1 --n_threads_batch 1 --n_ctx N
--verbose false``, plus ``--chat_format NAME`` where a chat handler is named. Without one,
``Llama.__init__`` picks the handler from the GGUF: a format ``guess_chat_format_from_gguf_metadata``
recognises in ``tokenizer.chat_template``, else the template itself (``chat_template.default``, a
``Jinja2ChatFormatter``); ``chat_handler`` below names the handler the same way, so a receipt says
which one answered.

Errors: ``EngineError`` (one line: the command and the tail of its stderr) for a server that exits
before it answers or does not answer within ``health_timeout_s``. ``missing()`` says why the server
cannot be started at all (the package or its server extra absent), for a run to record UNMEASURED.
"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from harness.display import plain
from harness.errors import EngineError
from harness.engines.llama_server import _die_with_parent, free_port

NAME = "llama-cpp-python"
INSTALL = "pip install 'llama-cpp-python[server]'"
"""What installs the server (named by every 'missing' reason)."""


def version() -> str | None:
    """The installed llama-cpp-python's version (its distribution metadata), None when absent."""
    from importlib import metadata

    try:
        return metadata.version("llama-cpp-python")
    except metadata.PackageNotFoundError:
        return None


def missing() -> str | None:
    """Why the server cannot be started here (the package or a module of its ``server`` extra is
    not importable), or None. Imports nothing heavy: ``importlib.util.find_spec`` only."""
    import importlib.util

    if version() is None:
        return f"llama-cpp-python is not installed ({INSTALL})"
    for mod in ("llama_cpp.server", "fastapi", "uvicorn", "sse_starlette", "starlette_context", "pydantic_settings"):
        try:
            found = importlib.util.find_spec(mod) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            return f"llama-cpp-python's server extra is not installed: no module {mod!r} ({INSTALL})"
    return None


def chat_handler(metadata: Mapping[str, Any], chat_format: str | None) -> str:
    """The chat handler the server answers with for a GGUF of ``metadata`` (its raw key values):
    ``chat_format`` where one is named; else the format llama-cpp-python guesses from the file's
    ``tokenizer.chat_template`` (``llama_chat_format.guess_chat_format_from_gguf_metadata``), else
    ``chat_template.default`` (the template itself); ``llama-2`` for a file without a template
    (``Llama.__init__``'s order)."""
    if chat_format:
        return chat_format
    if not isinstance(metadata.get("tokenizer.chat_template"), str):
        return "llama-2"
    from llama_cpp import llama_chat_format

    guessed = llama_chat_format.guess_chat_format_from_gguf_metadata({k: str(v) for k, v in metadata.items() if isinstance(v, str)})
    return guessed or "chat_template.default"


@dataclass
class LlamaCppPythonServer:
    """One ``python -m llama_cpp.server`` process (module docstring). ``start()`` then ``url``;
    ``close()`` stops it (SIGTERM to its process group, SIGKILL after ``stop_timeout_s``)."""

    model: Path
    alias: str = "model"
    chat_format: str | None = None
    n_ctx: int = 2048
    health_timeout_s: float = 120.0
    stop_timeout_s: float = 10.0
    port: int | None = None
    proc: subprocess.Popen[bytes] | None = field(default=None, repr=False)
    _log: Any = field(default=None, repr=False)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        """The command line (this Python's interpreter, so the server is the installed package's)."""
        return [sys.executable, "-m", "llama_cpp.server", "--model", str(self.model), "--model_alias", self.alias,
                "--host", "127.0.0.1", "--port", str(self.port), "--n_threads", "1", "--n_threads_batch", "1",
                "--n_ctx", str(self.n_ctx), "--verbose", "false", *(["--chat_format", self.chat_format] if self.chat_format else [])]

    def _tail(self) -> str:
        if self._log is None:
            return "(no output)"
        self._log.flush()
        lines = [ln.strip() for ln in Path(self._log.name).read_text(errors="replace").splitlines() if ln.strip()]
        return plain(" | ".join(lines[-3:]))[:400] or "(no output)"

    def start(self) -> "LlamaCppPythonServer":
        """Start it and wait until ``/v1/models`` answers 200 (``EngineError`` for an exit before
        that or no answer within ``health_timeout_s``)."""
        import httpx

        self.port = self.port or free_port()
        self._log = tempfile.NamedTemporaryFile(prefix="llama-cpp-python-server-", suffix=".log", delete=False)
        self.proc = subprocess.Popen(self.command(), stdin=subprocess.DEVNULL, stdout=self._log, stderr=subprocess.STDOUT,
                                     start_new_session=True, preexec_fn=_die_with_parent)
        deadline = time.monotonic() + self.health_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise self._fail(f"exited with status {self.proc.returncode} before it answered")
            try:
                if httpx.get(self.url + "/v1/models", timeout=2.0).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise self._fail(f"did not answer within {self.health_timeout_s:g} s")

    def _fail(self, why: str) -> EngineError:
        cmd, tail = shlex.join(self.command()), self._tail()
        self.close()
        return EngineError(f"llama-cpp-python's server {why}: {cmd[:300]}; stderr: {tail}")

    def stop(self) -> None:
        """SIGTERM to its process group, SIGKILL after ``stop_timeout_s``; idempotent."""
        p, self.proc = self.proc, None
        if p is None or p.poll() is not None:
            return
        for sig, wait in ((signal.SIGTERM, self.stop_timeout_s), (signal.SIGKILL, 5.0)):
            try:
                os.killpg(p.pid, sig)
            except ProcessLookupError:
                return
            try:
                p.wait(timeout=wait)
                return
            except subprocess.TimeoutExpired:
                continue

    def close(self) -> None:
        """``stop()`` and remove the log file."""
        self.stop()
        if self._log is not None:
            self._log.close()
            Path(self._log.name).unlink(missing_ok=True)
            self._log = None

    def __enter__(self) -> "LlamaCppPythonServer":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
