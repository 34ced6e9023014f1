"""The reference's logits computed once (issue 47): a content-addressed cache on disk.

A sign-off or a sweep over N candidates on one model compares each candidate with the same
reference rows (llama.cpp on the same token ids, same build, same settings). Like
``llama-perplexity --kl-divergence-base``, the rows are saved once and read back for every
later comparison.

Key: sha256 of a canonical JSON of the model file's sha256, the token ids, the reference
engine's name, version and build (``info.build``: its ``cpu_features`` line, llama.cpp's
``llama_print_system_info()``) and its settings (``info.settings``: threads, n_ctx, n_batch,
n_ubatch, ``type_k``/``type_v`` (KV type), ``use_extra_bufts`` (buffer setting), GGUF overrides),
and for an entry of a prompt's rows from a position on alone (``harness parity --text
--score-second-half``) that position, ``first_row``: such an entry never shares a key with the
prompt's full rows, and holds ``n_tokens`` − ``first_row`` rows.

An entry is two files in the cache folder: ``<key>.f32`` (the rows, little-endian float32,
C order, ``[n_tokens, n_vocab]``, exactly as the reference streamed them) and ``<key>.json``
(``n_tokens``, ``n_vocab``, ``dtype``, ``sha256`` of the ``.f32`` bytes, the key's inputs).
Both are written to temporary names and renamed (``os.replace``) under a ``filelock`` lock on
``<key>.lock``, held while the reference computes: a parallel job on the same key waits, then
reads the entry; a reader takes the same lock. Before use the ``.f32`` file's size and sha256 are
checked against its ``.json``: a corrupted or truncated entry is removed and recomputed, never
used. A file in the folder that is not a valid entry is ignored and reported (``invalid``).

Location: ``$HARNESS_REFERENCE_CACHE`` if set (``off``/``0``/empty turns the cache off), else
``$XDG_CACHE_HOME/qwen35-harness/reference`` (``~/.cache/qwen35-harness/reference``). Size bound:
``$HARNESS_REFERENCE_CACHE_MAX_GB`` (default 20 GB); after each write the least recently used
entries (by the ``.json`` file's mtime, touched on every hit; an entry whose lock is held is
kept) are removed until the folder fits.
One cell at 2,048 × 248,320 float32 is about 2 GB.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Sequence

import numpy as np
from filelock import FileLock, Timeout

from harness.engines.base import logits_each

DTYPE = "<f4"
DEFAULT_MAX_GB = 20.0
BLOCK_ROWS = 64
_CHUNK = 1 << 24
OBSERVED_SETTINGS = frozenset({"flash_attn_ran"})  # what an engine read from its own log, not what was asked


def default_dir() -> Path | None:
    """The cache folder from the environment (module docstring), or None when it is turned off."""
    env = os.environ.get("HARNESS_REFERENCE_CACHE")
    if env is not None:
        return None if env.strip().lower() in ("", "0", "off", "no", "false") else Path(env).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "qwen35-harness" / "reference"


def _max_bytes() -> int:
    try:
        return int(float(os.environ.get("HARNESS_REFERENCE_CACHE_MAX_GB", DEFAULT_MAX_GB)) * 1e9)
    except ValueError:
        return int(DEFAULT_MAX_GB * 1e9)


def _sha256_path(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def cache_key(model_sha256: str, tokens: Sequence[int], info: dict[str, Any], first_row: int = 0) -> tuple[str, dict[str, Any]]:
    """The entry's key (sha256 hex) and the inputs it hashes. ``info``: the reference's
    ``EngineInfo.to_dict()`` (name, version, settings, build); ``first_row`` > 0: an entry of the
    rows from that position on alone (``--score-second-half``), hashed with it, so it never
    shares a key with the prompt's full rows (an entry of every row hashes no ``first_row``:
    the keys made before it existed stay valid)."""
    toks = np.asarray([int(t) for t in tokens], dtype="<i8")
    # Observations recorded beside the settings after a decode (llama.cpp's ``flash_attn_ran``) are
    # not inputs: the key is made before and after the first decode alike.
    settings = {k: v for k, v in (info.get("settings") or {}).items() if k not in OBSERVED_SETTINGS}
    inputs = {"model_sha256": model_sha256, "tokens_sha256": hashlib.sha256(toks.tobytes()).hexdigest(), "n_tokens": int(toks.size),
              "engine": info.get("name"), "version": info.get("version"), "settings": settings,
              "build": info.get("build", {})}
    if first_row:
        inputs["first_row"] = int(first_row)
    blob = json.dumps(inputs, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest(), inputs


@dataclass
class ReferenceCache:
    """The cache folder and what this run did with it: ``hits``/``misses`` (prompts), ``invalid``
    (files that were not valid entries, each ``"name: why"``; corrupted entries among them are
    removed and recomputed)."""

    root: Path
    max_bytes: int = field(default_factory=_max_bytes)
    hits: int = 0
    misses: int = 0
    invalid: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        self._scan()

    def _scan(self) -> None:
        """Report files that are not part of an entry (never read as one)."""
        for p in sorted(self.root.iterdir()):
            stem, suf = p.stem, p.suffix
            ok_name = len(stem) == 64 and all(c in "0123456789abcdef" for c in stem) and suf in (".f32", ".json", ".lock")
            if not ok_name and not p.name.startswith(".tmp"):
                self.invalid.append(f"{p.name}: not a cache entry (ignored)")

    def record(self) -> dict[str, Any]:
        """The receipt's ``reference_cache`` field."""
        return {"enabled": True, "dir": str(self.root), "hits": self.hits, "misses": self.misses,
                "from_cache": self.hits > 0 and self.misses == 0, "invalid": list(self.invalid)}

    def _lock(self, key: str) -> FileLock:
        return FileLock(str(self.root / f"{key}.lock"))

    def load(self, key: str, n_tokens: int) -> np.ndarray | None:
        """The entry's rows (a read-only memory map ``[n_tokens, n_vocab]`` float32, ``n_vocab``
        from its ``.json``) once its size and sha256 match; None when there is none. A
        mismatching entry is removed and reported. The caller holds the key's lock."""
        meta_p, data_p = self.root / f"{key}.json", self.root / f"{key}.f32"
        if not meta_p.exists() and not data_p.exists():
            return None
        why, n_vocab = self._invalid_reason(meta_p, data_p, n_tokens)
        if why:
            self.invalid.append(f"{key[:16]}: {why} (removed, recomputed)")
            for p in (meta_p, data_p):
                p.unlink(missing_ok=True)
            return None
        os.utime(meta_p)
        return np.memmap(data_p, dtype=DTYPE, mode="r", shape=(n_tokens, n_vocab))

    @staticmethod
    def _invalid_reason(meta_p: Path, data_p: Path, n_tokens: int) -> tuple[str | None, int]:
        try:
            meta = json.loads(meta_p.read_text())
            n_rows, n_vocab, dtype, sha = int(meta["n_tokens"]), int(meta["n_vocab"]), str(meta["dtype"]), str(meta["sha256"])
        except (OSError, ValueError, KeyError, TypeError):
            return "metadata missing or unreadable", 0
        if (n_rows, dtype) != (n_tokens, DTYPE) or n_vocab <= 0:
            return f"{n_rows} rows of {n_vocab} {dtype} do not match {n_tokens} rows of {DTYPE}", 0
        if not data_p.exists() or data_p.stat().st_size != n_tokens * n_vocab * 4:
            return "rows truncated or missing", 0
        if _sha256_path(data_p) != sha:
            return "sha256 of the rows does not match", 0
        return None, n_vocab

    def store(self, key: str, inputs: dict[str, Any], blocks: Iterator[tuple[int, np.ndarray]],
              n_tokens: int) -> Iterator[tuple[int, np.ndarray]]:
        """Pass ``blocks`` through while writing them to a temporary file; once all ``n_tokens``
        rows went by, rename it (with its ``.json``) into place under the lock. A stream that
        stops early or raises leaves no entry. An entry of the rows from position
        ``inputs["first_row"]`` on holds those rows alone (``n_tokens`` of them), the blocks'
        starts being positions."""
        first = int(inputs.get("first_row", 0))
        fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".f32", dir=self.root)
        h, rows, done, n_vocab = hashlib.sha256(), 0, False, 0
        try:
            with os.fdopen(fd, "wb") as f:
                for start, block in blocks:
                    b = np.ascontiguousarray(block, dtype=DTYPE)
                    if b.ndim != 2 or (n_vocab and b.shape[1] != n_vocab) or start - first != rows:
                        rows = -1  # malformed: the consumer rejects it; nothing is stored
                    if rows >= 0:
                        n_vocab = b.shape[1]
                        f.write(b.data)
                        h.update(b.data)
                        rows += b.shape[0]
                    yield start, block
            done = rows == n_tokens
            if done:
                self._commit(key, inputs, Path(tmp), h.hexdigest(), n_tokens, n_vocab)
        finally:
            if not done:
                Path(tmp).unlink(missing_ok=True)

    def _commit(self, key: str, inputs: dict[str, Any], tmp: Path, sha: str, n_tokens: int, n_vocab: int) -> None:
        meta = {"n_tokens": n_tokens, "n_vocab": n_vocab, "dtype": DTYPE, "sha256": sha, "inputs": inputs}
        fd, tmp_meta = tempfile.mkstemp(prefix=".tmp-", suffix=".json", dir=self.root)
        with os.fdopen(fd, "w") as f:
            json.dump(meta, f, sort_keys=True)
        os.replace(tmp, self.root / f"{key}.f32")  # the caller holds the key's lock
        os.replace(tmp_meta, self.root / f"{key}.json")
        self.evict(keep=key)

    def evict(self, keep: str | None = None) -> list[str]:
        """Remove least-recently-used entries (``.json`` mtime) until the folder's entries fit
        ``max_bytes``; ``keep`` is never removed. Returns the keys removed."""
        entries = []
        for meta_p in self.root.glob("*.json"):
            data_p = meta_p.with_suffix(".f32")
            try:
                entries.append((meta_p.stat().st_mtime, meta_p.stem, data_p.stat().st_size if data_p.exists() else 0))
            except OSError:
                continue
        total, removed = sum(e[2] for e in entries), []
        for _, key, size in sorted(entries):
            if total <= self.max_bytes:
                break
            if key == keep:
                continue
            lock = self._lock(key)
            try:
                lock.acquire(timeout=0)  # an entry in use (read or computed elsewhere) stays
            except Timeout:
                continue
            try:
                for suf in (".json", ".f32"):
                    (self.root / f"{key}{suf}").unlink(missing_ok=True)
            finally:
                lock.release()
            total -= size
            removed.append(key)
        return removed


