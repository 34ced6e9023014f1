"""A content-addressed cache of validated thresholds files, so a run does not parse 600 kB of YAML.

``thresholds.yaml`` holds every calibrated row with its basis (about 600 kB, about 0.3 s to
compose and construct even with libyaml, the largest fixed cost of a short parity run: issue 47's
profile). Once a file's bytes have been parsed and passed every check, its data (plain JSON types:
the loader has already turned dates into text) is stored under
``<cache_root>/thresholds-parsed/<key>.json``, where the key is the sha256 of

- the file's bytes, and
- the source of the code that parses and checks it (``harness/judge/thresholds.py``,
  ``harness/yamlnodes.py``) and the schema file (``harness/schemas/thresholds.schema.json``),

so a changed file, a changed rule or a changed schema misses the cache and is parsed and checked
afresh. An entry carries the sha256 of its own data and is used only when that matches; an entry
that is not valid JSON, is truncated, or whose digest does not match is ignored (and overwritten
by the next successful parse). Entries are written to a temporary name and renamed, so a reader
never sees half an entry. The caller still runs the cheap checks (schema, finite values, row
rules) on a cached entry; only the YAML parse and the duplicate-key walk, both functions of the
bytes alone, are skipped. Size: one entry per distinct thresholds file and harness version,
about 0.6 MB each; nothing evicts them (``rm -r`` the folder to reclaim). A cache folder that
cannot be written leaves every run correct, only slower. ``HARNESS_NO_PARSE_CACHE=1`` turns the
cache off.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any

from harness.errors import InvalidInput
from harness.fschecks import require_writable_dir
from harness.paths import PACKAGE_DIR, SCHEMA_DIR, cache_root

FORMAT = "harness-thresholds-parsed/v1"
_SOURCES = (PACKAGE_DIR / "judge" / "thresholds.py", PACKAGE_DIR / "yamlnodes.py",
            SCHEMA_DIR / "thresholds.schema.json")


@functools.cache
def _code_digest() -> str:
    """sha256 over the parser's and checker's own sources and the schema (read once a process)."""
    h = hashlib.sha256(FORMAT.encode())
    for p in _SOURCES:
        h.update(p.read_bytes())
    return h.hexdigest()


def _folder() -> Path:
    return cache_root() / "thresholds-parsed"


def _enabled() -> bool:
    return os.environ.get("HARNESS_NO_PARSE_CACHE", "") in ("", "0")


def _key(raw: bytes) -> str:
    return hashlib.sha256(hashlib.sha256(raw).digest() + _code_digest().encode()).hexdigest()


def _data_digest(data: Any) -> str:
    return hashlib.sha256(json.dumps(data, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()).hexdigest()


def get(raw: bytes) -> Any | None:
    """The validated data stored for a thresholds file with bytes ``raw``, or None (no entry, the
    cache is off, or the entry is unreadable, corrupt or fails its own digest)."""
    if not _enabled():
        return None
    try:
        entry = json.loads((_folder() / f"{_key(raw)}.json").read_bytes())
        data = entry["data"]
        if entry.get("format") != FORMAT or entry.get("data_sha256") != _data_digest(data):
            return None
        return data
    except (OSError, ValueError, KeyError, TypeError):
        return None


def put(raw: bytes, data: Any) -> None:
    """Store ``data`` (plain JSON types) as the validated parse of the file with bytes ``raw``.
    Best effort: a folder that cannot be written, or data that is not JSON, stores nothing."""
    if not _enabled():
        return
    try:
        if json.loads(json.dumps(data, allow_nan=False)) != data:  # e.g. a non-text mapping key
            return
        entry = {"format": FORMAT, "data_sha256": _data_digest(data), "data": data}
        folder = _folder()
        require_writable_dir(folder, "thresholds parse cache")  # a read-only cache folder stays untouched, even for root
        folder.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=".tmp-", suffix=".json")
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                json.dump(entry, f, separators=(",", ":"), allow_nan=False)
            os.replace(tmp, folder / f"{_key(raw)}.json")
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    except (InvalidInput, OSError, TypeError, ValueError):
        return
