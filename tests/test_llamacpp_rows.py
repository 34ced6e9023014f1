"""The llama.cpp worker writes a single sequence's logits from the graph's ``result_output`` and
gives the pages of that tensor and of llama.cpp's output buffer back once used (issue 15): the
bytes are those read from llama.cpp's output buffer, and the worker's peak RSS at Qwen3.5's
vocab holds one 512-row buffer of logits, not two."""

from __future__ import annotations

import numpy as np
import pytest

from harness.engines.base import gather
from harness.engines.llamacpp import LlamaCppEngine
from harness.fixtures import synthetic as fx


def _both(eng: LlamaCppEngine, tokens: list[int], chunks: list[int] | None = None) -> tuple[np.ndarray, np.ndarray]:
    req = {"op": "logits", "tokens": tokens, "chunks": chunks or [len(tokens)], "settings": eng.settings.resolved(len(tokens))}
    graph = gather(eng._stream(req, len(tokens)), len(tokens))
    output = gather(eng._stream({**req, "rows_from": "output"}, len(tokens)), len(tokens))
    return graph, output


@pytest.mark.parametrize("settings,n,chunks", [({}, 300, None), ({"n_ubatch": 7}, 100, None), ({"n_batch": 64, "n_ubatch": 32}, 200, [50, 150])])
def test_rows_from_the_graph_are_the_output_buffers_bytes(settings, n, chunks):
    eng = LlamaCppEngine(fx.build("tiny-qwen35")).with_settings(**settings)
    toks = [(7919 * i + 13) % eng.n_vocab for i in range(n)]
    graph, output = _both(eng, toks, chunks)
    assert graph.shape == (n, eng.n_vocab)
    assert graph.tobytes() == output.tobytes()
    assert np.isfinite(graph).all() and np.ptp(graph, axis=1).min() > 0  # real logits, not a zeroed page


def test_worker_peak_rss_at_v248k_holds_one_batch_of_logits_not_two():
    path = fx.build("tiny-qwen35-v248k")
    old, new = LlamaCppEngine(path), LlamaCppEngine(path)
    toks = [(7919 * i + 13) % old.n_vocab for i in range(600)]  # two decodes: 512 + 88 rows
    req = {"op": "logits", "tokens": toks, "chunks": [600], "settings": old.settings.resolved(600), "rows_from": "output"}
    output = gather(old._stream(req, 600), 600)
    graph = gather(new.logits(toks), 600)
    assert graph.tobytes() == output.tobytes()
    batch_mb = 512 * old.n_vocab * 4 / 2**20  # 485 MiB: one 512-row float32 buffer at V = 248,320
    assert old.worker_peak_rss_mb > new.worker_peak_rss_mb + 0.8 * batch_mb
    model_mb = path.stat().st_size / 2**20
    # model + one batch (485 MiB) + the rest of the compute buffer, KV (a few MB here) and the runtime: 600 MB
    # (issue 15), measured 582; 2 MiB pages (llamacpp.worker_env) round the worker's buffers up: 598 (+16 MB)
    assert new.worker_peak_rss_mb < model_mb + 640


def test_the_worker_environment_asks_for_huge_pages_and_passive_waits_but_keeps_the_callers_choices():
    from harness.engines.llamacpp import worker_env

    env = worker_env({"PATH": "/bin"})
    assert env["GLIBC_TUNABLES"] == "glibc.malloc.hugetlb=1" and env["OMP_WAIT_POLICY"] == "PASSIVE"
    assert env["GGML_NO_BACKTRACE"] == "1" and env["PATH"] == "/bin"
    mine = worker_env({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2", "OMP_WAIT_POLICY": "ACTIVE"})
    assert mine["GLIBC_TUNABLES"] == "glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1" and mine["OMP_WAIT_POLICY"] == "ACTIVE"
    assert worker_env({"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"})["GLIBC_TUNABLES"] == "glibc.malloc.hugetlb=0"
