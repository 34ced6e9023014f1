"""A long-lived engine process spoken to in JSON lines (command protocol 2; docs/engine-protocol.md).

The harness starts the engine once per (engine, model, overrides) and keeps it for the run
(``serve_for``): requests go to its stdin as one JSON object per line, each answered by one JSON
line on its stdout (``{"id", "ok", "files"}`` or ``{"id", "ok": false, "error"}``). Every
resource stays bounded, as for protocol 1 (``harness.engines.process``):

- Time: each request waits at most the engine's ``timeout_s`` for its reply line (the first also
  covers the model load); past it the process group is killed and the request is ``EngineError``.
- Memory: a reply line longer than ``REPLY_MAX_BYTES`` is refused; stderr goes to a file of
  which only the tail is read back.
- Leftovers: the engine runs under the supervisor of ``harness.engines.process.start_engine``
  in its own session; it and every process it started (``setsid()`` or double-forked ones too)
  are killed when the harness exits (``atexit``, and the CLI turns SIGTERM/SIGHUP into an exit),
  when it misbehaves, and by ``close_all``.

A process that died or was killed is started afresh on the next request; ``STARTS`` counts starts
per key, so a test can check that a whole run started the engine once.
"""

from __future__ import annotations

import atexit
import json
import os
import select
import subprocess
import time
from collections import Counter
from pathlib import Path
from typing import Any, Generator, Mapping, Sequence

from harness.engines.process import exit_status, kill_group, read_tail, start_engine, start_error, tail_lines
from harness.errors import EngineError
from harness.rundir import scratch_dir
from harness.validation import unique_keys

REPLY_MAX_BYTES = 1 << 20
"""A reply line longer than this (1 MiB) is refused: a reply names a few files."""

STARTS: Counter = Counter()
"""Engine processes started, per ``serve_for`` key (``(name, model, overrides)``)."""


