"""Running engine processes and reading what they leave, with every resource bounded.

- Time: ``check_timeout`` accepts only finite, positive timeouts; ``run_process`` waits at most
  that long.
- Leftovers: nothing an engine starts outlives it. ``start_engine`` runs the engine under a
  small supervisor (``harness/engines/_reaper.py``) in a new session: a child subreaper
  (``prctl(PR_SET_CHILD_SUBREAPER)``) that, once the engine has exited or the harness ends it,
  SIGKILLs and reaps every descendant, including those that called ``setsid()`` and those that
  double-forked, and only then exits. ``kill_group`` ends an engine on every exit path —
  success, failure, timeout, an exception or Ctrl-C in the harness — by closing the
  supervisor's lifeline pipe (end of file: kill everything), waiting for it, then SIGKILLing the
  process group as well. A harness that is itself SIGKILLed closes the lifeline too. Engines
  work in a ``harness.rundir.scratch_dir`` (one per-run temporary directory, removed at exit).
- Memory: an engine's stderr goes to a file the harness opened; only its last
  ``STDERR_TAIL_BYTES`` are ever read back (``read_tail``), whatever the engine wrote.
- Hangs: ``regular_file`` refuses an output that is not a regular file (a FIFO would block the
  reader forever; a socket, directory or a symlink to a device is no output either) before it is
  opened, and opens with ``O_NONBLOCK``.
"""

from __future__ import annotations

import errno
import math
import os
import signal
import stat
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

from harness.errors import EngineError, InvalidInput

STDERR_TAIL_BYTES = 64 * 1024
"""At most this much of an engine's stderr is read back (the end of it)."""
TAIL_LINES = 8
TAIL_LINE_CHARS = 400
MAX_TIMEOUT_S = 7 * 24 * 3600.0
"""A timeout longer than a week is taken as a mistake (``check_timeout``)."""
REAPER = Path(__file__).with_name("_reaper.py")
"""The supervisor every engine process runs under (``start_engine``)."""
REAPER_FLAGS = ("-I", "-S") if sys.platform.startswith("linux") else ("-I",)
"""Python flags of the supervisor: isolated, and on Linux without ``site`` (its start is then
the interpreter's alone; it needs only the standard library there, psutil elsewhere)."""
REAPER_WAIT_S = 10.0
"""How long ``kill_group`` waits for the supervisor to kill and reap the engine's descendants
before it SIGKILLs the process group itself."""



# ------------------------------------------------------------------------------ timeouts


def check_timeout(value: Any, where: str) -> float:
    """``value`` as seconds, refused with ``InvalidInput`` unless a finite number in
    (0, ``MAX_TIMEOUT_S``] (TOML allows ``inf`` and ``nan``; a bool is not a number here)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or not 0 < value <= MAX_TIMEOUT_S:
        raise InvalidInput(f"{where} must be a finite number of seconds in (0, {MAX_TIMEOUT_S:g}], found {value!r}")
    return float(value)


# ------------------------------------------------------------------------------ running


@dataclass
class ProcessResult:
    """How an engine process ended: ``returncode`` (negative: killed by that signal; None: it
    ran past its timeout and was killed) and the last lines of its stderr (``tail``, at most
    ``TAIL_LINES`` lines, raw: escape before showing) and the last ``STDERR_TAIL_BYTES`` of it
    (``stderr_end``)."""

    returncode: int | None
    tail: str
    stderr_end: str


def exit_status(rc: int) -> str:
    """How a process that did not exit 0 ended, for an error line: ``died with SIGABRT``
    (``rc`` < 0: killed by that signal, named where Python knows it, else ``died with signal
    N``) or ``exited N``."""
    if rc >= 0:
        return f"exited {rc}"
    try:
        return f"died with {signal.Signals(-rc).name}"
    except ValueError:
        return f"died with signal {-rc}"


def start_error(who: str, program: str, e: OSError) -> EngineError:
    """The one-line ENGINE-ERROR for an engine program that could not be started (``Popen``
    raised ``e``): not found, not executable, or the OS's reason."""
    if isinstance(e, FileNotFoundError):
        return EngineError(f"{who}: program {program!r} not found")
    if isinstance(e, PermissionError):
        return EngineError(f"{who}: program {program!r} is not executable")
    return EngineError(f"{who}: program {program!r} cannot be started ({e.strerror or e})")


def start_engine(argv: Sequence[str], *, stdin: Any, stdout: Any, stderr: Any, cwd: str | os.PathLike | None = None,
                 env: Mapping[str, str] | None = None) -> subprocess.Popen:
    """Start ``argv`` (no shell) under the supervisor ``_reaper.py`` in a new session, with the
    given stdin/stdout/stderr (``subprocess.Popen`` values), working directory and environment;
    returns the supervisor's ``Popen`` once the engine program has been exec'd. End it with
    ``kill_group``; its ``returncode`` is the engine's (exit code, or minus the signal).

    Raises ``FileNotFoundError`` / ``PermissionError`` (or another ``OSError``) when the program
    cannot be started, as ``Popen`` would (the caller names the engine).
    """
    status_r, status_w = os.pipe()
    life_r, life_w = os.pipe()
    try:
        proc = subprocess.Popen([sys.executable, *REAPER_FLAGS, str(REAPER), str(status_w), str(life_r), *argv], stdin=stdin, stdout=stdout,
                                stderr=stderr, cwd=cwd, env=dict(env) if env is not None else None, start_new_session=True,
                                pass_fds=(status_w, life_r))
    except BaseException:
        for fd in (status_r, status_w, life_r, life_w):
            os.close(fd)
        raise
    os.close(status_w)
    os.close(life_r)
    proc._harness_lifeline = life_w  # type: ignore[attr-defined]
    with os.fdopen(status_r, "rb") as f:
        status = f.readline().strip()
    if status != b"ok":
        kill_group(proc)
        code = int(status[4:]) if status.startswith(b"err ") and status[4:].isdigit() else errno.ECHILD
        raise OSError(code, os.strerror(code), argv[0])
    return proc


