"""The reference's logits computed once (issue 47): a content-addressed cache shared by every
candidate of a sweep; entries verified before use, corrupt ones recomputed, strangers reported."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from harness.cli import main
from harness.engines.llamacpp import LlamaCppEngine
from harness.fixtures.synthetic import build
from harness.paths import SOURCE_ROOT
from harness.provenance import sha256_file
from harness.runs.reference_cache import CachedReference, ReferenceCache, cache_key

PROMPT = {"id": "numbers", "text": "0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 21 22 23"}
CANDIDATES = [("oracle", "f64"), ("oracle-f16", "f16"), ("mutant:qk-norm-skipped", "f64"), ("mutant:dt-bias-dropped", "f64")]


@pytest.fixture
def llama_starts(monkeypatch):
    """Every llama.cpp worker process started (``LlamaCppEngine._start`` spawns it): its op and
    the number of token ids it was given."""
    ops: list[tuple[str, int]] = []
    real = LlamaCppEngine._start

    def counted(self, request, workdir, *args, **kwargs):
        ops.append((request["op"], len(request.get("tokens") or ())))
        return real(self, request, workdir, *args, **kwargs)

    monkeypatch.setattr(LlamaCppEngine, "_start", counted)
    return ops


def _project(root: Path) -> Path:
    root.mkdir(parents=True)
    shutil_thresholds = SOURCE_ROOT / "thresholds.yaml"
    (root / "thresholds.yaml").write_bytes(shutil_thresholds.read_bytes())
    (root / "prompts.jsonl").write_text(json.dumps(PROMPT) + "\n")
    lines = ["schema: harness-release/v1", "release: cache-1", "prompts: prompts.jsonl",
             f"thresholds: {{path: thresholds.yaml, sha256: \"{sha256_file(root / 'thresholds.yaml')}\"}}", "probes: [split, decode, determinism]", "candidates:"]
    lines += [f'  - {{engine: "{c}", compute_class: {k}}}' for c, k in CANDIDATES]
    lines += ["models:", f'  - {{model: "fixture:tiny-qwen35", sha256: "{sha256_file(build("tiny-qwen35"))}"}}']
    (root / "release.yaml").write_text("\n".join(lines) + "\n")
    return root


def _receipts(root: Path) -> list[dict]:
    docs = [json.loads(p.read_text()) for p in sorted((root / "evidence" / "parity" / "receipts").rglob("*.json"))]
    return [d for d in docs if d.get("kind") == "parity"]


@pytest.mark.parametrize("cache", [True, pytest.param(False, marks=pytest.mark.slow)], ids=["cache-on", "cache-off"])
def test_a_sweep_of_4_candidates_runs_the_reference_once(tmp_path, monkeypatch, llama_starts, cache):
    root = _project(tmp_path / "p")
    monkeypatch.setenv("HARNESS_REFERENCE_CACHE", str(tmp_path / "cache") if cache else "off")
    monkeypatch.chdir(root)
    assert main(["sweep", "release.yaml"]) in (0, 1)  # the mutants FAIL; each cell ran
    receipts = _receipts(root)
    assert sorted(r["engines"]["candidate"]["name"] for r in receipts) == sorted(c for c, _ in CANDIDATES)
    n_prompt = {r["per_prompt"][0]["positions"] for r in receipts}
    assert len(n_prompt) == 1
    # the gated comparison: llama.cpp's logits over the prompt's token ids, once for 4 candidates
    assert llama_starts.count(("logits", n_prompt.pop())) == (1 if cache else 4)
    # report-only free-running greedy still generates per candidate, and scores a diverging
    # candidate's own continuation (other token ids: nothing to share)
    caches = [r["timings"]["reference_cache"] for r in receipts]
    if cache:
        assert sorted((c["hits"], c["misses"], c["from_cache"]) for c in caches) == [(0, 1, False)] + [(1, 0, True)] * 3
    else:
        assert caches == [{"enabled": False}] * 4


class _Fake:
    """A reference that counts its logits calls (rows: position + column / 1000)."""

    def __init__(self, n_vocab=7):
        from harness.engines.base import EngineInfo

        self.n_vocab, self.calls = n_vocab, 0
        self.info = EngineInfo(name="fake", version="1", settings={"type_k": "f16", "use_extra_bufts": False},
                               build={"cpu_features": "AVX2 = 1"})

    def logits(self, tokens, chunks=None):
        self.calls += 1
        rows = np.arange(len(tokens), dtype=np.float32)[:, None] + np.arange(self.n_vocab, dtype=np.float32) / 1000
        for s in range(0, len(tokens), 3):
            yield s, rows[s:s + 3]


def _read(engine, tokens):
    return np.concatenate([b for _, b in engine.logits(tokens)])


def test_a_corrupt_or_truncated_entry_is_recomputed_never_used_and_a_stranger_is_reported(tmp_path):
    fake = _Fake()
    tokens = list(range(10))
    first = _read(CachedReference(fake, ReferenceCache(tmp_path), "m" * 64), tokens)
    key, _ = cache_key("m" * 64, tokens, fake.info.to_dict())
    data = tmp_path / f"{key}.f32"
    assert data.stat().st_size == 10 * 7 * 4 and fake.calls == 1
    again = _read(CachedReference(fake, ReferenceCache(tmp_path), "m" * 64), tokens)
    assert fake.calls == 1 and np.array_equal(again, first)

    raw = bytearray(data.read_bytes())
    raw[8] ^= 0xFF  # one flipped byte: same size, wrong sha256
    data.write_bytes(bytes(raw))
    cache = ReferenceCache(tmp_path)
    assert np.array_equal(_read(CachedReference(fake, cache, "m" * 64), tokens), first) and fake.calls == 2
    assert any("sha256 of the rows does not match" in m for m in cache.invalid)

    data.write_bytes(data.read_bytes()[:100])  # truncated
    cache = ReferenceCache(tmp_path)
    assert np.array_equal(_read(CachedReference(fake, cache, "m" * 64), tokens), first) and fake.calls == 3
    assert any("truncated" in m for m in cache.invalid)

    (tmp_path / "notes.txt").write_text("x")
    cache = ReferenceCache(tmp_path)
    assert cache.invalid == ["notes.txt: not a cache entry (ignored)"]
    _read(CachedReference(fake, cache, "m" * 64), tokens)
    assert fake.calls == 3 and cache.record()["from_cache"]


def test_no_reference_cache_runs_the_reference_and_says_so(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("HARNESS_REFERENCE_CACHE", str(tmp_path / "cache"))
    args = ["parity", "--model", "fixture:tiny-qwen35", "--candidate", "oracle", "--no-evidence", "--json", "--greedy-tokens", "0"]
    assert main(args) == 0
    assert json.loads(capsys.readouterr().out)["timings"]["reference_cache"]["misses"] > 0
    assert main(args) == 0
    first = json.loads(capsys.readouterr().out)["timings"]["reference_cache"]
    assert first["from_cache"] and first["misses"] == 0
    assert main([*args, "--no-reference-cache"]) == 0
    assert json.loads(capsys.readouterr().out)["timings"]["reference_cache"] == {"enabled": False}


def test_the_key_changes_with_each_input_it_names():
    info = _Fake().info.to_dict()
    base = cache_key("a" * 64, [1, 2, 3], info)[0]
    changed = [cache_key("b" * 64, [1, 2, 3], info)[0], cache_key("a" * 64, [1, 2, 4], info)[0],
               cache_key("a" * 64, [1, 2, 3], {**info, "settings": {**info["settings"], "type_k": "q8_0"}})[0],
               cache_key("a" * 64, [1, 2, 3], {**info, "settings": {**info["settings"], "use_extra_bufts": True}})[0],
               cache_key("a" * 64, [1, 2, 3], {**info, "build": {"cpu_features": "AVX512 = 1"}})[0]]
    assert len({base, *changed}) == 6
    # what llama.cpp's log said after a decode is no input: the key before and after it is the same
    assert cache_key("a" * 64, [1, 2, 3], {**info, "settings": {**info["settings"], "flash_attn_ran": "enabled"}})[0] == base


def test_an_early_stop_leaves_no_entry_and_eviction_keeps_the_bound(tmp_path):
    fake = _Fake()
    it = CachedReference(fake, ReferenceCache(tmp_path), "m" * 64).logits(list(range(10)))
    next(it)
    it.close()
    assert not list(tmp_path.glob("*.f32")) and not list(tmp_path.glob(".tmp-*"))
    cache = ReferenceCache(tmp_path, max_bytes=(11 + 12) * 7 * 4)
    for n in (10, 11, 12):  # the third entry pushes the oldest out
        _read(CachedReference(fake, cache, "m" * 64), list(range(n)))
    assert len(list(tmp_path.glob("*.f32"))) == 2
    assert cache_key("m" * 64, list(range(10)), fake.info.to_dict())[0] not in {p.stem for p in tmp_path.glob("*.f32")}


def test_a_cache_folder_that_cannot_be_made_leaves_the_cache_off(tmp_path, monkeypatch):
    from harness.runs import reference_cache

    (tmp_path / "file").write_text("x")
    monkeypatch.setenv("HARNESS_REFERENCE_CACHE", str(tmp_path / "file" / "cache"))
    fake = _Fake()
    engine = reference_cache.wrap(fake, "m" * 64)
    assert engine is fake and reference_cache.record_of(engine) == {"enabled": False}
