"""Run ``harness parity ARGS`` in this process with the engines' forward passes timed; print JSON.

    python benchmarks/_parity_probe.py [--profile OUT.prof] -- parity --model ... (harness args)

Used by ``benchmarks/run_all.py``; one process per measurement so peak RSS is this run's own.
Engine time is the wall time inside an engine's forward pass: the llama.cpp worker's ``info`` run
and its ``logits`` stream (or ``logits_each``'s, a prompt set in one worker run) while it runs (process start, model load, decode, and the one copy of
each row through the pipe, which cannot be told apart from waiting for the decode; the worker's
``tokenize`` run is tokenization and counted as harness time, except that a run which also
describes the model for its ``info`` counts only the worker's own tokenizing seconds so), and the oracle's
``logits`` generator while it computes (trunk, lm_head, float32 conversion) and its ``generate``
(free-running greedy: a session's decode steps; the worker's ``generate`` run is timed like its
other runs), and the oracle's sessions (``OracleSession.feed`` and ``feed_hidden``: the probes'
and serving's step-by-step decode). A timed call inside another timed call is counted once.
Everything else in ``harness.cli.main`` is the harness's own time:
tokenization, metrics, the receipt, the ledger row, the report. Printed fields: ``main_s``,
``engine_s`` (per engine), ``tokenize_s``, ``import_s``, ``maxrss_mb`` (this process: the harness
and the in-process oracle), ``worker_peak_rss_mb`` (the largest decoding llama.cpp worker's own
``VmHWM``, from its ``info.json``), ``workers_polled_peak_rss_mb`` (every descendant, polled: it
can catch a child between fork and exec, when it still shows this process's pages), ``exit``.
Any harness command runs this way (``calibrate`` too); the engine buckets stay empty when it
runs none of them.
"""

from __future__ import annotations

import contextlib
import io
import json
import sys
import time

t0 = time.perf_counter()
from _rss import ChildPeakRSS, self_peak_mb  # noqa: E402

from harness.cli import main  # noqa: E402
from harness.engines.llamacpp import LlamaCppEngine  # noqa: E402
from harness.engines.oracle.qwen35 import Qwen35Oracle  # noqa: E402
from harness.engines.oracle.session import OracleSession  # noqa: E402
from harness.evidence import report  # noqa: E402,F401  (what a parity run imports; timed as import_s)

import_s = time.perf_counter() - t0
timers = {"llama.cpp": 0.0, "oracle": 0.0, "tokenize": 0.0}


_depth = [0]  # timed engine calls in progress: a call inside another is already counted


def _timed(cls, name: str, key) -> None:
    real = getattr(cls, name)

    def wrapper(self, *a, **k):
        if _depth[0]:
            return real(self, *a, **k)
        bucket = key(a) if callable(key) else key
        t = time.perf_counter()
        _depth[0] += 1
        try:
            return real(self, *a, **k)
        finally:
            _depth[0] -= 1
            timers[bucket] += time.perf_counter() - t

    setattr(cls, name, wrapper)


def _timed_stream(cls, name: str, key: str) -> None:
    """Time an engine's ``logits`` generator while it runs (between a resume and its yield)."""
    real = getattr(cls, name)

    def wrapper(self, *a, **k):
        yield from _timed_iter(iter(real(self, *a, **k)), key)

    setattr(cls, name, wrapper)


def _timed_iter(it, key: str):
    """``it`` with the time inside each ``next`` added to ``timers[key]`` (once when nested)."""
    while True:
        outer = not _depth[0]
        t = time.perf_counter()
        _depth[0] += 1
        try:
            item = next(it)
        except StopIteration:
            return
        finally:
            _depth[0] -= 1
            if outer:
                timers[key] += time.perf_counter() - t
        yield item


def _timed_each(cls, name: str, key: str) -> None:
    """Time an engine's ``logits_each`` (one run for a prompt set): the outer generator (starting
    the worker) and every prompt's stream while they run."""
    real = getattr(cls, name)

    def wrapper(self, *a, **k):
        for stream in _timed_iter(iter(real(self, *a, **k)), key):
            yield _timed_iter(iter(stream), key)

    setattr(cls, name, wrapper)


worker_peaks: list[float] = []  # each decoding worker's own VmHWM (its info.json), MB


def _record_worker_peak(cls) -> None:
    real = cls._finish

    def wrapper(self, *a, **k):
        info = real(self, *a, **k)
        if "decode_s" in info:
            worker_peaks.append(float(info.get("peak_rss_mb") or 0))
        return info

    cls._finish = wrapper


_record_worker_peak(LlamaCppEngine)
def _time_runs(cls) -> None:
    """A worker run that decodes nothing is engine time (``info``) or tokenization: a ``tokenize``
    run that also describes the model (``with_info``: the reference, which needs its ``info``
    anyway) counts the worker's own ``tokenize_s`` as tokenization and the rest (process start,
    model load, the description) as llama.cpp's."""
    real = cls._run

    def wrapper(self, request, *a, **k):
        t = time.perf_counter()
        info = None
        try:
            info = real(self, request, *a, **k)
            return info
        finally:
            dt = time.perf_counter() - t
            if request.get("op") != "tokenize":
                timers["llama.cpp"] += dt
            elif request.get("with_info") and info is not None:
                tok = min(dt, float(info.get("tokenize_s") or 0.0))
                timers["tokenize"] += tok
                timers["llama.cpp"] += dt - tok
            else:
                timers["tokenize"] += dt

    cls._run = wrapper


_time_runs(LlamaCppEngine)
_timed_stream(LlamaCppEngine, "logits", "llama.cpp")  # the worker streams its logits while it decodes
_timed_each(LlamaCppEngine, "logits_each", "llama.cpp")  # a prompt set in one worker run (harness parity)
_timed_stream(Qwen35Oracle, "logits", "oracle")
_timed(Qwen35Oracle, "generate", "oracle")  # free-running greedy (report-only): the oracle's own decode steps
_timed(OracleSession, "feed", "oracle")  # the probes' and serving's step-by-step sessions (inside generate: counted once)
_timed(OracleSession, "feed_hidden", "oracle")


def run() -> None:
    argv = sys.argv[1:]
    prof_out = None
    if argv and argv[0] == "--profile":
        prof_out, argv = argv[1], argv[2:]
    if argv and argv[0] == "--":
        argv = argv[1:]
    out = io.StringIO()
    t = time.perf_counter()
    with ChildPeakRSS() as workers, contextlib.redirect_stdout(out):
        if prof_out:
            import cProfile

            prof = cProfile.Profile()
            code = prof.runcall(main, argv)
            prof.dump_stats(prof_out)
        else:
            code = main(argv)
    main_s = time.perf_counter() - t
    print(json.dumps({
        "exit": code,
        "main_s": main_s,
        "import_s": import_s,
        "engine_s": {"llama.cpp": timers["llama.cpp"], "oracle": timers["oracle"]},
        "tokenize_s": timers["tokenize"],
        "maxrss_mb": self_peak_mb(),
        "worker_peak_rss_mb": max(worker_peaks, default=0.0),
        "workers_polled_peak_rss_mb": workers.peak_mb,
        "stdout_tail": out.getvalue()[-600:],
    }))


if __name__ == "__main__":
    run()
