"""Metrics throughput at Qwen3.5's vocab relative to one plain pass over the same two arrays.

    python benchmarks/bench_metrics.py [--vocab 248320] [--positions 256] [--block 64] [--repeat 3]

The plain pass is ``ref.sum(axis=1); cand.sum(axis=1)`` per block: it reads both float32 arrays
once and does nothing else, so it runs at memory bandwidth. ``harness.measure.metrics.position_metrics``
is timed over the same blocks as a run takes it (the compiled row kernel, its rows split over the
process's cores: ``harness.measure.rowkernel``), and also with the kernel on one thread and on the
numpy path (``HARNESS_ROWKERNEL=0``), so each path's cost is on the page. Target (issue 15): ratio
≤ 6. Arrays are larger than the last-level cache so no pass is served from cache alone.
Logits are synthetic but shaped like a language model's: a Gaussian body, a few leading tokens,
and a candidate that differs by quantization-sized noise.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

from harness.measure import metrics


def make_logits(n_pos: int, n_vocab: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Reference and candidate float32 ``[n_pos, n_vocab]`` logits."""
    rng = np.random.default_rng(seed)
    ref = rng.standard_normal((n_pos, n_vocab), dtype=np.float32)
    ref *= 2.5
    lead = rng.integers(0, n_vocab, size=(n_pos, 8))
    ref[np.arange(n_pos)[:, None], lead] += rng.uniform(6, 14, size=(n_pos, 8)).astype(np.float32)
    cand = ref + rng.standard_normal((n_pos, n_vocab), dtype=np.float32) * np.float32(0.05)
    return ref, cand


def best_of_interleaved(repeat: int, *fns) -> list[float]:
    """Best wall time of each function over ``repeat`` rounds, the functions alternating within a
    round so that background load hits both alike."""
    best = [float("inf")] * len(fns)
    for _ in range(repeat):
        for i, fn in enumerate(fns):
            t0 = time.perf_counter()
            fn()
            best[i] = min(best[i], time.perf_counter() - t0)
    return best


def measure(vocab: int = 248_320, positions: int = 256, block: int = 64, repeat: int = 5) -> dict:
    """Best-of-``repeat`` times of the plain pass and of ``position_metrics`` over the same blocks."""
    ref, cand = make_logits(positions, vocab)
    starts = range(0, positions, block)

    def plain() -> None:
        for s in starts:
            ref[s : s + block].sum(axis=1)
            cand[s : s + block].sum(axis=1)

    def run_metrics() -> None:
        for s in starts:
            metrics.position_metrics(ref[s : s + block], cand[s : s + block])

    from harness.measure import rowkernel

    status = rowkernel.kernel_status()
    run_metrics()  # warm-up: scratch buffers, lazy imports, the kernel's build
    threads = rowkernel._threads()

    def one_thread() -> None:
        real = rowkernel._threads
        rowkernel._threads = lambda: 1
        try:
            run_metrics()
        finally:
            rowkernel._threads = real

    def numpy_path() -> None:
        saved = dict(rowkernel._state)
        rowkernel._state.update(fn=None, why="the numpy path, measured")
        try:
            run_metrics()
        finally:
            rowkernel._state.clear()
            rowkernel._state.update(saved)

    compiled = status["path"] == "compiled"
    fns = [plain, run_metrics] + ([one_thread, numpy_path] if compiled else [])
    times = best_of_interleaved(repeat, *fns)
    t_plain, t_metrics = times[:2]
    return {
        "kernel": status["path"],
        "threads": threads if compiled else 1,
        "one_thread_us_per_position": 1e6 * times[2] / positions if compiled else None,
        "numpy_us_per_position": 1e6 * times[3] / positions if compiled else 1e6 * t_metrics / positions,
        "vocab": vocab,
        "positions": positions,
        "block": block,
        "plain_positions_per_s": positions / t_plain,
        "metrics_positions_per_s": positions / t_metrics,
        "metrics_us_per_position": 1e6 * t_metrics / positions,
        "plain_us_per_position": 1e6 * t_plain / positions,
        "ratio": t_metrics / t_plain,
        "target_ratio": 6.0,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocab", type=int, default=248_320)
    ap.add_argument("--positions", type=int, default=256)
    ap.add_argument("--block", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--json", action="store_true", help="print the numbers as JSON")
    args = ap.parse_args()
    result = measure(args.vocab, args.positions, args.block, args.repeat)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(
            f"V={args.vocab} positions={args.positions} block={args.block}\n"
            f"plain pass : {result['plain_positions_per_s']:10.0f} positions/s ({result['plain_us_per_position']:.0f} us/pos)\n"
            f"metrics    : {result['metrics_positions_per_s']:10.0f} positions/s ({result['metrics_us_per_position']:.0f} us/pos)\n"
            f"ratio      : {result['ratio']:.2f}x (target <= 6x)"
        )


if __name__ == "__main__":
    main()
