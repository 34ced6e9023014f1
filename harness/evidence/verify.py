"""Verifying a ledger: the chain, every row against its receipt, the rendering's head and pages.

``verify_ledger`` streams the ledger once (full, ``deep``, or ``incremental`` after a
``Checkpoint``); each finding is a ``Problem`` with a code, the seq and the line. What the chain
cannot do: someone who rewrites the file, recomputes every hash and re-renders LEDGER.md is caught
only by the receipts (a forged row has no receipt whose bytes and content match it) and by git
history.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from harness.errors import InvalidInput
from harness.evidence.pages import _PageCheck, _check_rendering, _write_text_atomic, default_markdown_path, page_of, page_seqs
from harness.evidence.receipts import SHARD_CHARS, load_receipt, receipt_file
from harness.evidence.rows import GENESIS, Problem, _validate_row, row_from_receipt, row_hash
from harness.fschecks import read_limited
from harness.provenance import sha256_file
from harness.validation import unique_keys


def _line_row_hash(raw: bytes, row: Mapping[str, Any]) -> str | None:
    """sha256 of the ledger line ``raw`` with its ``"row_hash":"…"`` member cut out: the row's
    hash without serializing it again, since ``append_row`` writes each row as its canonical JSON
    (sorted keys; cutting one member leaves the canonical JSON of the rest). None when the line
    holds no such member."""
    h = row.get("row_hash")
    if not isinstance(h, str):
        return None
    member = b'"row_hash":"' + h.encode("utf-8", errors="replace") + b'"'
    i = raw.find(member)
    if i <= 0:
        return None
    j = i + len(member)
    body = raw.rstrip(b"\n")
    cut = body[:i - 1] + body[j:] if body[i - 1:i] == b"," else body[:i] + body[j + 1:]
    return hashlib.sha256(cut).hexdigest()


def _row_problems(row: dict[str, Any], line: int, prev: dict[str, Any] | None, first: bool, seqs_max: int,
                  raw: bytes | None = None) -> list[Problem]:
    """The problems of one well-formed JSON row at ``line``: schema (MALFORMED), content hash
    (EDITED; from the line's bytes ``raw`` when given, ``_line_row_hash``, and from the parsed
    row when those do not match, so a line in another JSON layout is judged by its content),
    ``seq`` and ``prev_hash`` against the previous line's row ``prev`` (SEQUENCE, CHAIN;
    unchecked after a malformed line, ``prev`` None), supersede target among the earlier seqs,
    1..``seqs_max`` (SUPERSEDE)."""
    problems = []
    seq = row.get("seq") if isinstance(row.get("seq"), int) else None
    schema_err = _validate_row(row)
    if schema_err:
        problems.append(Problem("MALFORMED", schema_err, seq, line))
    fast = _line_row_hash(raw, row) if raw is not None else None
    if (fast is None or fast != row.get("row_hash")) and row.get("row_hash") != row_hash(row):
        problems.append(Problem("EDITED", "row_hash does not match the row's content: the row was edited", seq, line))
    if first:
        expected_seq, expected_prev, before = 1, GENESIS, "the genesis hash"
    elif prev is not None:
        expected_seq = prev["seq"] + 1 if isinstance(prev.get("seq"), int) else None
        expected_prev, before = prev.get("row_hash"), f"row seq {prev.get('seq')} (line {line - 1})"
    else:
        expected_seq = expected_prev = None
    if seq is not None and expected_seq is not None and seq != expected_seq:
        problems.append(Problem("SEQUENCE", f"seq {seq} where {expected_seq} was expected: rows removed, inserted or reordered", seq, line))
    if expected_prev is not None and row.get("prev_hash") != expected_prev:
        problems.append(
            Problem("CHAIN", f"prev_hash does not match {before}: a row was removed, inserted or reordered before this one", seq, line)
        )
    target = row.get("supersedes")
    if row.get("kind") == "supersede" and not (isinstance(target, int) and 1 <= target <= seqs_max):
        problems.append(Problem("SUPERSEDE", f"supersedes seq {row.get('supersedes')}, which is not an earlier row", seq, line))
    return problems


@dataclass
class VerifyStats:
    """What a ``verify_ledger`` run covered: ``rows`` checked (all of them, or those after the
    checkpoint), ``receipts`` hashed, ``deep`` receipts loaded and matched to their rows,
    ``skipped`` rows the checkpoint vouched for, ``seconds`` and the last row's ``seq``,
    ``row_hash`` and byte ``offset`` (what a checkpoint records)."""

    rows: int = 0
    receipts: int = 0
    deep: int = 0
    skipped: int = 0
    seconds: float = 0.0
    seq: int = 0
    row_hash: str = GENESIS
    offset: int = 0
    prefix_sha256: str = ""
    mode: str = "full"

    @property
    def rows_per_s(self) -> float:
        """Rows checked per second (0 when nothing was checked)."""
        return self.rows / self.seconds if self.seconds > 0 else 0.0


CHECKPOINT_MAX_BYTES = 64 << 10
"""A checkpoint is a few hundred bytes; a larger file is refused unread (``Checkpoint.load``)."""


@dataclass(frozen=True)
class Checkpoint:
    """The last row a verification found sound: its ``seq``, ``row_hash``, the ledger's byte
    count through that row (``offset``) and the sha256 of those bytes (``prefix_sha256``).

    Threat model: the checkpoint is what vouches for the rows before it, so it must not be
    writable by whoever can write the evidence. ``harness ledger verify`` keeps it outside the
    evidence folder (``default_checkpoint_path``: the user's state folder) and prints it, so CI
    can keep it in its log or cache and pass it back. An incremental run re-hashes the whole
    prefix (sha256 of its bytes, no parsing) and refuses the checkpoint (problem CHECKPOINT, exit
    1) when the bytes differ, the file is shorter, or the row at its end is not the row it
    names: an edited prefix is never reported OK. Receipts of rows before the checkpoint are not
    re-hashed by an incremental run (a full run does)."""

    ledger: str
    seq: int
    row_hash: str
    offset: int
    prefix_sha256: str

    def to_json(self) -> dict[str, Any]:
        """The checkpoint as written to its file."""
        return {"schema": "harness-verify-checkpoint/v1", "ledger": self.ledger, "seq": self.seq, "row_hash": self.row_hash,
                "offset": self.offset, "prefix_sha256": self.prefix_sha256}

    @classmethod
    def load(cls, path: str | Path) -> "Checkpoint | None":
        """The checkpoint in ``path`` (None when there is none). Raises ``InvalidInput`` for a file
        that is not a checkpoint."""
        if not Path(path).exists():
            return None
        raw = read_limited(path, "verify checkpoint", CHECKPOINT_MAX_BYTES)
        try:
            d = json.loads(raw.decode("utf-8"), object_pairs_hook=unique_keys)
        except (ValueError, RecursionError) as e:
            why = "nested too deeply" if isinstance(e, RecursionError) else str(e)[:200]
            raise InvalidInput(f"{path}: not a verify checkpoint: {why}") from None
        if not isinstance(d, dict) or d.get("schema") != "harness-verify-checkpoint/v1":
            raise InvalidInput(f"{path}: not a verify checkpoint (field 'schema')")
        for key, kind in (("ledger", str), ("seq", int), ("row_hash", str), ("offset", int), ("prefix_sha256", str)):
            if type(d.get(key)) is not kind or (kind is int and d[key] < 0):
                raise InvalidInput(f"{path}: not a verify checkpoint (field {key!r} must be a {'non-negative integer' if kind is int else 'string'})")
        return cls(d["ledger"], d["seq"], d["row_hash"], d["offset"], d["prefix_sha256"])

    def save(self, path: str | Path) -> Path:
        """Write the checkpoint to ``path`` (atomically; folders created)."""
        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        _write_text_atomic(p, json.dumps(self.to_json(), indent=1) + "\n")
        return p


def default_checkpoint_path(ledger_path: str | Path) -> Path:
    """Where ``harness ledger verify`` keeps a ledger's checkpoint: outside the evidence folder, in
    ``$HARNESS_VERIFY_STATE`` or ``$XDG_STATE_HOME/harness/verify`` (default
    ``~/.local/state/harness/verify``), named by the sha256 of the ledger's absolute path."""
    base = os.environ.get("HARNESS_VERIFY_STATE") or os.path.join(
        os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state"), "harness", "verify")
    key = hashlib.sha256(os.path.abspath(ledger_path).encode()).hexdigest()[:24]
    return Path(base) / f"{key}.json"


def _prefix_hasher(f, offset: int) -> "hashlib._Hash":
    """sha256 of the first ``offset`` bytes of ``f``, read in 1 MiB steps."""
    f.seek(0)
    h = hashlib.sha256()
    left = offset
    while left > 0:
        chunk = f.read(min(left, 1 << 20))
        if not chunk:
            break
        h.update(chunk)
        left -= len(chunk)
    return h


def verify_ledger(
    ledger_path: str | Path,
    receipts_dir: str | Path | None = None,
    markdown_path: str | Path | None = None,
    *,
    deep: bool = True,
    checkpoint: Checkpoint | None = None,
    incremental: bool = False,
    progress: Any = None,
    stats: VerifyStats | None = None,
) -> list[Problem]:
    """Check a ledger, streaming it line by line; return its problems in line order (empty: the
    ledger verifies).

    Per row: JSON and schema (MALFORMED), ``row_hash`` against the content (EDITED), ``seq``
    consecutive from 1 (SEQUENCE), ``prev_hash`` equal to the previous line's ``row_hash``
    (CHAIN: a row removed, inserted or reordered before it), supersede targets (SUPERSEDE). The
    rendering's head must be the last row (HEAD: e.g. the last row removed) and each page the
    rendering of its rows (MARKDOWN; ``render_page``). With ``receipts_dir``, every row's receipt
    ``.json`` (either layout, ``receipt_file``) must exist (RECEIPT-MISSING) and hash to
    ``receipt_sha256`` (RECEIPT-HASH); every receipt a sign-off relies on must exist, hash as it
    says and have a row before it (``_check_signoff``).

    ``deep`` also loads every receipt (schema, content id, arrays; RECEIPT-INVALID) and matches it
    to its row (RECEIPT-MISMATCH: a forged or altered row); that costs milliseconds a receipt. With
    a ``checkpoint`` (``Checkpoint``), rows up to it are deep-checked already: they are re-hashed,
    not re-loaded, unless the checkpoint does not match the ledger (problem CHECKPOINT, and
    every row is deep-checked). ``incremental`` checks only the rows after the checkpoint (its
    prefix is re-hashed as bytes: ``Checkpoint``) and LEDGER.md; older pages are left to a full
    run. ``progress(rows, bytes_done, bytes_total)`` is called about every 0.5 s; ``stats``
    (a ``VerifyStats``) is filled in.

    Cost: the ledger is read once (older pages are compared as the stream passes them,
    ``_PageCheck``), each row's hash is taken over its line's bytes (``_line_row_hash``) and
    each receipt's JSON is hashed on a few threads as the pass goes on (``_ReceiptHasher``), so a
    full run without ``deep`` costs about the bytes of the ledger and its receipts' JSON
    (docs/benchmarks.md, "Evidence at scale"). Without ``deep`` no array sidecar is read: an
    edited ``.npz`` is found only where ``deep`` applies (decoding one costs milliseconds).

    Raises ``InvalidInput`` when the ledger file cannot be read.
    Long because it is one streaming pass whose steps share the pass's running state (the chain, the page being checked, the checkpoint, the progress).
    """
    ledger_path = Path(ledger_path)
    md_path = Path(markdown_path) if markdown_path else default_markdown_path(ledger_path)
    st = stats if stats is not None else VerifyStats()
    st.mode = "incremental" if incremental else "deep" if deep and checkpoint is None else "full"
    t0 = time.perf_counter()
    if not ledger_path.exists():
        raise InvalidInput(f"{ledger_path}: no such ledger")
    problems: list[Problem] = []
    receipts = Path(receipts_dir) if receipts_dir is not None else None
    try:
        f = open(ledger_path, "rb")
    except OSError as e:
        raise InvalidInput(f"{ledger_path}: cannot read ledger: {e.strerror or e}") from e
    with f:
        total = f.seek(0, os.SEEK_END)
        start, line, prev, first, trusted_until = 0, 0, None, True, 0
        prefill: list[dict[str, Any]] = []
        prefix = hashlib.sha256()
        if checkpoint is not None:
            bad = _checkpoint_problem(f, total, checkpoint)
            if bad:
                problems.append(bad)
                if incremental:
                    st.seconds = time.perf_counter() - t0
                    return problems
            else:
                trusted_until = checkpoint.seq
                if incremental:
                    before = _lines_before(f, checkpoint.offset, checkpoint.seq - page_seqs(page_of(checkpoint.seq))[0] + 1)
                    prev = before[-1]
                    start, line, first, st.skipped = checkpoint.offset, checkpoint.seq, False, checkpoint.seq
                    prefill = [r for r in before if page_of(r["seq"]) == page_of(checkpoint.seq)]
        elif incremental:
            st.mode = "full"  # no checkpoint yet: everything is checked
        f.seek(start)
        seqs_max = prev["seq"] if prev else 0
        supersedes: list[tuple[int, int, int]] = []  # (seq, target, line)
        earlier: dict[str, str | None] = {}
        tail: list[dict[str, Any]] = prefill  # the rows of the newest page (the rendering's head page)
        offset, last_report = start, t0
        pages = None if incremental else _PageCheck(ledger_path, md_path)
        hasher = _ReceiptHasher(receipts, earlier, st) if receipts is not None else None  # receipts hashed in batches, on threads
        if start:
            prefix = _prefix_hasher(f, start)
            f.seek(start)
        for raw in f:
            line += 1
            offset += len(raw)
            prefix.update(raw)
            if not raw.endswith(b"\n"):
                problems.append(Problem("MALFORMED", "the file ends in a partial row (no final newline)", None, line))
                break
            try:
                row = json.loads(raw)
                err = None if isinstance(row, dict) else "not a JSON object"
            except (UnicodeDecodeError, json.JSONDecodeError) as e:
                row, err = None, f"not a JSON row: {e}"
            if err:
                m = re.search(rb'"seq":\s*(\d+)', raw)
                problems.append(Problem("MALFORMED", err, int(m.group(1)) if m else None, line))
                prev, first = None, False
                continue
            row_problems = _row_problems(row, line, prev, first, seqs_max, raw)
            problems += row_problems
            seq = row.get("seq") if isinstance(row.get("seq"), int) else None
            if seq is not None:
                seqs_max = max(seqs_max, seq)
            if row.get("kind") == "supersede" and isinstance(row.get("supersedes"), int):
                supersedes.append((seq or 0, row["supersedes"], line))
            if receipts is not None:
                row_deep = deep and (seq or 0) > trusted_until
                if not row_deep and row.get("kind") != "signoff" and isinstance(row.get("receipt_id"), str):
                    earlier.setdefault(row["receipt_id"], row.get("receipt_sha256"))  # before a later sign-off is checked
                    problems += hasher.add(row, line)
                else:
                    problems += _check_row_receipt(receipts, row, line, earlier, row_deep, st)
            if seq is not None:
                if tail and page_of(seq) != page_of(tail[-1]["seq"]):
                    if pages is not None:
                        pages.done(tail, offset - len(raw), supersedes)
                    tail = []
                if not tail and pages is not None:
                    pages.start = offset - len(raw)
                tail.append(row)
            st.rows += 1
            st.seq, st.row_hash, st.offset = seq or 0, row.get("row_hash") or "", offset
            prev, first = row, False
            if progress is not None and time.perf_counter() - last_report > 0.5:
                last_report = time.perf_counter()
                progress(st.rows, offset, total)
        if hasher is not None:
            problems += hasher.finish()
        st.prefix_sha256 = prefix.hexdigest() if st.offset == offset else ""
        problems += _check_rendering(f, ledger_path, md_path, prev, tail, supersedes, incremental, pages)
    if progress is not None:
        progress(st.rows, offset, total)
    st.seconds = time.perf_counter() - t0
    return sorted(problems, key=lambda p: (p.line or 0))


def _lines_before(f, offset: int, n: int) -> list[dict[str, Any]]:
    """The last ``n`` rows (parsed) of the lines that end at byte ``offset`` of ``f``, oldest
    first, read backwards in 64 KiB steps (fewer when the file starts sooner)."""
    pos, buf = offset, b""
    while pos > 0 and buf.count(b"\n") <= n:
        step = min(1 << 16, pos)
        pos -= step
        f.seek(pos)
        buf = f.read(step) + buf
    lines = buf.split(b"\n")[:-1]
    if pos > 0:
        lines = lines[1:]  # the first is cut
    out = []
    for raw in lines[-n:]:
        try:
            row = json.loads(raw)
        except ValueError:
            continue
        if isinstance(row, dict) and isinstance(row.get("seq"), int):
            out.append(row)
    return out


def _last_line_len(f, offset: int) -> int:
    """The length of the line that ends at byte ``offset`` of ``f`` (with its newline)."""
    back = min(offset, 1 << 16)
    f.seek(offset - back)
    buf = f.read(back)
    cut = buf.rfind(b"\n", 0, len(buf) - 1)
    return len(buf) - (cut + 1)


def _checkpoint_problem(f, total: int, cp: Checkpoint) -> Problem | None:
    """CHECKPOINT when the ledger's first ``cp.offset`` bytes do not hash to ``cp.prefix_sha256``
    or the row ending there is not ``cp.seq`` / ``cp.row_hash`` (``Checkpoint``)."""
    where = f"checkpoint seq {cp.seq} · row_hash {cp.row_hash[:12]}"
    if cp.offset <= 0 or total < cp.offset:
        return Problem("CHECKPOINT", f"the ledger is shorter than at {where} ({total} < {cp.offset} bytes): rows removed; refused")
    if _prefix_hasher(f, cp.offset).hexdigest() != cp.prefix_sha256:
        return Problem("CHECKPOINT", f"the ledger's rows up to {where} are not the bytes that were verified (edited?); refused: "
                       "run a full verification")
    n = _last_line_len(f, cp.offset)
    f.seek(cp.offset - n)
    try:
        row = json.loads(f.read(n))
    except ValueError:
        row = {}
    if not isinstance(row, dict) or row.get("seq") != cp.seq or row.get("row_hash") != cp.row_hash or row_hash(row) != cp.row_hash:
        return Problem("CHECKPOINT", f"the row at the end of the verified bytes is not {where} (checkpoint edited?); refused")
    return None


def _check_row_receipt(receipts: Path, r: dict[str, Any], line: int, earlier: dict[str, str | None], deep: bool,
                       st: VerifyStats, hashed: tuple[str, str | None] | None = None) -> list[Problem]:
    """The receipt checks of one row (``verify_ledger``): hashed always (``hashed``: what
    ``_hash_receipt`` gave, when it ran already), loaded and matched when ``deep``."""
    seq, rid = r.get("seq"), r.get("receipt_id")
    if r.get("kind") == "signoff":
        return _check_signoff(receipts, {**r, "_line": line}, earlier)
    if rid is None:
        if r.get("kind") in ("parity", "self-consistency"):
            return [Problem("RECEIPT-MISSING", "a parity row without a receipt_id", seq, line)]
        return []
    earlier.setdefault(rid, r.get("receipt_sha256"))
    path, digest = hashed or _hash_receipt(receipts, rid)
    if digest is None:
        return [Problem("RECEIPT-MISSING", f"receipt {path} does not exist (forged row?)", seq, line)]
    if digest.startswith("!"):
        return [Problem("RECEIPT-MISSING", f"{path}: cannot read: {digest[1:]}", seq, line)]
    st.receipts += 1
    if digest != r.get("receipt_sha256"):
        return [Problem("RECEIPT-HASH", f"{Path(path).name} does not hash to the row's receipt_sha256 (receipt or row altered)", seq, line)]
    if not deep:
        return []
    st.deep += 1
    try:
        receipt = load_receipt(path).receipt
    except InvalidInput as e:
        return [Problem("RECEIPT-INVALID", str(e), seq, line)]
    want = row_from_receipt(receipt)
    diff = [k for k, v in want.items() if r.get(k) != v]
    if diff:
        shown = ", ".join(f"{k}: row {r.get(k)!r} vs receipt {want[k]!r}" for k in diff)
        return [Problem("RECEIPT-MISMATCH", f"row disagrees with its receipt ({shown}): forged or altered row", seq, line)]
    return []


class _ReceiptHasher:
    """The receipt hashing of a ``verify_ledger`` pass, on a few threads while the pass goes on:
    rows are queued (``add``) and their receipts hashed in batches of ``BATCH`` (one task each:
    reads and sha256 release the GIL, so they overlap with the pass and with each other); up to
    two batches per thread are in flight before the oldest is collected and its rows checked
    (``_check_row_receipt``); ``finish`` collects the rest and stops the threads. Every queued
    row's receipt is hashed exactly once, from its own file."""

    BATCH = 128
    WORKERS = 4
    """Threads, whatever the core count: a read that misses the page cache waits on the disk, not
    the CPU, so more reads in flight than cores keep it busy."""

    def __init__(self, receipts: Path, earlier: dict[str, str | None], st: VerifyStats):
        self.receipts, self.earlier, self.st = receipts, earlier, st
        self.workers = self.WORKERS
        self.pool = ThreadPoolExecutor(max_workers=self.workers)
        self.rows: list[tuple[dict[str, Any], int]] = []
        self.inflight: deque = deque()

    def add(self, row: dict[str, Any], line: int) -> list[Problem]:
        """Queue ``row`` (at ``line``); the problems of a batch collected meanwhile."""
        self.rows.append((row, line))
        if len(self.rows) < self.BATCH:
            return []
        self._submit()
        return self._collect() if len(self.inflight) > 2 * self.workers else []

    def finish(self) -> list[Problem]:
        """Hash what is queued, collect every batch, stop the threads."""
        if self.rows:
            self._submit()
        problems = []
        while self.inflight:
            problems += self._collect()
        self.pool.shutdown()
        return problems

    def _submit(self) -> None:
        rids = [r["receipt_id"] for r, _ in self.rows]
        self.inflight.append((self.rows, self.pool.submit(lambda: [_hash_receipt(self.receipts, rid) for rid in rids])))
        self.rows = []

    def _collect(self) -> list[Problem]:
        rows, future = self.inflight.popleft()
        problems = []
        for (row, line), hashed in zip(rows, future.result()):
            problems += _check_row_receipt(self.receipts, row, line, self.earlier, False, self.st, hashed)
        return problems


_READ = threading.local()


def _sha256_of(path: str) -> str:
    """sha256 (hex) of the file at ``path``, read into this thread's 1 MiB buffer: no allocation
    a file (reading into a fresh ``bytes`` of the largest size costs a receipt more than its
    hashing). Raises ``OSError`` as ``open`` does."""
    view = getattr(_READ, "view", None)
    if view is None:
        view = _READ.view = memoryview(bytearray(1 << 20))
    h = hashlib.sha256()
    with open(path, "rb", buffering=0) as fh:
        while n := fh.readinto(view):
            h.update(view[:n])
    return h.hexdigest()


def _hash_receipt(receipts: Path, rid: Any) -> tuple[str, str | None]:
    """``(path, sha256 of its bytes)`` of receipt ``rid``'s ``.json`` in its shard, else in the
    flat layout (``receipt_file``'s order), read unbuffered into a reused buffer (``_sha256_of``)
    with no ``stat`` in the usual case; the digest is None when neither file exists and
    ``"!" + reason`` when the file cannot be read."""
    if not isinstance(rid, str) or not rid or "/" in rid or rid.startswith("."):
        return str(receipts / f"{rid}.json"), None
    base = str(receipts)
    for path in (os.path.join(base, rid[:SHARD_CHARS], rid + ".json"), os.path.join(base, rid + ".json")):
        try:
            return path, _sha256_of(path)
        except FileNotFoundError:
            continue
        except OSError as e:
            return path, "!" + str(e.strerror or e)
    return str(receipt_file(receipts, rid)), None


def _check_signoff(receipts_dir: Path, row: dict[str, Any], earlier: Mapping[str, str | None]) -> list[Problem]:
    """A sign-off row's receipts: each must exist (RECEIPT-MISSING), hash to the sha256 it names
    (RECEIPT-HASH) and have a row earlier in the chain with that id and hash (SIGNOFF-ORDER);
    ``earlier`` maps the receipt ids of the rows before it to their ``receipt_sha256``."""
    problems = []
    seq, line = row.get("seq"), row.get("_line")
    for ref in row.get("relied_on") or []:
        rid, sha = ref.get("id"), ref.get("sha256")
        path = receipt_file(receipts_dir, rid) if isinstance(rid, str) else receipts_dir / f"{rid}.json"
        if not path.exists():
            problems.append(Problem("RECEIPT-MISSING", f"sign-off relies on receipt {path}, which does not exist", seq, line))
        elif sha256_file(path) != sha:
            problems.append(Problem("RECEIPT-HASH", f"sign-off relies on {path.name}, which does not hash to the sha256 it names", seq, line))
        if rid not in earlier:
            problems.append(Problem("SIGNOFF-ORDER", f"sign-off relies on receipt {str(rid)[:12]}, which has no row before it in the chain", seq, line))
        elif earlier[rid] != sha:
            problems.append(Problem("SIGNOFF-ORDER", f"sign-off names receipt {str(rid)[:12]} with a sha256 other than its row's", seq, line))
    return problems
