"""Parity receipts: content-hash ids, schema, atomic npz-then-json writes, tamper detection."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

from harness.judge import verdicts
from harness.measure import metrics
from harness.errors import InvalidInput
from harness.evidence import receipts
from harness.evidence.receipts import (
    load_receipt,
    receipt_id,
    write_receipt,
)
from harness.judge.thresholds import load_thresholds
from harness.judge.tiers import Subject
from harness.provenance import sha256_file

REPO = Path(__file__).resolve().parents[1]
MODEL_SHA = "3" * 64


def make_receipt(seed: int = 0, n: int = 64, v: int = 97, noise: float = 0.01, verdict: str = "PASS") -> tuple[dict, dict]:
    """A schema-valid receipt built by the real metrics and thresholds code, and its arrays."""
    rng = np.random.default_rng(seed)
    ref = rng.standard_normal((n, v)).astype(np.float32) * 3
    cand = (ref + noise * rng.standard_normal((n, v))).astype(np.float32)
    pm = metrics.position_metrics(ref, cand)
    pm["prompt_index"] = np.zeros(n, np.int32)
    pm["position"] = np.arange(n, dtype=np.int32)
    s = metrics.summarize(pm)
    tokens = rng.integers(0, v, n).tolist()
    resolved = load_thresholds(REPO / "thresholds.yaml").resolve(Subject("F32", "ALL_F32", "f64", True, 8, 96, MODEL_SHA))
    release = verdicts.judge_release(pm, resolved.release_gates)
    calibrated = verdicts.judge_calibrated(pm, s, resolved.row, resolved.subject)
    receipt = {
        "kind": "parity",
        "host": receipts.host_info(),
        "harness": {"version": "0.1.0", "git_commit": None, "git_dirty": None},
        "command": ["harness", "parity", "--seed", str(seed)],
        "model": {"path": "fixtures/tiny.gguf", "name": "fixture:tiny", "sha256": MODEL_SHA, "arch": "qwen35", "file_type": "F32"},
        "engines": {
            "reference": {"name": "llama.cpp", "version": "b7000", "settings": {"n_ubatch": 512}, "capabilities": [], "build": {}},
            "candidate": {"name": "oracle", "version": "0.1.0", "settings": {}, "capabilities": ["chunks"], "build": {}},
        },
        "prompts": {
            "id": "test",
            "sha256": "4" * 64,
            "count": 1,
            "positions": n,
            "items": [{"id": "p0", "source": "ids", "tokens": tokens}],
        },
        "thresholds": resolved.to_receipt(),
        "gated": {
            "verdict": verdict,
            "metric": "cosine",
            "min_cosine": 0.98,
            "min_positions": 64,
            "positions": n,
            "failing_positions": 0,
            "min_cosine_observed": s["min_cosine"],
            "min_cosine_where": {"prompt": "p0", "position": s["min_cosine_index"], "token": tokens[s["min_cosine_index"]]},
            "nonfinite_positions": 0,
            "first_failing": None,
            "release": release.to_dict(),
            "calibrated": calibrated.to_dict(),
            "compute_class": "f64",
            "class_declared": True,
            "basis_kind": "measured",
        },
        "report_only": s,
        "per_prompt": [{"id": "p0", "positions": n, "min_cosine": s["min_cosine"]}],
    }
    return receipt, pm


def test_write_then_load_round_trips_and_names_files_by_content_hash(tmp_path):
    r, arrays = make_receipt()
    jp, npz = write_receipt(r, arrays, tmp_path / "receipts")
    loaded = load_receipt(jp)
    rid = loaded.receipt["id"]
    assert jp.name == f"{rid}.json" and npz.name == f"{rid}.npz"
    assert rid == receipt_id(loaded.receipt) and len(rid) == 64
    assert loaded.receipt["schema"] == "harness-parity-receipt/v1"
    assert loaded.receipt["gated"]["min_cosine_observed"] == r["gated"]["min_cosine_observed"]
    assert loaded.receipt["prompts"]["items"][0]["tokens"] == r["prompts"]["items"][0]["tokens"]
    assert set(loaded.arrays) == set(arrays)
    for k, a in arrays.items():
        np.testing.assert_array_equal(loaded.arrays[k], a)
        assert loaded.arrays[k].dtype == a.dtype
    assert loaded.receipt["arrays"]["keys"]["cosine"] == {"dtype": "<f8", "shape": [64]}
    assert "id" not in r and "arrays" not in r  # the caller's dict is left alone
    assert sorted(p.name for p in jp.parent.iterdir()) == sorted([jp.name, npz.name])  # no temp files left


def test_id_excludes_created_and_covers_everything_else():
    r, _ = make_receipt()
    a = dict(r, created="2026-01-01T00:00:00Z")
    b = dict(r, created="2027-06-30T12:00:00Z")
    assert receipt_id(a) == receipt_id(b)
    assert receipt_id(dict(reversed(list(a.items())))) == receipt_id(a)  # key order is irrelevant
    c = json.loads(json.dumps(a))
    c["gated"]["positions"] = 65
    assert receipt_id(c) != receipt_id(a)


def test_same_measurement_twice_keeps_the_first_file(tmp_path):
    r, arrays = make_receipt()
    jp1, _ = write_receipt(dict(r, created="2026-01-01T00:00:00Z"), arrays, tmp_path)
    before = sha256_file(jp1)
    jp2, _ = write_receipt(dict(r, created="2026-02-02T00:00:00Z"), arrays, tmp_path)
    assert jp1 == jp2 and sha256_file(jp2) == before  # a ledger row's receipt hash stays valid


def test_npz_is_linked_into_place_before_json(tmp_path, monkeypatch):
    r, arrays = make_receipt()
    linked = []
    real_link = os.link
    monkeypatch.setattr(os, "link", lambda src, dst: (linked.append(Path(dst).suffix), real_link(src, dst)))
    write_receipt(r, arrays, tmp_path)
    assert linked == [".npz", ".json"]


def test_failed_json_write_leaves_no_json_and_no_temp_files(tmp_path, monkeypatch):
    r, arrays = make_receipt()
    real_dumps = json.dumps

    def failing_dumps(obj, *a, **kw):
        if kw.get("indent"):  # the pretty receipt text, written after the npz
            raise OSError(28, "No space left on device")
        return real_dumps(obj, *a, **kw)

    monkeypatch.setattr(receipts.json, "dumps", failing_dumps)
    with pytest.raises(InvalidInput, match="No space left"):
        write_receipt(r, arrays, tmp_path)
    names = [p.name for p in tmp_path.iterdir()]
    assert not any(n.endswith(".json") for n in names)
    assert not any(n.endswith(".tmp") for n in names)


def test_edited_receipt_is_detected(tmp_path):
    jp, _ = write_receipt(*make_receipt(), tmp_path)
    text = jp.read_text()
    jp.write_text(text.replace('"verdict": "PASS"', '"verdict": "FAIL"'))
    with pytest.raises(InvalidInput, match="not the content hash"):
        load_receipt(jp)


def test_replaced_or_missing_arrays_are_detected(tmp_path):
    r, arrays = make_receipt()
    jp, npz = write_receipt(r, arrays, tmp_path)
    changed = dict(arrays, cosine=arrays["cosine"] * 0.5)
    np.savez(npz, **changed)
    with pytest.raises(InvalidInput, match="arrays do not match"):
        load_receipt(jp)
    npz.unlink()
    with pytest.raises(InvalidInput, match="missing"):
        load_receipt(jp)


def test_pickled_npz_is_refused(tmp_path):
    r, arrays = make_receipt()
    jp, npz = write_receipt(r, arrays, tmp_path)
    np.savez(npz, **dict(arrays, cosine=np.array([{"x": 1}], dtype=object)))
    with pytest.raises(InvalidInput, match="cannot read receipt arrays"):
        load_receipt(jp)


@pytest.mark.parametrize(
    "mutate, match",
    [
        (lambda r: r.pop("engines"), "'engines' is a required property"),
        (lambda r: r.__setitem__("kind", "parity-ish"), "kind: 'parity-ish' is not one of"),
        (lambda r: r["model"].__setitem__("sha256", "xyz"), "model.sha256"),
        (lambda r: r["gated"].__setitem__("verdict", "OK"), "gated.verdict"),
        (lambda r: r["thresholds"]["release"]["min_cosine"].pop("basis"), "'basis' is a required property"),
        (lambda r: r["report_only"]["kld"].__setitem__("mean", float("nan")), r"report_only\.kld\.mean is not a finite number"),
    ],
)
def test_invalid_receipts_are_refused_naming_the_field(tmp_path, mutate, match):
    r, arrays = make_receipt()
    mutate(r)
    with pytest.raises(InvalidInput, match=match):
        write_receipt(r, arrays, tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_numpy_scalars_are_written_as_plain_json(tmp_path):
    r, arrays = make_receipt()
    r["gated"]["positions"] = np.int64(64)
    r["gated"]["min_cosine_observed"] = np.float64(r["gated"]["min_cosine_observed"])
    jp, _ = write_receipt(r, arrays, tmp_path)
    assert load_receipt(jp).receipt["gated"]["positions"] == 64


def test_object_arrays_are_refused(tmp_path):
    r, arrays = make_receipt()
    with pytest.raises(InvalidInput, match="dtype object"):
        write_receipt(r, dict(arrays, bad=np.array([None, 1], dtype=object)), tmp_path)


def _timing(wall: float, tps: float) -> dict:
    return {"wall_s": wall, "load_s": 0.5, "prefill_s": 64 / tps, "tokens": 64, "prefill_tokens_per_s": tps, "source": "engine"}


def test_timings_are_recorded_but_not_part_of_the_id(tmp_path):
    """Speed is evidence, but a measurement of this run: two identical runs at different speeds
    keep one receipt id (and the first file); the schema checks the timing fields."""
    r, arrays = make_receipt()
    fast = dict(r, timings={"reference": _timing(3.0, 900.0), "candidate": _timing(9.0, 120.0)})
    slow = dict(r, timings={"reference": _timing(4.0, 700.0), "candidate": _timing(12.0, 80.0)})
    assert receipt_id(fast) == receipt_id(slow) == receipt_id(r)
    jp, _ = write_receipt(fast, arrays, tmp_path)
    assert load_receipt(jp).receipt["timings"]["candidate"]["prefill_tokens_per_s"] == 120.0
    assert write_receipt(slow, arrays, tmp_path)[0] == jp and load_receipt(jp).receipt["timings"] == fast["timings"]
    bad = dict(r, timings={"reference": _timing(3.0, 900.0), "candidate": {**_timing(9.0, 120.0), "wall_s": -1}})
    with pytest.raises(InvalidInput, match="timings.candidate.wall_s"):
        write_receipt(bad, arrays, tmp_path / "bad")
