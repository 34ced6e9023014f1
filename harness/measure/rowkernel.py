"""The compiled per-row metrics kernel (``rowkernel.c``): built once per machine, loaded with ctypes.

``metrics.position_metrics`` spends most of a parity run's own time (issue 47: 1.6 s of a
2,048-position run at Qwen3.5's vocabulary) in numpy passes over each 1 MB logit row: ten or so
passes, each reading a row-sized buffer, each a separate call. ``rowkernel.c`` computes the same
quantities (sums of squares, the KLD's sums, top-k) in two fused passes; numpy has no fused
multi-output reduction to do it with, and the numbers stay the harness's own (no new runtime
dependency: the system C compiler, which llama-cpp-python's build needs anyway).

Build: ``$CC`` (else ``cc``) with ``-O3 -fopenmp-simd -fno-math-errno -shared -fPIC``, first with
``-march=native`` and then without, into ``<cache_root>/rowkernel/<key>.so`` where ``key`` is the
sha256 of the source, the flags, the compiler's path, size and mtime, the machine and the CPU's
flags: a new compiler, CPU or source builds a new file; concurrent builds are serialised by a file
lock and the library is renamed into place whole.

When no kernel can be had (no compiler, a failed build, ``HARNESS_ROWKERNEL=0``), the metrics take
the numpy path, which computes the same fields (``tests/test_rowkernel.py`` checks the two against
each other and against float64); ``kernel_status()`` says which path is in use and why, and
``harness doctor`` and the benchmarks print it.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import numpy as np

SOURCE = Path(__file__).with_name("rowkernel.c")
ABI = 3
"""``harness_rowkernel_abi()`` of a library built from this ``rowkernel.c``; a mismatch is not loaded."""

N_STATS = 10
S_RR, S_CC, S_DD, S_LOGZ, S_M, S_T, S_DMIN, S_DMAX, S_FLAG, S_RMAX = range(N_STATS)
"""Columns of ``rows``'s stats (rowkernel.c's enum): |r|², |c|², |r − c|², log Σ exp r,
m = E_p[r − c], t = E_p[g(m − d)] (KLD = log1p(t)), min and max of r − c, the flag (0 every field;
1 outside the fast range, nothing else filled; 2 the KLD needs float64, the rest filled), max r.
Each row's values depend on that row pair alone (never on how a block was cut)."""

KMAX = 64
_FLAGS = ["-O3", "-fopenmp-simd", "-fno-math-errno", "-shared", "-fPIC"]
_BUILD_TIMEOUT_S = 120

_lock = threading.Lock()
_state: dict[str, object] = {}


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text(errors="replace").splitlines():
            if line.startswith(("flags", "Features")):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def _compiler() -> str | None:
    cc = os.environ.get("CC") or "cc"
    return shutil.which(cc)


def _key(cc: str, flags: list[str]) -> str:
    st = os.stat(cc)
    h = hashlib.sha256()
    for part in (SOURCE.read_bytes(), " ".join(flags).encode(), os.path.realpath(cc).encode(),
                 f"{st.st_size}:{st.st_mtime_ns}".encode(), platform.machine().encode(), _cpu_flags().encode()):
        h.update(hashlib.sha256(part).digest())
    return h.hexdigest()[:32]


def _build(cc: str, folder: Path) -> tuple[Path | None, str]:
    """(path of a built or cached library, "") or (None, why not)."""
    from filelock import FileLock, Timeout

    why = ""
    for flags in (["-march=native", *_FLAGS], _FLAGS):
        target = folder / f"{_key(cc, flags)}.so"
        if target.is_file():
            return target, ""
        try:
            folder.mkdir(parents=True, exist_ok=True)
            with FileLock(str(target) + ".lock", timeout=_BUILD_TIMEOUT_S):
                if target.is_file():
                    return target, ""
                fd, tmp = tempfile.mkstemp(suffix=".so", dir=folder)
                os.close(fd)
                try:
                    proc = subprocess.run([cc, *flags, "-o", tmp, str(SOURCE), "-lm"], capture_output=True,
                                          text=True, timeout=_BUILD_TIMEOUT_S)
                    if proc.returncode == 0:
                        os.replace(tmp, target)
                        return target, ""
                    why = f"{os.path.basename(cc)} {' '.join(flags)} failed: " + (proc.stderr.strip().splitlines() or ["?"])[-1]
                finally:
                    if os.path.exists(tmp):
                        os.unlink(tmp)
        except (OSError, subprocess.SubprocessError, Timeout) as e:
            why = f"building {SOURCE.name} failed: {type(e).__name__}: {e}"
    return None, why


