"""The parsed-thresholds cache (``harness.judge.parsed_cache``, issue 47): a hit returns the same
data as a parse, a changed byte misses, a corrupt entry is never used, and a file that breaks a
rule is refused with its line whether or not a cache entry exists."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from harness.errors import InvalidInput
from harness.judge import parsed_cache
from harness.judge.thresholds import load_thresholds
from harness.paths import SOURCE_ROOT

SHIPPED = SOURCE_ROOT / "thresholds.yaml"


@pytest.fixture()
def cache(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("HARNESS_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("HARNESS_NO_PARSE_CACHE", raising=False)
    return tmp_path / "cache" / "thresholds-parsed"


def _copy(tmp_path: Path, text: str | None = None) -> Path:
    p = tmp_path / "thresholds.yaml"
    p.write_text(text if text is not None else SHIPPED.read_text(encoding="utf-8"), encoding="utf-8")
    return p


def test_a_cache_hit_returns_what_the_parse_returned_and_skips_the_parse(cache, tmp_path, monkeypatch):
    p = _copy(tmp_path)
    first = load_thresholds(p)
    entries = list(cache.glob("*.json"))
    assert len(entries) == 1
    import harness.judge.thresholds as T

    def no_parse(*a, **k):
        raise AssertionError("parsed although the cache holds these bytes")

    monkeypatch.setattr(T, "load_bounded", no_parse)
    second = load_thresholds(p)
    assert second.data == first.data and second.sha256 == first.sha256


def test_changed_bytes_miss_and_a_corrupt_entry_is_never_used(cache, tmp_path, monkeypatch):
    p = _copy(tmp_path)
    load_thresholds(p)
    (entry,) = cache.glob("*.json")
    doc = json.loads(entry.read_text())
    doc["data"]["release"]["min_cosine"]["value"] = 0.5  # tampered: its digest no longer matches
    entry.write_text(json.dumps(doc))
    assert parsed_cache.get(p.read_bytes()) is None
    assert load_thresholds(p).data["release"]["min_cosine"]["value"] != 0.5
    entry.write_text(entry.read_text()[:100])  # truncated
    assert parsed_cache.get(p.read_bytes()) is None
    p.write_text(p.read_text(encoding="utf-8") + "\n# one more byte\n", encoding="utf-8")
    assert parsed_cache.get(p.read_bytes()) is None


def test_a_file_breaking_a_rule_is_refused_with_its_line_even_with_a_cache_entry(cache, tmp_path, monkeypatch):
    text = SHIPPED.read_text(encoding="utf-8")
    p = _copy(tmp_path, text)
    raw = p.read_bytes()
    data = load_thresholds(p).data
    # An entry for these bytes whose data breaks the schema (as if a rule had changed and the
    # key had not): the checks still run on it, and the message comes from a real parse.
    bad = dict(data)
    bad.pop("release")
    monkeypatch.setattr(parsed_cache, "get", lambda r: bad if r == raw else None)
    assert load_thresholds(p).data == data
    p.write_text(text.replace("schema: harness-thresholds/v2", "schema: harness-thresholds/v2\nschema: again", 1), encoding="utf-8")
    with pytest.raises(InvalidInput, match=r"thresholds.yaml:\d+: duplicate key 'schema'"):
        load_thresholds(p)


def test_the_cache_can_be_turned_off(cache, tmp_path, monkeypatch):
    monkeypatch.setenv("HARNESS_NO_PARSE_CACHE", "1")
    load_thresholds(_copy(tmp_path))
    assert not cache.exists()