def kill_group(proc: subprocess.Popen) -> None:
    """End the engine ``proc`` and everything it started (``start_engine``): close the
    supervisor's lifeline, wait up to ``REAPER_WAIT_S`` for it to kill and reap the
    descendants, then SIGKILL ``proc``'s process group (it was started in a new session) and
    reap ``proc``. Safe to call twice."""
    life = getattr(proc, "_harness_lifeline", None)
    if life is not None:
        proc._harness_lifeline = None  # type: ignore[attr-defined]
        os.close(life)
        try:
            proc.wait(timeout=REAPER_WAIT_S)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    if proc.poll() is None:
        try:
            proc.kill()
        except ProcessLookupError:
            pass
        proc.wait()


def read_tail(f: Any, max_bytes: int = STDERR_TAIL_BYTES) -> str:
    """The last ``max_bytes`` of the open binary file ``f`` as text (invalid UTF-8 replaced; a
    line cut at the start dropped). Reads at most ``max_bytes``, whatever the file's size."""
    try:
        size = os.fstat(f.fileno()).st_size
        start = max(0, size - max_bytes)
        f.seek(start)
        data = f.read(max_bytes)
    except (OSError, ValueError):
        return ""
    text = data.decode("utf-8", errors="replace")
    if start > 0 and "\n" in text:
        text = text.split("\n", 1)[1]
    return text


def tail_lines(text: str, n: int = TAIL_LINES) -> str:
    """The last ``n`` non-empty lines of ``text``, each cut at ``TAIL_LINE_CHARS`` characters."""
    out = [ln if len(ln) <= TAIL_LINE_CHARS else ln[:TAIL_LINE_CHARS] + "…" for ln in text.strip().splitlines()[-n:]]
    return "\n".join(out)


def run_process(argv: Sequence[str], *, timeout_s: float, workdir: Path, cwd: str | os.PathLike | None = None,
                env: Mapping[str, str] | None = None) -> ProcessResult:
    """Run ``argv`` (no shell) with stdin closed and stdout+stderr into ``workdir/stderr.txt``,
    under the supervisor (``start_engine``); wait at most ``timeout_s``; end it and everything
    it started on every exit path (``kill_group``).

    Raises ``FileNotFoundError`` / ``PermissionError`` when the program cannot be started (the
    caller names the engine); never leaves a process the engine started running.
    """
    with open(workdir / "stderr.txt", "w+b") as err:
        proc = start_engine(argv, stdin=subprocess.DEVNULL, stdout=err, stderr=err, cwd=cwd, env=env)
        rc: int | None
        try:
            rc = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            rc = None
        finally:
            kill_group(proc)
        end = read_tail(err)
    return ProcessResult(rc, tail_lines(end), end)


# ------------------------------------------------------------------------------ reading outputs


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"), (stat.S_ISDIR, "a directory"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"), (stat.S_ISLNK, "a symbolic link")):
        if test(mode):
            return name
    return "not a regular file"


def regular_file(path: Path, who: str, max_bytes: int | None = None) -> os.stat_result | None:
    """The ``os.stat`` of an engine's output ``path``, or None when there is none.

    Raises ``EngineError`` naming ``who`` when the path (after symlinks) is not a regular file
    — a FIFO, socket, directory, device, or a dangling link — or, with ``max_bytes``, is larger.
    """
    try:
        st = os.stat(path)
    except FileNotFoundError:
        if os.path.lexists(path):
            raise EngineError(f"{who} wrote {path.name} as a dangling symbolic link") from None
        return None
    except OSError as e:
        raise EngineError(f"{who} wrote an unreadable {path.name} ({e.strerror or e})") from None
    if not stat.S_ISREG(st.st_mode):
        raise EngineError(f"{who} wrote {path.name} as {_kind(st.st_mode)}; outputs must be regular files")
    if max_bytes is not None and st.st_size > max_bytes:
        raise EngineError(f"{who} wrote a {path.name} of {st.st_size:,} bytes; at most {max_bytes:,} are read")
    return st


def read_small_file(path: Path, who: str, max_bytes: int) -> bytes | None:
    """The bytes of a small engine output (at most ``max_bytes``), or None when absent; opened
    with ``O_NONBLOCK`` after ``regular_file``, and checked again on the open descriptor."""
    if regular_file(path, who, max_bytes) is None:
        return None
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOCTTY", 0))
    except OSError as e:
        raise EngineError(f"{who} wrote an unreadable {path.name} ({e.strerror or e})") from None
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise EngineError(f"{who} replaced {path.name} while it was read")
        return f.read(max_bytes + 1)[:max_bytes]
