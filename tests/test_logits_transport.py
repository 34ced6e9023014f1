"""Logit rows without a file per request (issue 58): the protocol-2 ``logits_ring`` transport
(harness/engines/ring.py, docs/engine-protocol.md "The logits ring") and the reference's
``logits_each`` (one llama.cpp worker run for a prompt set). Each must give the same bytes as the
plain path, bound its memory, and turn a misbehaving engine into one ENGINE-ERROR."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from helpers import engine_starts, fresh_engine_processes  # noqa: F401 (a fixture)

from harness.engines import ring
from harness.engines.base import gather, logits_each
from harness.engines.command import CommandEngine, CommandSpec
from harness.engines.llamacpp import LlamaCppEngine
from harness.engines.mutants import PlantedEngine
from harness.engines.timing import TimedEngine
from harness.errors import EngineError
from harness.fixtures import synthetic as fx
from harness.runs import reference_cache

TOKENS = list(range(30, 130))


pytestmark = pytest.mark.usefixtures("fresh_engine_processes")


def _example(capabilities: list[str], name: str = "ex") -> CommandEngine:
    """The example engine (examples/llamacpp_engine.py) under a table ``name`` declaring ``capabilities``."""
    root = Path(__file__).resolve().parents[1]
    spec = CommandSpec(name, ["{python}", str(root / "examples" / "llamacpp_engine.py"), "--serve"], 120.0, capabilities, protocol=2)
    return CommandEngine(spec, fx.build("tiny-qwen35"), block_size=256)


def _ring_files() -> list[str]:
    return sorted(p.name for p in ring.SHM.glob(f"{ring.PREFIX}{os.getpid()}-*")) if ring.SHM.is_dir() else []


def test_the_ring_gives_the_bytes_logits_npy_gives_in_blocks_of_its_rows():
    long = [int(t) for t in np.random.default_rng(3).integers(0, 200, 700)]
    with_ring, without = _example(["chunks", "multi_seq", "logits_ring"]), _example(["chunks", "multi_seq"])
    blocks = list(with_ring.logits(long))
    assert [s for s, _ in blocks] == list(range(0, 700, ring.RING_ROWS))  # 64-row blocks, never the prompt whole
    assert max(b.shape[0] for _, b in blocks) == ring.RING_ROWS
    assert with_ring._reply_files == ["info.json"]  # no logits.npy was written
    assert np.array_equal(gather(iter(blocks)), gather(without.logits(long)))
    pieces = gather(with_ring.logits(TOKENS, chunks=[13, 87]))  # chunks and sequences go through it too
    assert np.array_equal(pieces, gather(without.logits(TOKENS, chunks=[13, 87])))
    multi = gather(with_ring.logits_multi([TOKENS[:40], TOKENS[40:]]))
    assert np.array_equal(multi, gather(without.logits_multi([TOKENS[:40], TOKENS[40:]])))
    assert _ring_files() == []  # each request's ring file is gone after it


def test_a_consumer_that_stops_early_ends_the_engine_and_the_next_request_starts_afresh():
    eng = _example(["logits_ring"])
    long = list(range(10, 210)) * 2
    it = eng.logits(long)
    first = next(it)
    assert first[0] == 0
    it.close()  # the engine waits for an ack that will not come: it is killed, not left mid-request
    assert _ring_files() == []
    got = gather(eng.logits(TOKENS))
    assert got.shape[0] == len(TOKENS) and engine_starts() == 2


FAKE = textwrap.dedent('''
    import json, os, sys
    import numpy as np
    MODE = sys.argv[1]
    V = int(sys.argv[2])
    for line in sys.stdin:
        req = json.loads(line)
        if "ack" in req:
            continue
        r, n = req.get("logits_ring"), len(req.get("tokens") or [])
        if r is None:
            print(json.dumps({"id": req["id"], "ok": False, "error": "no ring"}), flush=True); continue
        fd = os.open(r["path"], os.O_RDWR)
        rows = np.ones((min(n, r["rows"]), V), np.float32)
        os.pwrite(fd, rows.tobytes(), 0)
        block = {"slot": 0, "start": 0, "rows": len(rows)}
        if MODE == "bad-start": block["start"] = 5
        if MODE == "bad-slot": block["slot"] = 7
        if MODE == "too-many": block["rows"] = r["rows"] + 1
        if MODE == "string-rows": block["rows"] = "64"
        if MODE == "die":
            sys.exit(9)
        print(json.dumps({"id": req["id"], "block": block}), flush=True)
        if MODE == "short":
            sys.stdin.readline()
            print(json.dumps({"id": req["id"], "ok": True, "files": []}), flush=True); continue
        sys.stdin.readline()
        print(json.dumps({"id": req["id"], "ok": True, "files": []}), flush=True)
''')


@pytest.mark.parametrize("mode, message", [
    ("bad-start", r"announced ring block .*'start': 5.*expected rows from 0"),
    ("bad-slot", r"announced ring block .*'slot': 7"),
    ("too-many", r"announced ring block .*at most 64"),
    ("string-rows", r"announced ring block"),
    ("short", r"finished a ring request after 64 of 100 rows"),
    ("die", r"closed its stdout before replying"),
])
def test_a_misbehaving_ring_engine_is_one_engine_error(tmp_path, mode, message):
    script = tmp_path / "fake.py"
    script.write_text(FAKE)
    model = fx.build("tiny-qwen35")
    n_vocab = LlamaCppEngine(model).n_vocab
    spec = CommandSpec("fake", [sys.executable, str(script), mode, str(n_vocab)], 30.0, ["logits_ring"], protocol=2)
    eng = CommandEngine(spec, model)
    with pytest.raises(EngineError, match=message):
        gather(eng.logits(TOKENS), len(TOKENS))
    assert _ring_files() == []


def test_sweep_removes_only_the_ring_files_of_dead_processes(tmp_path):
    dead = tmp_path / f"{ring.PREFIX}999999999-abc.f32"
    mine = tmp_path / f"{ring.PREFIX}{os.getpid()}-abc.f32"
    other = tmp_path / "harness-ringside.txt"
    for p in (dead, mine, other):
        p.write_bytes(b"x")
    assert ring.sweep(tmp_path) == [dead]
    assert mine.exists() and other.exists() and not dead.exists()
    with ring.LogitRing(tmp_path, n_vocab=1000, rows=4, slots=3) as r:
        assert r.path.stat().st_size == 3 * 4 * 1000 * 4  # bounded by the ring, not by the prompt
        with pytest.raises(ValueError):
            r.read(3, 1)
    assert not r.path.exists()


def test_logits_each_is_one_worker_run_with_the_same_bytes_as_logits_per_prompt(monkeypatch):
    eng = LlamaCppEngine(fx.build("tiny-qwen35"))
    prompts = [TOKENS[:70], [5 + i % 190 for i in range(595)], TOKENS[:9]]  # 595 tokens: a longer context than the others
    alone = [gather(eng.logits(p), len(p)) for p in prompts]
    starts = []
    real = LlamaCppEngine._start
    monkeypatch.setattr(LlamaCppEngine, "_start", lambda self, *a, **k: starts.append(1) or real(self, *a, **k))
    each = [gather(s, len(p)) for s, p in zip(logits_each(eng, prompts), prompts)]
    assert len(starts) == 1
    assert all(np.array_equal(a, b) for a, b in zip(alone, each))
    timed = TimedEngine(eng)
    got = [gather(s) for s in timed.logits_each(prompts)]
    assert all(np.array_equal(a, b) for a, b in zip(alone, got))
    assert timed.timings()["tokens"] == sum(map(len, prompts))
    unread = logits_each(eng, prompts)
    next(unread)  # a stream left unread is read and dropped: the next prompt's rows are its own
    assert np.array_equal(gather(next(unread)), alone[1])


def test_logits_each_never_bypasses_a_wrapper_that_changes_logits():
    eng = PlantedEngine(LlamaCppEngine(fx.build("tiny-qwen35")), "nan-logits")
    rows = [gather(s) for s in logits_each(eng, [TOKENS, TOKENS[:50]])]
    assert np.isnan(rows[0]).any() and np.isnan(rows[1]).any()  # the plant's NaN row, not llama.cpp's rows


def test_the_reference_cache_computes_only_its_misses_in_one_run(tmp_path, monkeypatch):
    monkeypatch.setenv("HARNESS_REFERENCE_CACHE", str(tmp_path / "cache"))
    model = fx.build("tiny-qwen35")
    eng = LlamaCppEngine(model)
    prompts = [TOKENS[:40], TOKENS[:60], TOKENS]
    first = reference_cache.wrap(eng, "sha-x")
    list(first.logits(prompts[1]))  # one entry made the plain way
    starts = []
    real = LlamaCppEngine._start
    monkeypatch.setattr(LlamaCppEngine, "_start", lambda self, *a, **k: starts.append(a[0].get("prompts")) or real(self, *a, **k))
    cached = reference_cache.wrap(eng, "sha-x")
    got = [gather(s) for s in logits_each(cached, prompts)]
    assert [len(p["tokens"]) for p in starts[0]] == [40, 100] and len(starts) == 1  # the two misses, one worker
    assert cached._cache.hits == 1 and cached._cache.misses == 2
    assert all(np.array_equal(g, gather(eng.logits(p))) for g, p in zip(got, prompts))
    again = reference_cache.wrap(eng, "sha-x")
    assert [gather(s).shape[0] for s in logits_each(again, prompts)] == [40, 60, 100]
    assert again._cache.hits == 3 and again._cache.misses == 0


def test_sequences_side_by_side_get_a_context_that_holds_them_all():
    """One KV cache holds every sequence (kv_unified): three of 200, 150 and 230 tokens need more
    than the 512 positions the longest alone resolves to (llama.cpp refused them: 'failed to
    prepare attention ubatches')."""
    eng = LlamaCppEngine(fx.build("tiny-qwen35"))
    seqs = [[(7 * i + k) % 190 for i in range(n)] for k, n in enumerate((200, 150, 230))]
    rows = gather(eng.logits_multi(seqs), 580)
    assert rows.shape[0] == 580 and np.isfinite(rows).all()



def test_calibration_fetches_a_models_reference_rows_in_one_worker_run(monkeypatch):
    from harness.runs.calibrate.pairs import CachedReference as CalibrationReference

    eng = LlamaCppEngine(fx.build("tiny-qwen35"))
    prompts = [TOKENS[:30], TOKENS[:80], TOKENS[:30]]
    plain = CalibrationReference(eng)
    want = [plain.get(p) for p in prompts]
    starts = []
    real = LlamaCppEngine._start
    monkeypatch.setattr(LlamaCppEngine, "_start", lambda self, *a, **k: starts.append(1) or real(self, *a, **k))
    ref = CalibrationReference(eng)
    ref.prefetch(prompts)
    assert len(starts) == 1 and len(ref.cache) == 2  # the repeated prompt once
    assert all(np.array_equal(ref.get(p), w) for p, w in zip(prompts, want)) and len(starts) == 1


def test_the_example_engine_reuses_its_context_and_gives_the_bytes_of_a_fresh_one():
    """examples/llamacpp_engine.py keeps the context of plain logits requests and empties it
    (llama_memory_clear) for the next of the same shape: the rows are the bytes of a fresh
    context's, also after another prompt ran in it."""
    eng = _example(["logits_ring"])
    a, b = TOKENS[:90], TOKENS[10:100]
    first = gather(eng.logits(a))
    gather(eng.logits(b))
    assert np.array_equal(gather(eng.logits(a)), first)
    fresh = _example([], name="ex-other")  # another process: b first, then a in the context b left
    gather(fresh.logits(b))
    assert np.array_equal(gather(fresh.logits(a)), first) and engine_starts() == 2


@pytest.mark.skipif(ring.sealed_memfd(8) is None, reason="no sealed memfd on this system: the ring is a plain file read with preadv")
def test_a_sealed_ring_cannot_be_truncated_by_the_engine_and_is_read_through_its_mapping(tmp_path):
    with ring.LogitRing(tmp_path, n_vocab=100, rows=4, slots=2, sealed=True) as r:
        assert r.memfd and r._slots is not None and str(r.path).startswith("/proc/")
        assert list(tmp_path.iterdir()) == []  # nothing on a file system to sweep
        code = textwrap.dedent(f'''
            import os, numpy as np
            fd = os.open({str(r.path)!r}, os.O_RDWR)
            os.pwrite(fd, np.arange(400, dtype="<f4").tobytes(), 400 * 4)
            try:
                open({str(r.path)!r}, "wb")
                print("truncated")
            except PermissionError:
                print("refused")
            ''')
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
        assert out.stdout.strip() == "refused", out.stderr
        assert os.fstat(r.fd).st_size == 2 * 4 * 100 * 4
        assert r.read(1, 3).tobytes() == np.arange(300, dtype="<f4").tobytes()  # slot 1, rows 0..2
        path = r.path
    assert not path.exists()  # gone with its descriptor


def test_prestart_starts_a_protocol_2_engine_once_and_leaves_a_failed_start_to_the_request(tmp_path):
    from harness.engines.base import prestart

    eng = TimedEngine(_example(["logits_ring"]))
    prestart(eng)
    assert engine_starts() == 1  # running before any request
    prestart(eng)
    got = gather(eng.logits(TOKENS))
    assert got.shape[0] == len(TOKENS) and engine_starts() == 1  # the request used the process prestart made
    one = CommandEngine(CommandSpec("p1", [sys.executable, "-c", "pass"], 30.0, [], protocol=1), fx.build("tiny-qwen35"))
    prestart(one)
    assert engine_starts() == 1  # protocol 1 starts a process per request: nothing to start early
    missing = CommandEngine(CommandSpec("gone", [str(tmp_path / "no-such-engine")], 30.0, [], protocol=2), fx.build("tiny-qwen35"))
    prestart(missing)  # no error here
    with pytest.raises(EngineError, match="no-such-engine"):
        gather(missing.logits(TOKENS))
