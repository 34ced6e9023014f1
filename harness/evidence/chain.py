"""The chained append: the ledger's file lock, the head a new row chains from, and the one line written.

``append`` takes the lock (``ledger_lock``), reads only the ledger's last line
(``check_ledger_head``, backwards from the end), asks its caller for the row (the evidence door,
``harness.evidence.record.record``, writes the receipt at that point), links the row after the
head (``seq``, ``time``, ``prev_hash``, validated, ``row_hash``), appends its canonical JSON with
an fsync and, still under the lock, calls back for the renderings (LEDGER.md, the index).
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping

from filelock import FileLock, Timeout

from harness import display
from harness.errors import InvalidInput
from harness.evidence.ledger_cache import MAX_SEQ
from harness.evidence.receipts import canonical_json, utc_now
from harness.evidence.rows import GENESIS, _complete, _parse_lines, _read, _validate_row, row_hash
from harness.provenance import sha256_file

__all__ = ["LOCK_NOTICE_EVERY_S", "LOCK_NOTICE_S", "MakeRow", "Timeout", "append", "check_ledger_head", "ledger_lock"]


def _bind_receipt(new: dict[str, Any], receipt_path: Path) -> None:
    """Set the row's ``receipt_id`` (the file's stem) unless given, check a given one names this
    file, and set ``receipt_sha256`` from the file's bytes. Raises ``InvalidInput``."""
    if new.get("receipt_id") is None:
        new["receipt_id"] = receipt_path.stem
    elif new["receipt_id"] != receipt_path.stem:
        raise InvalidInput(f"row names receipt {new['receipt_id']} but the receipt file is {receipt_path.name}")
    new["receipt_sha256"] = sha256_file(receipt_path)


def _chain(new: dict[str, Any], head: dict[str, Any] | None, rows: list[dict[str, Any]] | None, ledger_path: Path) -> None:
    """Link ``new`` after ``head`` (None: the first row): ``seq``, ``time`` (unless given),
    ``prev_hash``, then validate it against the row schema and its supersede target (among
    ``rows`` when given, else by seq: a chain's seqs run 1..head without gaps), then set
    ``row_hash``. Raises ``InvalidInput``."""
    if head and head["seq"] >= MAX_SEQ:
        raise InvalidInput(f"{ledger_path}: the last row's seq {str(head['seq'])[:30]} leaves no room for another (at most 2**63-1); "
                           "run `harness ledger verify`")
    new["seq"] = head["seq"] + 1 if head else 1
    new.setdefault("time", None)
    if new["time"] is None:
        new["time"] = utc_now()
    new["prev_hash"] = head["row_hash"] if head else GENESIS
    new["row_hash"] = GENESIS  # placeholder so the schema sees every field
    err = _validate_row(new)
    if err:
        raise InvalidInput(f"ledger row: {err}")
    if new["kind"] == "supersede":
        target = new["supersedes"]
        known = any(r.get("seq") == target for r in rows) if rows is not None else 1 <= target <= (head["seq"] if head else 0)
        if not known:
            raise InvalidInput(f"{ledger_path}: cannot supersede seq {target}: no such row")
    new["row_hash"] = row_hash(new)


LOCK_NOTICE_S = 5.0
"""After this many seconds waiting for the ledger lock, ``ledger_lock`` says so on stderr, then
every ``LOCK_NOTICE_EVERY_S``: a wait on a lock held by another live process is never silent."""
LOCK_NOTICE_EVERY_S = 30.0


@contextlib.contextmanager
def ledger_lock(ledger_path: Path, timeout: float, notice: Any = None) -> Iterator[None]:
    """Hold the ledger's file lock (``<ledger>.lock``, ``filelock``), waiting at most ``timeout``
    seconds; while it waits longer than ``LOCK_NOTICE_S`` a line goes to ``notice`` (default:
    stderr) then every ``LOCK_NOTICE_EVERY_S``: ``harness: waiting for the ledger lock … (held by
    another process; N s of at most T s)``. Raises ``filelock.Timeout`` when the time runs out."""
    lock = FileLock(str(ledger_path) + ".lock")
    say = notice or (lambda line: print(line, file=sys.stderr, flush=True))
    t0 = time.monotonic()
    step = min(LOCK_NOTICE_S, timeout)
    while True:
        try:
            lock.acquire(timeout=step)
            break
        except Timeout:
            waited = time.monotonic() - t0
            if waited >= timeout:
                raise
            say(display.plain(f"harness: waiting for the ledger lock {ledger_path}.lock (held by another process; "
                              f"{waited:.0f} s of at most {timeout:g} s)"))
            step = min(LOCK_NOTICE_EVERY_S, timeout - waited)
    try:
        yield
    finally:
        lock.release()