class CachedReference:
    """A reference engine whose ``logits(tokens)`` come from ``cache`` when an entry for
    (``model_sha256``, tokens, the engine's info) exists, else from the engine (streamed, and
    stored). Every other attribute is the wrapped engine's."""

    logits_each_first_rows = True
    """``logits_each`` takes ``first_rows`` (``harness.engines.base.logits_each``): those entries
    are keyed with their first row (``cache_key``)."""

    def __init__(self, engine: Any, cache: ReferenceCache, model_sha256: str):
        self._engine, self._cache, self._model_sha256 = engine, cache, model_sha256

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    def logits(self, tokens: Sequence[int], chunks: Sequence[int] | None = None) -> Iterator[tuple[int, np.ndarray]]:
        """Blocks ``(start, [B, n_vocab] float32)`` in position order, as ``Engine.logits``."""
        if chunks is not None:
            yield from self._engine.logits(tokens, chunks)
            return
        yield from self._via_cache(tokens, lambda: self._engine.logits(tokens))

    def logits_each(self, prompts: Sequence[Sequence[int]],
                    first_rows: Sequence[int] | None = None) -> Iterator[Iterator[tuple[int, np.ndarray]]]:
        """Each prompt's blocks, as ``logits``; the prompts without an entry are computed by one
        ``harness.engines.base.logits_each`` of the engine (one worker run for all of them). A prompt
        counted as a miss whose entry another job has written meanwhile is read from the cache (its
        computed rows are dropped unread). ``first_rows``: prompt i's rows from ``first_rows[i]``
        on alone (``harness.engines.base.logits_each``), asked of the engine and cached so."""
        info = self._engine.info.to_dict()
        firsts = [int(k) for k in first_rows] if first_rows is not None else [0] * len(prompts)
        missing = [i for i, p in enumerate(prompts)
                   if not (self._cache.root / f"{cache_key(self._model_sha256, p, info, firsts[i])[0]}.json").exists()]
        computed = logits_each(self._engine, [prompts[i] for i in missing], [firsts[i] for i in missing] if first_rows is not None else None)
        for i, p in enumerate(prompts):
            if i in missing:
                stream = next(computed)
                yield self._via_cache(p, lambda s=stream: s, firsts[i])
            elif firsts[i]:
                yield self._via_cache(p, lambda k=firsts[i], q=p: next(logits_each(self._engine, [q], [k])), firsts[i])
            else:
                yield self.logits(p)
        for _ in computed:  # lets the engine's run end and check itself
            pass

    def _via_cache(self, tokens: Sequence[int], compute: Any, first_row: int = 0) -> Iterator[tuple[int, np.ndarray]]:
        """The entry's rows when it exists and verifies, else ``compute()``'s stream, passed through
        and stored. The key's lock is held while the reference computes: a parallel job waits, then
        reads the entry. ``first_row``: the entry of the rows from that position on."""
        n = len(tokens) - first_row
        key, inputs = cache_key(self._model_sha256, tokens, self._engine.info.to_dict(), first_row)
        lock = self._cache._lock(key)
        lock.acquire()
        try:
            rows = self._cache.load(key, n)
            if rows is None:
                self._cache.misses += 1
                yield from self._cache.store(key, inputs, compute(), n)
                return
        finally:
            lock.release()
        self._cache.hits += 1
        for s in range(0, n, BLOCK_ROWS):
            yield first_row + s, np.array(rows[s:s + BLOCK_ROWS])


def wrap(engine: Any, model_sha256: str, enabled: bool = True) -> Any:
    """``engine`` behind the cache (``CachedReference``) when ``enabled`` and the environment
    names a folder (``default_dir``) that can be made and listed; else ``engine`` itself (the
    reference is computed, the receipt says the cache was off)."""
    root = default_dir() if enabled else None
    if root is None:
        return engine
    try:
        return CachedReference(engine, ReferenceCache(root), model_sha256)
    except OSError:  # an unwritable cache folder costs time, never the run
        return engine


def record_of(engine: Any) -> dict[str, Any]:
    """The receipt's ``timings.reference_cache``: ``ReferenceCache.record()`` of a
    ``CachedReference``, else ``{"enabled": False}``."""
    return engine._cache.record() if isinstance(engine, CachedReference) else {"enabled": False}
