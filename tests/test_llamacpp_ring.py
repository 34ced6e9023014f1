"""The llama.cpp worker's rows through a shared-memory ring (``LlamaCppEngine.use_ring``,
``_llamacpp_worker._Ring``): the same bytes as through the pipe, whatever the batch and piece
boundaries; a malformed announcement or an early end is an ``EngineError`` or the worker's own
error; the ring file is gone afterwards."""

from __future__ import annotations

import os
import time

import numpy as np
import pytest

from harness.engines.base import gather
from harness.engines.llamacpp import LlamaCppEngine, _PipeReader
from harness.engines.ring import SHM, LogitRing
from harness.errors import EngineError
from harness.fixtures import synthetic as fx


def _pair(**settings) -> tuple[LlamaCppEngine, LlamaCppEngine]:
    path = fx.build("tiny-qwen35")
    ring = LlamaCppEngine(path).with_settings(**settings) if settings else LlamaCppEngine(path)
    pipe = LlamaCppEngine(path).with_settings(**settings) if settings else LlamaCppEngine(path)
    pipe.use_ring = False
    return ring, pipe


def _ring_files() -> set[str]:
    return {p.name for p in SHM.glob(f"harness-ring-{os.getpid()}-*")} if SHM.is_dir() else set()


@pytest.mark.parametrize("settings,n,chunks", [({}, 300, None), ({"n_ubatch": 7}, 45, None), ({"n_batch": 64, "n_ubatch": 32}, 200, [50, 150])])
def test_ring_rows_are_the_pipes_bytes(settings, n, chunks, monkeypatch):
    ring, pipe = _pair(**settings)
    toks = [(7919 * i + 13) % ring.n_vocab for i in range(n)]
    before = _ring_files()
    made, real = [], LlamaCppEngine._open_ring
    monkeypatch.setattr(LlamaCppEngine, "_open_ring", lambda self, d: made.append(real(self, d)) or made[-1])
    a = gather(ring.logits(toks, chunks), n)
    assert len(made) == 1 and made[0] is not None  # the ring carried the rows
    b = gather(pipe.logits(toks, chunks), n)
    assert len(made) == 1  # the pipe engine made none
    assert a.shape == (n, ring.n_vocab) and a.tobytes() == b.tobytes()
    assert np.ptp(a, axis=1).min() > 0  # real logits, not a zeroed slot
    assert _ring_files() == before  # the ring file went with the request


def test_ring_serves_a_prompt_set_in_one_worker():
    ring, pipe = _pair()
    prompts = [[(31 * i + k) % ring.n_vocab for i in range(n)] for k, n in ((1, 40), (2, 70), (3, 17))]
    got = [gather(s, len(p)) for s, p in zip(ring.logits_each(prompts), prompts)]
    for p, g in zip(prompts, got):
        assert g.tobytes() == gather(pipe.logits(p), len(p)).tobytes()


def test_a_consumer_that_stops_early_kills_the_worker_and_removes_the_ring():
    ring, _ = _pair()
    toks = [(7919 * i + 13) % ring.n_vocab for i in range(200)]
    before = _ring_files()
    stream = ring.logits(toks)
    start, first = next(stream)
    assert start == 0 and first.shape[0] == min(ring.block_size, 200) < 200  # rows are left when it stops
    stream.close()
    assert _ring_files() == before


def _reader(tmp_path, words: list[int]) -> tuple[_PipeReader, LogitRing, int]:
    """A reader over a pipe holding ``words`` (int64) and a ring of 2 slots × 4 rows × 8."""
    r, w = os.pipe()
    os.write(w, np.array(words, dtype="<i8").tobytes())
    os.close(w)
    ack_r, ack_w = os.pipe()
    ring = LogitRing(tmp_path, 8, rows=4, mapped=True)
    os.pwrite(ring.fd, np.arange(64, dtype="<f4").tobytes(), 0)
    return _PipeReader(open(r, "rb", buffering=0), time.monotonic() + 5, ring, ack_w), ring, ack_r


def test_ring_blocks_cut_the_announced_slots_into_blocks_and_give_each_slot_back(tmp_path):
    reader, ring, ack_r = _reader(tmp_path, [1, 3, 0, 2])
    got = list(reader.ring_blocks(5, 8, 2))
    assert [s for s, _ in got] == [0, 2, 4]
    rows = np.concatenate([b for _, b in got])
    want = np.concatenate([np.arange(32, 56), np.arange(0, 16)]).astype("<f4")  # slot 1 rows 0..2, then slot 0 rows 0..1
    assert rows.tobytes() == want.tobytes()
    assert np.frombuffer(os.read(ack_r, 64), dtype="<i8").tolist() == [1, 0]
    ring.close()


@pytest.mark.parametrize("words,why", [([2, 1], "slot 2"), ([0, 5], "5 rows"), ([0, 0], "0 rows"), ([0, 4, 1, 4], "at row 4 of 5")])
def test_a_malformed_announcement_is_an_engine_error(tmp_path, words, why):
    reader, ring, _ = _reader(tmp_path, words)
    with pytest.raises(EngineError, match=why):
        list(reader.ring_blocks(5, 8, 256))
    ring.close()


def test_a_stream_that_ends_early_yields_none_and_a_ring_of_another_width_is_refused(tmp_path):
    reader, ring, _ = _reader(tmp_path, [0, 2])
    assert list(reader.ring_blocks(5, 8, 256))[-1] is None
    reader, ring2, _ = _reader(tmp_path, [0, 2])
    with pytest.raises(EngineError, match="ring of 8"):
        list(reader.ring_blocks(5, 16, 256))
    ring.close(), ring2.close()


def test_a_worker_gone_after_its_last_rows_is_not_a_short_stream(tmp_path):
    reader, ring, ack_r = _reader(tmp_path, [0, 3, 1, 2])
    os.close(ack_r)  # the worker has exited: giving its slots back fails with EPIPE
    got = list(reader.ring_blocks(5, 8, 256))
    assert len(got) == 1 and got[0][0] == 0 and got[0][1].shape == (5, 8)
    ring.close()