def _load() -> tuple[object | None, str]:
    if os.environ.get("HARNESS_ROWKERNEL", "1") == "0":
        return None, "disabled by HARNESS_ROWKERNEL=0"
    cc = _compiler()
    if cc is None:
        return None, f"no C compiler ({os.environ.get('CC') or 'cc'} not found)"
    from harness.paths import cache_root

    path, why = _build(cc, cache_root() / "rowkernel")
    if path is None:
        return None, why
    try:
        lib = ctypes.CDLL(str(path))
        if lib.harness_rowkernel_abi() != ABI:
            return None, f"{path} has ABI {lib.harness_rowkernel_abi()}, expected {ABI}"
        fn = lib.harness_rows
    except (OSError, AttributeError) as e:
        return None, f"loading {path} failed: {e}"
    p = ctypes.c_void_p
    fn.argtypes = [p, p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int, p, p, p, p, p]
    fn.restype = ctypes.c_int
    return fn, str(path)


def _kernel():
    with _lock:
        if "fn" not in _state:
            _state["fn"], _state["why"] = _load()
        return _state["fn"]


def kernel_status() -> dict[str, str]:
    """``{"path": "compiled" | "numpy", "detail": str}``: which path ``position_metrics`` takes on
    this machine, and why (the loaded library's path, or the reason it could not be built/loaded).
    Builds the kernel on first call (about a second)."""
    fn = _kernel()
    return {"path": "compiled" if fn is not None else "numpy", "detail": str(_state["why"])}


def available() -> bool:
    """True when the compiled kernel is loaded (building it on first call)."""
    return _kernel() is not None


THREADS_MAX = 4
"""At most this many threads split a block's rows (each row pair is independent; the kernel
releases the GIL). A run's engines are paused while the harness measures a block (the in-process
oracle is a generator; llama.cpp's worker has written its rows ahead), so the cores are free."""

_pool: dict[int, object] = {}
"""The thread pool of this process (keyed by pid: a forked child starts its own, the parent's
threads do not exist in it)."""


def _threads() -> int:
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    return max(1, min(THREADS_MAX, cores))


def _executor():
    pid = os.getpid()
    with _lock:
        if pid not in _pool:
            from concurrent.futures import ThreadPoolExecutor

            _pool.clear()
            _pool[pid] = ThreadPoolExecutor(max_workers=_threads(), thread_name_prefix="rowkernel")
        return _pool[pid]


def rows(ref: np.ndarray, cand: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Run the kernel over every row pair of two C-contiguous float32 blocks ``[n, V]``, the rows
    split over up to ``THREADS_MAX`` threads (as many as this process may use cores); each row's
    values depend on its row pair alone, so the split never changes a number.

    Args:
        k: top-k size, 1 .. min(64, V).

    Returns:
        (stats float64 ``[n, N_STATS]`` (columns ``S_*``), ids int64 ``[n, 2, k]``, vals float32
        ``[n, 2, k]``): the reference's top k then the candidate's, ordered by (value descending,
        id ascending); ids/vals are undefined on rows whose flag is 1.

    Raises:
        RuntimeError: the kernel is not available (check ``available()`` first) or rejected the
            arguments.
    """
    fn = _kernel()
    if fn is None:
        raise RuntimeError(f"row kernel unavailable: {_state['why']}")
    n, v = ref.shape
    if not (ref.dtype == cand.dtype == np.float32 and ref.flags.c_contiguous and cand.flags.c_contiguous
            and cand.shape == ref.shape):
        raise RuntimeError("row kernel needs two C-contiguous float32 blocks of one shape")
    stats = np.zeros((n, N_STATS), dtype=np.float64)
    ids = np.zeros((n, 2, k), dtype=np.int64)
    vals = np.zeros((n, 2, k), dtype=np.float32)

    def part(a: int, b: int) -> int:
        e = np.empty(v, dtype=np.float32)
        bm = np.empty(2 * -(-v // 256), dtype=np.float32)
        return fn(ref[a:b].ctypes.data, cand[a:b].ctypes.data, b - a, v, k, e.ctypes.data, bm.ctypes.data,
                  stats[a:b].ctypes.data, ids[a:b].ctypes.data, vals[a:b].ctypes.data)

    parts = min(_threads(), n)
    if parts <= 1:
        codes = [part(0, n)] if n else []
    else:
        cuts = np.linspace(0, n, parts + 1).astype(int)
        codes = list(_executor().map(part, cuts[:-1], cuts[1:]))
    if any(codes):
        raise RuntimeError(f"row kernel rejected n={n} V={v} k={k}")
    return stats, ids, vals