def _new_row(row: Mapping[str, Any], receipt_path: str | Path | None = None) -> dict[str, Any]:
    """The content of a row to append: ``row``'s fields, missing content fields as null, without
    the fields the chain owns (``seq``, ``prev_hash``, ``row_hash``) and, given ``receipt_path``,
    bound to that file (``receipt_id`` its stem, ``receipt_sha256`` the sha256 of its bytes).
    Raises ``InvalidInput`` when ``row`` names another receipt than the file given."""
    new = _complete(row)
    for owned in ("seq", "prev_hash", "row_hash"):
        new.pop(owned, None)
    if receipt_path is not None:
        _bind_receipt(new, Path(receipt_path))
    return new


MakeRow = Callable[[], tuple[Mapping[str, Any], "Path | None"]]
"""What ``append`` asks for the row once the head is known to be extendable: the row's content
fields and the receipt file it binds (None: none), e.g. after writing that receipt."""


def append(ledger_path: Path, make_row: MakeRow, then: Callable[[dict[str, Any]], None] | None = None, *,
           lock_timeout: float = 120.0) -> dict[str, Any]:
    """Append one row under the ledger's lock (``ledger_lock``), as one critical section: read and
    check the head (``check_ledger_head``: only the last line is read), call ``make_row`` (the
    evidence door writes the receipt there, so nothing is written when the chain could not be
    extended), chain the row after the head (``seq``, ``time`` unless given, ``prev_hash``,
    validated, ``row_hash``), append its canonical JSON line with an fsync, call ``then(row)``
    (the door's renderings), release the lock; return the row.

    Raises ``InvalidInput`` when the row breaks the row schema, names another receipt than its
    file, supersedes a row that does not exist, when the ledger's last row is partial, malformed
    or edited, when the lock is not taken within ``lock_timeout`` seconds or when the ledger
    cannot be written; and whatever ``make_row`` and ``then`` raise."""
    try:
        ledger_path.parent.mkdir(parents=True, exist_ok=True)
        with ledger_lock(ledger_path, lock_timeout):
            head = check_ledger_head(ledger_path)
            row, receipt_path = make_row()
            new = _new_row(row, receipt_path)
            _chain(new, head, None, ledger_path)
            with open(ledger_path, "ab") as f:
                f.write(canonical_json(new) + b"\n")
                f.flush()
                os.fsync(f.fileno())
            if then is not None:
                then(new)
    except Timeout as e:
        raise InvalidInput(f"{ledger_path}: could not take the ledger lock within {lock_timeout:g} s") from e
    except OSError as e:
        raise InvalidInput(f"{ledger_path}: cannot append to the ledger: {e.strerror or e}") from None
    return new


def check_ledger_head(ledger_path: str | Path) -> dict[str, Any] | None:
    """The row a new row would chain from (None for an empty or missing ledger), checked as
    ``append_row`` checks it; raises ``InvalidInput`` when the ledger cannot be extended (a
    partial, malformed or edited last row, an unreadable file). Called before engines run."""
    ledger_path = Path(ledger_path)
    data = _tail_bytes(ledger_path)
    parsed = _parse_lines(data)
    try:
        return _check_head_for_append(ledger_path, data, parsed)
    except InvalidInput:
        # Name the line as before (line numbers need the whole file; this is the error path only).
        full = _read(ledger_path)
        _check_head_for_append(ledger_path, full, _parse_lines(full))
        raise


def _tail_bytes(ledger_path: Path, block: int = 1 << 16) -> bytes:
    """The ledger file's last line with its newline, read backwards from the end in
    ``block``-byte steps (the whole file when it has one line; the unterminated tail when it ends
    in a partial line); ``b""`` for a missing or empty file. Raises ``InvalidInput`` when the file
    cannot be read."""
    try:
        with open(ledger_path, "rb") as f:
            pos = f.seek(0, os.SEEK_END)
            buf = b""
            while pos > 0:
                step = min(block, pos)
                pos -= step
                f.seek(pos)
                buf = f.read(step) + buf
                if not buf.endswith(b"\n"):
                    return buf  # a partial last line: the caller refuses it
                cut = buf.rfind(b"\n", 0, len(buf) - 1)
                if cut >= 0:
                    return buf[cut + 1:]
            return buf
    except FileNotFoundError:
        return b""
    except OSError as e:
        raise InvalidInput(f"{ledger_path}: cannot read ledger: {e.strerror or e}") from e


def _check_head_for_append(ledger_path: Path, data: bytes, parsed: list) -> dict[str, Any] | None:
    if data and not data.endswith(b"\n"):
        partial = data.count(b"\n") + 1
        raise InvalidInput(f"{ledger_path}: ends in a partial row (line {partial}); run `harness ledger verify`")
    if not parsed:
        return None
    line, head, err = parsed[-1]
    if err:
        raise InvalidInput(f"{ledger_path}:{line}: last row is malformed ({err}); run `harness ledger verify`")
    if head.get("row_hash") != row_hash(head) or not isinstance(head.get("seq"), int):
        raise InvalidInput(f"{ledger_path}:{line}: last row (seq {head.get('seq')}) does not match its row_hash; run `harness ledger verify`")
    return head