class PersistentProcess:
    """One engine process (see module docstring). ``who`` names it in errors; ``argv``, ``cwd``,
    ``env`` start it. Not thread-safe: requests are strictly one at a time."""

    def __init__(self, who: str, argv: Sequence[str], cwd: str | os.PathLike | None, env: Mapping[str, str], key: Any):
        self.who, self.argv, self.cwd, self.env, self.key = who, list(argv), cwd, dict(env), key
        self.proc: subprocess.Popen | None = None
        self._scratch: Any = None
        self._dir: Path | None = None
        self._err: Any = None
        self._buf = b""
        self._next_id = 0
        self.last_info: dict[str, Any] = {}

    # -- lifetime ---------------------------------------------------------------------------
    def _start(self) -> None:
        self._scratch = scratch_dir("cmd2-")
        self._dir = self._scratch.__enter__()
        self._err = open(self._dir / "stderr.txt", "w+b")
        try:
            self.proc = start_engine(self.argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._err, cwd=self.cwd, env=self.env)
        except OSError as e:
            self.close()
            raise start_error(self.who, self.argv[0], e) from None
        STARTS[self.key] += 1
        self._buf = b""

    def start(self) -> None:
        """Start the process now if it is not running (a request would start it otherwise).
        Raises ``EngineError`` when it cannot be started."""
        if self.proc is None or self.proc.poll() is not None:
            self.close()
            self._start()

    def tail(self) -> str:
        """The last lines of the engine's stderr (raw: escape before showing)."""
        if self._err is None:
            return ""
        self._err.flush()
        return tail_lines(read_tail(self._err))

    def close(self) -> None:
        """Ask nothing, kill the process group, remove its files."""
        if self.proc is not None:
            kill_group(self.proc)
            for f in (self.proc.stdin, self.proc.stdout):
                try:
                    f.close()  # type: ignore[union-attr]
                except (OSError, AttributeError):
                    pass
            self.proc = None
        if self._err is not None:
            self._err.close()
            self._err = None
        if self._scratch is not None:
            self._scratch.__exit__(None, None, None)
            self._scratch = None

    def _fail(self, message: str) -> EngineError:
        """Kill the process and return the error (with its stderr tail) to raise."""
        tail = self.tail()
        rc = self.proc.poll() if self.proc is not None else None
        if rc is not None and rc != 0:
            message = f"{message} ({exit_status(rc)})"
        self.close()
        return EngineError(message, tail)

    # -- requests ---------------------------------------------------------------------------
    def out_dir(self) -> Path:
        """A fresh, empty directory for one request's outputs (inside the process's scratch)."""
        if self.proc is None or self.proc.poll() is not None:
            self.close()
            self._start()
        assert self._dir is not None
        self._next_id += 1
        d = self._dir / f"req-{self._next_id}"
        d.mkdir()
        return d

    def request(self, body: dict[str, Any], out_dir: Path, timeout_s: float) -> dict[str, Any]:
        """Send ``body`` (with ``id`` and ``out_dir`` added) and return the engine's reply object.

        Raises ``EngineError`` when the engine exits, times out, answers with something other than
        one JSON object for this id, or answers ``ok: false`` (its ``error`` quoted, the process
        kept)."""
        req_id = self._send(body, out_dir)
        return self._final(self._line_object(self._read_line(time.monotonic() + timeout_s, timeout_s), req_id), req_id)

    def request_blocks(self, body: dict[str, Any], out_dir: Path, timeout_s: float) -> Generator[dict[str, Any], None, dict[str, Any]]:
        """``request`` for a ``logits_ring`` request (``harness.engines.ring``): yields each block
        line's ``block`` object (``{"slot", "start", "rows"}``, not checked here) and, when the
        consumer asks for the next one, acknowledges that slot on the engine's stdin
        (``{"id", "ack": slot}``); returns the final reply. Each line waits at most ``timeout_s``.
        A consumer that stops before the final reply leaves the engine mid-request: the process
        is killed (the next request starts a fresh one). Raises as ``request``."""
        req_id = self._send(body, out_dir)
        done = False
        try:
            while True:
                obj = self._line_object(self._read_line(time.monotonic() + timeout_s, timeout_s), req_id)
                block = obj.get("block")
                if block is None:
                    done = True
                    return self._final(obj, req_id)
                if not isinstance(block, dict):
                    raise self._fail(f"{self.who} sent request {req_id} a 'block' that is not an object: {str(block)[:80]!r}")
                yield block
                self._write_line({"id": req_id, "ack": block.get("slot")}, req_id)
        finally:
            if not done and self.proc is not None:
                self.close()

    def _send(self, body: dict[str, Any], out_dir: Path) -> int:
        """Write one request line (``id`` and ``out_dir`` added); returns its id."""
        assert self.proc is not None and self.proc.stdin is not None
        req_id = self._next_id
        self._write_line({**body, "id": req_id, "out_dir": str(out_dir)}, req_id)
        return req_id

    def _write_line(self, obj: dict[str, Any], req_id: int) -> None:
        assert self.proc is not None and self.proc.stdin is not None
        try:
            self.proc.stdin.write((json.dumps(obj) + "\n").encode("utf-8"))
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            raise self._fail(f"{self.who} closed its stdin (the process ended during request {req_id})") from None

    def _line_object(self, raw: bytes, req_id: int) -> dict[str, Any]:
        """One reply line parsed: a JSON object carrying this request's ``id``, else the process
        is killed and ``EngineError`` raised."""
        try:
            reply = json.loads(raw.decode("utf-8"), object_pairs_hook=unique_keys)
        except (UnicodeDecodeError, ValueError, RecursionError) as e:
            why = f" ({e})" if "appears twice" in str(e) else ""
            raise self._fail(f"{self.who} answered request {req_id} with a line that is not JSON{why}: {raw[:80]!r}") from None
        if not isinstance(reply, dict) or type(reply.get("id")) is not int or reply["id"] != req_id:  # true == 1 in Python: not an id
            raise self._fail(f"{self.who} answered request {req_id} with {str(reply)[:80]!r}; expected a JSON object with \"id\": {req_id}")
        return reply

    def _final(self, reply: dict[str, Any], req_id: int) -> dict[str, Any]:
        """The request's final reply checked: ``ok`` true and ``files`` a list of names."""
        if reply.get("ok") is not True:
            err = reply.get("error")
            raise EngineError(f"{self.who} refused request {req_id}: {str(err)[:400] if err else 'ok is not true'}", self.tail())
        files = reply.get("files", [])
        if not isinstance(files, list) or not all(isinstance(f, str) for f in files):
            raise self._fail(f"{self.who} answered request {req_id} with 'files' that is not a list of names")
        return reply

    def _read_line(self, deadline: float, timeout_s: float) -> bytes:
        assert self.proc is not None and self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        while b"\n" not in self._buf:
            if len(self._buf) > REPLY_MAX_BYTES:
                raise self._fail(f"{self.who} wrote a reply line longer than {REPLY_MAX_BYTES:,} bytes")
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                raise self._fail(f"{self.who} timed out after {timeout_s:g} s")
            chunk = os.read(fd, 65536)
            if not chunk:
                try:
                    self.proc.wait(timeout=2)  # its exit status says why, when it is exiting
                except subprocess.TimeoutExpired:
                    pass
                raise self._fail(f"{self.who} closed its stdout before replying")
            self._buf += chunk
        line, _, self._buf = self._buf.partition(b"\n")
        if len(line) > REPLY_MAX_BYTES:
            raise self._fail(f"{self.who} wrote a reply line longer than {REPLY_MAX_BYTES:,} bytes")
        return line


_SERVERS: dict[Any, PersistentProcess] = {}


def serve_for(key: Any, who: str, argv: Sequence[str], cwd: str | os.PathLike | None, env: Mapping[str, str]) -> PersistentProcess:
    """The process for ``key`` (one per engine, model and overrides), made on first use; it
    starts on its first request."""
    p = _SERVERS.get(key)
    if p is None:
        p = _SERVERS[key] = PersistentProcess(who, argv, cwd, env, key)
    return p


def close_all() -> None:
    """Kill every engine process this harness started (registered with ``atexit``)."""
    for p in list(_SERVERS.values()):
        p.close()
    _SERVERS.clear()


atexit.register(close_all)
