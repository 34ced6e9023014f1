"""Logit rows through shared memory: the ``logits_ring`` transport of command protocol 2.

A ``logits.npy`` of a 2,048-position prompt at Qwen3.5's vocabulary (V = 248,320) is 2 GB that
the engine writes to a file and the harness reads back. With the capability ``logits_ring``
(docs/engine-protocol.md, "The logits ring") the harness makes a small file of ``slots`` ×
``rows`` × V float32 in shared memory (``/dev/shm`` where it is a writable directory, else the
request's own folder), the engine writes each block of rows into the next slot and announces it
on its stdout, and the harness reads the slot, computes on it, and acknowledges it on the
engine's stdin so that the slot can be written again. Memory stays at ``slots × rows × V × 4``
bytes (128 MB at V = 248,320 with the defaults), however many positions the prompt has, and no
row touches a disk. llama.cpp's own ``llama-perplexity`` keeps its base logits in one process;
this is the cross-process equivalent.

Where the system has them (Linux), the ring is a sealed memfd (``sealed_memfd``): an anonymous
shared-memory file that cannot be shrunk or grown, which the engine opens by its
``/proc/<pid>/fd/<fd>`` path. The harness reads it through a mapping, a copy in user space
(64 rows at V = 248,320: 6.5 ms, against 15 ms through ``preadv``), because the seal makes a
truncation impossible: an engine that opens it with ``open(path, "wb")`` gets EPERM, where the
truncated plain file would kill the harness with SIGBUS on a mapped read. It needs no sweeping: it
is gone with the harness's last descriptor, however the harness ends. Elsewhere the ring is a
plain file (in ``/dev/shm`` when it is a writable directory, else in the request's folder) read
with ``os.preadv`` (a short read is one ENGINE-ERROR); such files are named
``harness-ring-<pid>-*``, and one a run killed with SIGKILL leaves is removed by the next run
(``sweep``), as ``harness.rundir`` does for run folders. Either way, a block the harness yields
is its own copy, valid after the slot is written again.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from harness.engines.base import BlockPool
from harness.rundir import pid_alive

RING_SLOTS = 2
"""Slots in a ring: the engine fills one while the harness reads the other."""
RING_ROWS = 64
"""Rows per slot: 64 MB at V = 248,320; a block is at most this many rows."""
SHM = Path("/dev/shm")
PREFIX = "harness-ring-"


def ring_dir(fallback: Path) -> Path:
    """``/dev/shm`` when it is a directory this process can write, else ``fallback`` (the
    request's folder: the ring still bounds memory, through the page cache)."""
    if SHM.is_dir() and os.access(SHM, os.W_OK | os.X_OK):
        return SHM
    return fallback


def sweep(where: Path) -> list[Path]:
    """Remove ring files in ``where`` whose harness process is gone (killed with SIGKILL);
    returns what was removed. Files of live processes, and names that are not ring files, stay."""
    gone = []
    for p in where.glob(f"{PREFIX}*-*"):
        try:
            pid = int(p.name[len(PREFIX):].split("-")[0])
        except ValueError:
            continue
        if pid != os.getpid() and not pid_alive(pid):
            try:
                p.unlink()
                gone.append(p)
            except OSError:
                pass
    return gone


def sealed_memfd(size: int) -> tuple[int, Path] | None:
    """An anonymous shared-memory file of ``size`` bytes (Linux ``memfd_create(2)``) sealed
    against shrinking and growing (``F_SEAL_SHRINK | F_SEAL_GROW``, then ``F_SEAL_SEAL``), and
    the path another process opens it by (``/proc/<pid>/fd/<fd>``): ``(fd, path)``, or None
    where memfds, seals or that path are not available (the caller makes a file instead).

    Why: an engine that opens the ring with ``open(path, "wb")`` truncates a plain file, and a
    mapped read of a truncated file kills the reader with SIGBUS; a sealed memfd refuses the
    truncation (EPERM, in the engine), so the harness can read it through a mapping. It needs no
    sweeping either: it is gone when its last descriptor closes, however the harness ends."""
    seals = [getattr(fcntl, n, None) for n in ("F_ADD_SEALS", "F_SEAL_SHRINK", "F_SEAL_GROW", "F_SEAL_SEAL")]
    if not hasattr(os, "memfd_create") or None in seals:
        return None
    add, shrink, grow, seal = seals
    try:
        fd = os.memfd_create(f"{PREFIX}{os.getpid()}", os.MFD_ALLOW_SEALING | os.MFD_CLOEXEC)
    except OSError:
        return None
    try:
        os.ftruncate(fd, size)
        fcntl.fcntl(fd, add, shrink | grow | seal)
        path = Path(f"/proc/{os.getpid()}/fd/{fd}")
        os.close(os.open(path, os.O_RDWR))  # the path opens (a /proc without it: no memfd ring)
        return fd, path
    except OSError:
        os.close(fd)
        return None


class LogitRing:
    """A ring file of ``slots`` × ``rows`` × ``n_vocab`` little-endian float32 (C order) in
    ``where``; slot k starts at byte ``k × rows × n_vocab × 4``. ``spec`` is the request's
    ``logits_ring`` field. ``read(slot, n)`` returns rows 0..n−1 of a slot as a new float32
    ``[n, n_vocab]`` array (``mapped``: copied from a read-only mapping of the file, for a writer
    that never truncates it; see the module docstring). ``pool``: the ``BlockPool`` that ``read``
    takes its blocks from (an engine's own, kept across its requests, so that a prompt set does
    not fault in two fresh blocks a prompt), else a pool of its own. ``sealed``: a sealed memfd
    (``sealed_memfd``, read through a mapping) where the system has them, else the file. Use as a context manager, or ``close()``: the file is removed.
    Raises ``OSError`` when the file cannot be made (no space in ``/dev/shm``)."""

    def __init__(self, where: Path, n_vocab: int, rows: int = RING_ROWS, slots: int = RING_SLOTS, mapped: bool = False,
                 pool: BlockPool | None = None, sealed: bool = False):
        self.n_vocab, self.rows, self.slots = int(n_vocab), int(rows), int(slots)
        self.pool = pool if pool is not None else BlockPool()
        self._map: mmap.mmap | None = None
        self._slots: np.ndarray | None = None
        made = sealed_memfd(self.slots * self.slot_bytes) if sealed else None
        self.memfd = made is not None
        if made is not None:
            self.fd, self.path = made
            mapped = True  # its size cannot change: a mapped read cannot fault past its end
        else:
            if where == SHM:
                sweep(where)
            fd, name = tempfile.mkstemp(prefix=f"{PREFIX}{os.getpid()}-", suffix=".f32", dir=where)
            self.fd, self.path = fd, Path(name)
        try:
            if not self.memfd:
                os.ftruncate(self.fd, self.slots * self.slot_bytes)
            if mapped:
                self._map = mmap.mmap(self.fd, self.slots * self.slot_bytes, prot=mmap.PROT_READ)
                self._slots = np.frombuffer(self._map, dtype="<f4").reshape(self.slots, self.rows, self.n_vocab)
        except OSError:
            self.close()
            raise

    @property
    def slot_bytes(self) -> int:
        """Bytes of one slot: ``rows × n_vocab × 4``."""
        return self.rows * self.n_vocab * 4

    @property
    def spec(self) -> dict[str, Any]:
        """The request's ``logits_ring`` field: ``path``, ``slots``, ``rows``."""
        return {"path": str(self.path), "slots": self.slots, "rows": self.rows}

    def read(self, slot: int, n: int) -> np.ndarray:
        """Rows 0..n−1 of ``slot`` as float32 ``[n, n_vocab]`` (a copy into a ``BlockPool`` buffer
        nobody else holds: valid after the slot is written again, and for as long as it is kept).
        Raises as ``read_into``."""
        out = self.pool.take(max(n, 1), self.n_vocab)[:n]
        self.read_into(slot, 0, out)
        return out

    def read_into(self, slot: int, first: int, out: np.ndarray) -> None:
        """Copy rows ``first`` .. ``first + len(out) − 1`` of ``slot`` into ``out`` (float32
        ``[n, n_vocab]``, C-contiguous). Raises ``ValueError`` for a slot or rows outside the
        ring, and ``OSError`` for a short read (the file was truncated under us)."""
        n = out.shape[0]
        if not (0 <= slot < self.slots and 0 <= first and 0 < n and first + n <= self.rows) or out.shape[1:] != (self.n_vocab,):
            raise ValueError(f"slot {slot} / rows {first}..{first + n - 1} outside a ring of {self.slots} slots × {self.rows} rows")
        if self._slots is not None:
            np.copyto(out, self._slots[slot, first:first + n])
            return
        view = memoryview(out).cast("B")
        at, done = slot * self.slot_bytes + first * self.n_vocab * 4, 0
        while done < view.nbytes:
            got = os.preadv(self.fd, [view[done:]], at + done)
            if got <= 0:
                raise OSError(f"ring file {self.path.name} ended {view.nbytes - done} bytes short of slot {slot}")
            done += got

    def close(self) -> None:
        """Close and remove the ring file (idempotent)."""
        self._slots = None
        if self._map is not None:
            try:
                self._map.close()
            except BufferError:  # a view of it still held somewhere: the mapping goes with it
                pass
            self._map = None
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None  # type: ignore[assignment]
            if not self.memfd:  # a memfd is gone with its last descriptor
                try:
                    self.path.unlink()
                except OSError:
                    pass

    def __enter__(self) -> "LogitRing":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
