"""One temporary directory per harness run, removed on every exit.

Everything temporary the harness makes (engine requests and outputs, worker files, pytest runs
of discharge) lives in ``scratch_dir``s inside ``run_dir()``: ``<tmp>/qwen35-harness-<uid>/
run-<pid>-XXXX``. It is removed at exit (``atexit``); the CLI turns SIGTERM and SIGHUP into a
normal exit (``termination_exits``) so that happens then too; and a run killed with
SIGKILL, which no process can catch, has its directory removed by the next run (``_sweep``:
directories whose process is gone).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import signal
import stat
import tempfile
import threading
from pathlib import Path
from typing import Any, Iterator

_RUN_DIR: Path | None = None
_LOCK = threading.Lock()


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists (one of another user counts as alive)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _base_dir() -> Path | None:
    """``<tmp>/qwen35-harness-<uid>``, created private; None when it exists but is not a
    directory owned by this user (then runs use plain temporary directories, nothing is swept)."""
    base = Path(tempfile.gettempdir()) / f"qwen35-harness-{os.geteuid()}"
    try:
        base.mkdir(mode=0o700, exist_ok=True)
        st = os.lstat(base)
    except OSError:
        return None
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
        return None
    return base


def _sweep(base: Path) -> None:
    """Remove the run directories of harness processes that are gone (killed with SIGKILL)."""
    for d in base.glob("run-*-*"):
        try:
            pid = int(d.name.split("-")[1])
        except (IndexError, ValueError):
            continue
        if pid != os.getpid() and not pid_alive(pid):
            shutil.rmtree(d, ignore_errors=True)


def _remove_run_dir() -> None:
    """atexit: remove this process's run directory (never a parent's, in a forked child)."""
    global _RUN_DIR
    if _RUN_DIR is not None and _RUN_DIR.name.startswith(f"run-{os.getpid()}-"):
        shutil.rmtree(_RUN_DIR, ignore_errors=True)
        _RUN_DIR = None


def run_dir() -> Path:
    """This process's temporary directory, created on first use and removed at exit (see module
    docstring). A forked child gets its own."""
    global _RUN_DIR
    with _LOCK:
        if _RUN_DIR is not None and _RUN_DIR.name.startswith(f"run-{os.getpid()}-") and _RUN_DIR.is_dir():
            return _RUN_DIR
        base = _base_dir()
        if base is not None:
            _sweep(base)
        _RUN_DIR = Path(tempfile.mkdtemp(prefix=f"run-{os.getpid()}-", dir=base))
        return _RUN_DIR


atexit.register(_remove_run_dir)


@contextlib.contextmanager
def scratch_dir(prefix: str) -> Iterator[Path]:
    """A fresh directory inside ``run_dir()``, removed when the block exits."""
    d = Path(tempfile.mkdtemp(prefix=prefix, dir=run_dir()))
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


@contextlib.contextmanager
def termination_exits() -> Iterator[None]:
    """Within the block, SIGTERM and SIGHUP raise ``SystemExit(128 + signal)`` (main thread
    only), so the ``finally`` blocks that kill engines and remove temporary files run when a run
    is stopped; the previous handlers are restored after it."""

    def handler(signum: int, frame: Any) -> None:
        raise SystemExit(128 + signum)

    previous = {}
    for sig in (signal.SIGTERM, signal.SIGHUP):
        try:
            previous[sig] = signal.signal(sig, handler)
        except (ValueError, OSError):  # not the main thread, or not settable here
            pass
    try:
        yield
    finally:
        for sig, h in previous.items():
            signal.signal(sig, h)
