"""Run one engine program so that nothing it starts outlives it (``harness.engines.process``).

    python -I _reaper.py STATUS_FD LIFELINE_FD PROGRAM [ARG...]

Started by ``harness.engines.process.start_engine`` in a new session, in the engine's working
directory and environment, with the engine's stdin, stdout and stderr. It:

1. makes itself a child subreaper (Linux ``prctl(PR_SET_CHILD_SUBREAPER)``, see prctl(2)), so
   every process the engine starts that loses its parent, including one that called
   ``setsid()`` and one that double-forked (a daemon's usual way), is re-parented to it rather
   than to init;
2. forks and execs PROGRAM (``execvp``: a bare name is looked up in ``PATH``, a relative path
   against the working directory, as ``subprocess.Popen`` does), and writes ``ok`` or
   ``err ERRNO`` to STATUS_FD once the exec succeeded or failed;
3. waits until the engine exits, LIFELINE_FD reaches end of file (the harness closed its end,
   or died), or it gets SIGTERM, SIGINT or SIGHUP;
4. kills every descendant (SIGKILL) and reaps them, round after round, until it has no child
   left: as a subreaper, no child left means no descendant left, and killing its children is
   enough (their children come to it next);
5. exits as the engine did: the same exit code, or killed by the same signal (killed by
   SIGKILL when the harness ended the engine first).

Where there is no subreaper (not Linux), step 4 walks the process tree with psutil first and
kills every descendant whose parent is alive; a double-forked process re-parented to init is out
of reach there.

This file imports nothing from the harness (it starts in milliseconds); psutil is imported only
where there is no subreaper.
"""

from __future__ import annotations

import ctypes
import os
import select
import signal
import sys
import time

PR_SET_CHILD_SUBREAPER = 36
"""prctl(2) option number (linux/prctl.h)."""


def _become_subreaper() -> bool:
    """``prctl(PR_SET_CHILD_SUBREAPER, 1)``; False where it is not available."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return int(libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)) == 0
    except (OSError, AttributeError):
        return False


def _reap() -> tuple[list[tuple[int, int]], bool]:
    """``(pid, wait status)`` of every child that has ended, and whether any child is left."""
    out = []
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return out, False
        if pid == 0:
            return out, True
        out.append((pid, status))


def _direct_children() -> list[int] | None:
    """This process's children (Linux ``/proc/self/task/TID/children``; this process has one
    thread), or None where that file cannot be read."""
    try:
        with open(f"/proc/self/task/{os.getpid()}/children") as f:
            return [int(x) for x in f.read().split()]
    except (OSError, ValueError):
        return None


def _tree() -> list[int]:
    """Every descendant of this process (psutil walks the process table)."""
    import psutil

    try:
        return [p.pid for p in psutil.Process().children(recursive=True)]
    except psutil.Error:
        return []


def kill_descendants(subreaper: bool) -> None:
    """SIGKILL every descendant and reap, until no child is left (see module docstring). As a
    subreaper, killing the children is enough: theirs are re-parented here and killed in the
    next round (no walk of the process table, and nothing at all to do when no child is left);
    otherwise the whole tree is walked first (psutil), before its parents die."""
    while True:
        if not _reap()[1]:
            return
        kids = _direct_children() if subreaper else None
        for pid in kids if kids is not None else _tree():
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        time.sleep(0.001)


def _exec_child(argv: list[str], errw: int, close: tuple[int, ...]) -> None:
    """In the forked child: the reaper's own descriptors ``close``d, default signal dispositions
    (as ``Popen(restore_signals=True)``), then exec ``argv``; on failure write the errno to
    ``errw`` and exit 127."""
    try:
        for fd in close:
            os.close(fd)
        for name in ("SIGPIPE", "SIGXFSZ", "SIGXFZ", "SIGTERM", "SIGINT", "SIGHUP", "SIGCHLD"):
            if hasattr(signal, name):
                signal.signal(getattr(signal, name), signal.SIG_DFL)
        os.execvp(argv[0], argv)
    except OSError as e:
        os.write(errw, str(e.errno or 0).encode())
    finally:
        os._exit(127)


def main(args: list[str]) -> int:
    """Run the engine (module docstring); returns the exit code when the engine exited."""
    status_fd, life_fd, argv = int(args[0]), int(args[1]), args[2:]
    subreaper = _become_subreaper()
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    stop: list[int] = []
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, lambda s, f: stop.append(s))
    signal.signal(signal.SIGCHLD, lambda s, f: None)
    errr, errw = os.pipe()
    engine = os.fork()
    if engine == 0:
        os.close(errr)
        _exec_child(argv, errw, (status_fd, life_fd))
    os.close(errw)
    failed = b""
    while True:
        try:
            chunk = os.read(errr, 64)
        except InterruptedError:
            continue
        if not chunk:
            break
        failed += chunk
    os.close(errr)
    os.write(status_fd, b"err " + failed + b"\n" if failed else b"ok\n")
    os.close(status_fd)
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1):  # only the engine holds its stdin and stdout: its end is their end
        os.dup2(null, fd)
    status: int | None = None
    while status is None and not stop:
        ended, left = _reap()
        for pid, st in ended:
            if pid == engine:
                status = st
        if status is not None or not left:
            break
        try:
            ready = select.select([wake_r, life_fd], [], [])[0]
        except InterruptedError:
            continue
        if life_fd in ready and not os.read(life_fd, 1):
            break
        if wake_r in ready:
            os.read(wake_r, 4096)
    kill_descendants(subreaper)
    if status is None:
        status = 0x09  # killed before it ended: as SIGKILL
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        if sig not in (signal.SIGKILL, signal.SIGSTOP):
            signal.signal(sig, signal.SIG_DFL)
        signal.set_wakeup_fd(-1)
        os.kill(os.getpid(), sig)
        time.sleep(1)  # a signal whose default is not to end the process: end anyway below
        return 128 + sig
    return os.waitstatus_to_exitcode(status)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
