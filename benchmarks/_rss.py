"""Peak RSS from ``/proc``: of this process (``self_peak_mb``) and of its children (``ChildPeakRSS``).

``ru_maxrss`` cannot be used for either: a process forked from a large parent is charged the
parent's resident pages until it execs, and ``ru_maxrss`` keeps that. ``VmHWM`` (the high-water
mark in ``/proc/PID/status``) belongs to the address space, which ``exec`` replaces. A child's
``VmHWM`` is read every ``interval`` seconds while it lives and its last reading is kept (a
reading taken between fork and exec would show the parent); a child that lives shorter than the
interval can be missed (the llama.cpp workers live for seconds).
"""

from __future__ import annotations

import os
import threading
from pathlib import Path


def _children(pid: int) -> list[int]:
    out = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            out += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            pass
    return out


def self_peak_mb() -> float:
    """This process's peak RSS since it exec'd (``VmHWM``), in MB."""
    return _hwm_kb(os.getpid()) / 1024


def _hwm_kb(pid: int, field: str = "VmHWM:") -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(field):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


class ChildPeakRSS:
    """``with ChildPeakRSS() as p: ...`` then ``p.peak_mb``: the largest VmHWM of any descendant;
    ``p.peak_sum_mb``: the most the descendants held together (their VmRSS added at one reading,
    the largest such sum; a peak between two readings can be missed); ``p.cpu_s[pid]`` and
    ``p.argv[pid]``: each descendant's user + system seconds at its last reading (up to one
    interval short) and its command line."""

    def __init__(self, interval: float = 0.02):
        self.interval = interval
        self.last_kb: dict[int, int] = {}  # pid -> its latest VmHWM reading
        self.cpu_s: dict[int, float] = {}  # pid -> its user + system seconds at the latest reading
        self.argv: dict[int, str] = {}  # pid -> its command line (NULs as spaces), read once
        self.peak_sum_kb = 0  # the largest VmRSS of all descendants added, at one reading
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def _poll(self) -> None:
        me = os.getpid()
        while not self._stop.is_set():
            todo, now_kb = _children(me), 0
            while todo:
                pid = todo.pop()
                kb = _hwm_kb(pid)
                if kb:
                    self.last_kb[pid] = kb
                now_kb += _hwm_kb(pid, "VmRSS:")
                self._cpu(pid)
                todo += _children(pid)
            self.peak_sum_kb = max(self.peak_sum_kb, now_kb)
            self._stop.wait(self.interval)

    def _cpu(self, pid: int) -> None:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            self.cpu_s[pid] = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
            if pid not in self.argv:
                self.argv[pid] = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except (OSError, IndexError, ValueError):
            pass

    @property
    def peak_mb(self) -> float:
        return max(self.last_kb.values(), default=0) / 1024

    @property
    def peak_sum_mb(self) -> float:
        return self.peak_sum_kb / 1024

    def __enter__(self) -> "ChildPeakRSS":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
