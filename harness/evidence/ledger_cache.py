"""The ledger's query cache: an SQLite file beside ``ledger.jsonl`` that holds every row as columns.

``ledger.jsonl`` stays the record; this cache is derived from it and can be deleted at any time
(the next reader rebuilds it). It exists so that the things that grow with the ledger cost what
they read, not the ledger's size:

- an append reads only the rows it renders (one LEDGER.md page, one index page), by seq;
- ``harness ledger show`` and the trends read columns with ``pandas.read_sql_query`` instead of
  parsing 100,000 JSON lines;
- the reports index keeps each receipt's summary (``summaries``: the candidate engine's name and a
  mutant's bug class), so no receipt is read twice.

File: ``<ledger>.cache.sqlite`` (``ledger.jsonl.cache.sqlite``; git ignores ``*.cache.sqlite``).
Tables: ``rows`` (``seq`` primary key, the byte ``offset`` and ``length`` of its line, the raw
``line``, and one column per row field; lists and objects as JSON text), ``summaries``
(``receipt_id`` → ``candidate_name``, ``bug_class``), ``standing`` (``verdict`` → ``n``: the rows
that stand, kept up to date as rows arrive, so the index's counts do not scan the ledger),
``receipt_keys`` (``receipt_id`` → its typed input keys and time, so ``sweep`` and ``signoff``
read each receipt once: ``harness.release.cells.receipt_keys_of``) and
``meta`` (``size``: the ledger bytes the cache covers; ``last_line``: the last line it read;
``count``: the rows; ``index_seq``: the seq the reports index was last rendered to).

Staying in step (``sync``): the cache is current for a ledger whose first ``size`` bytes end in
``last_line``; new bytes after it are parsed and inserted (normally the one line just appended).
A ledger shorter than ``size``, or whose line at that place differs, is read again from the start.
An edit in the middle of the ledger that keeps its size and its last line is not seen by
``sync``; ``harness ledger verify`` reads the JSONL itself and finds it.

Trust: the cache is an index, never the source of a verdict. Every reader that judges or shows
verdicts (``harness signoff``, ``sweep``, ``ledger show``, a full render) opens it with
``check=True``: ``disagreement`` compares every line with the ledger's bytes and every column with
its line (O(ledger), about 0.55 s per 20,000 rows), and a cache that disagrees (an UPDATE of a
verdict column, an inserted row, an edit in the middle of the ledger) is rebuilt, ``rebuilt``
saying why. Appends do not check (their cost must not grow with the ledger). A row whose ``seq``
is beyond SQLite's INTEGER (``MAX_SEQ``) is a bad line; other integers beyond it are kept as their
digits. Reading stops before a line that is
not a JSON object (``bad_line`` says where), so the views show the rows up to it. When the cache
cannot be written (a read-only checkout), an in-memory copy is built for the process.
"""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence, TypeVar

T = TypeVar("T")

CACHE_SUFFIX = ".cache.sqlite"
_VERSION = "3"  # 2: the kept counts (meta count, table standing); 3: typed receipt keys (input:, cell:, same:)


def cache_path(ledger_path: str | Path) -> Path:
    """``<ledger>.cache.sqlite`` beside the ledger."""
    p = Path(ledger_path)
    return p.with_name(p.name + CACHE_SUFFIX)


MAX_SEQ = 2**63 - 1
"""The largest seq a row may have (SQLite's INTEGER); a row beyond it is a bad line, never an
``OverflowError``."""


def seq_problem(row: Any) -> str | None:
    """Why ``row`` (a parsed ledger line) cannot be a row of the cache, else None: not a JSON
    object, or a ``seq`` that is not an integer from 1 to ``MAX_SEQ``."""
    if not isinstance(row, dict):
        return "not a JSON object with a seq"
    seq = row.get("seq")
    if not isinstance(seq, int) or isinstance(seq, bool):
        return "not a JSON object with a seq"
    return None if 1 <= seq <= MAX_SEQ else f"seq {str(seq)[:30]} is out of range (1 to 2**63-1)"


def _sql_value(v: Any) -> Any:
    if isinstance(v, (dict, list)):
        return json.dumps(v, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    if isinstance(v, bool):
        return int(v)
    if isinstance(v, int) and not -MAX_SEQ - 1 <= v <= MAX_SEQ:  # beyond SQLite's INTEGER: kept as its digits
        return str(v)
    return v


def _same(a: Any, b: Any) -> bool:
    """``a`` and ``b`` are the same SQLite value (type and value; NaN is NaN)."""
    return type(a) is type(b) and (a == b or (isinstance(a, float) and a != a and b != b))


class LedgerCache:
    """An open cache for one ledger (``open``); ``columns`` are the row fields kept as columns.

    Use as a context manager or call ``close``. Every method reads or writes SQLite only; ``sync``
    reads the ledger's new bytes."""

    def __init__(self, ledger_path: Path, con: sqlite3.Connection, columns: Sequence[str], persistent: bool):
        self.ledger_path = ledger_path
        self.con = con
        self.columns = list(columns)
        self.persistent = persistent
        self.bad_line: tuple[int, str] | None = None
        """``(seq it would have, error)`` of the first line ``sync`` could not read, else None."""
        self.rebuilt: str | None = None
        """Why ``open(..., check=True)`` rebuilt the cache (``disagreement``), else None."""

    # ------------------------------------------------------------------ open / close

    @classmethod
    def open(cls, ledger_path: str | Path, columns: Sequence[str], check: bool = False) -> "LedgerCache":
        """Open (creating if needed) the cache of ``ledger_path`` and ``sync`` it. Falls back to an
        in-memory cache when the file cannot be created or is damaged. With ``check`` (what every
        reader that judges or shows verdicts asks for: ``signoff``, ``sweep``, ``ledger show``),
        the cache is compared with the ledger's bytes (``disagreement``, O(ledger)) and, when they
        disagree, rebuilt from the ledger, ``rebuilt`` saying why. Raises ``OSError`` only when the
        ledger itself cannot be read."""
        ledger_path = Path(ledger_path)
        path = cache_path(ledger_path)
        con, persistent = None, True
        try:
            con = sqlite3.connect(path, timeout=60.0, isolation_level=None)
            cls._schema(con, columns)
        except sqlite3.Error:
            if con is not None:
                con.close()
            try:  # a damaged or foreign file: start again (it is derived data)
                if path.is_file():
                    path.unlink()
                con = sqlite3.connect(path, timeout=60.0, isolation_level=None)
                cls._schema(con, columns)
            except (sqlite3.Error, OSError):
                con = sqlite3.connect(":memory:", isolation_level=None)
                cls._schema(con, columns)
                persistent = False
        self = cls(ledger_path, con, columns, persistent)
        self.sync()
        if check:
            why = self.disagreement()
            if why is not None:
                self.rebuild()
                self.rebuilt = why
        return self

    def rebuild(self) -> None:
        """Forget every derived table (rows, counts, receipt summaries and keys) and read the ledger
        again from its first byte; in memory when the file cannot be written."""
        try:
            self.con.execute("BEGIN IMMEDIATE")
            for table in ("rows", "standing", "summaries", "receipt_keys"):
                self.con.execute(f"DELETE FROM {table}")
            self.con.execute("DELETE FROM meta WHERE key IN ('size', 'last_line', 'index_seq', 'count')")
            self.con.execute("COMMIT")
        except sqlite3.Error:
            if self.con.in_transaction:
                self.con.execute("ROLLBACK")
            self.con.close()
            self.con = sqlite3.connect(":memory:", isolation_level=None)
            self._schema(self.con, self.columns)
            self.persistent = False
        self.sync()

    def disagreement(self) -> str | None:
        """Where this cache disagrees with the ledger, in words (None when it does not): a row
        whose line is not the ledger's bytes at its offset, a column that is not its line's field,
        a row the ledger does not have or lacks, or kept counts that are not the rows' counts. The
        cache is an index, never a source of a verdict: an edit to it (an UPDATE of a verdict
        column, an inserted row) is found here. O(ledger bytes): every line is read and parsed once."""
        name = cache_path(self.ledger_path).name
        cols = [c for c in self.columns if c != "seq"]
        names = ["seq", "offset", "length", "line", *cols]
        size = int(self.meta("size") or 0)
        cur = self.con.execute("SELECT " + ", ".join(f'"{c}"' for c in names) + " FROM rows ORDER BY seq")
        expect = n = 0
        try:
            f = open(self.ledger_path, "rb")
        except FileNotFoundError:
            return None if cur.fetchone() is None else f"{name} holds rows of a ledger that does not exist"
        with f:
            for stored in cur:
                n += 1
                seq, offset = stored[0], stored[1]
                raw = f.readline()
                if offset != expect or len(raw) != stored[2] or raw[:-1].decode("utf-8", errors="replace") != stored[3]:
                    return f"{name} row {seq}: its line is not the ledger's line {n} (byte {expect})"
                want = self._values(json.loads(stored[3]), offset, stored[2], stored[3])
                for col, a, b in zip(names, stored, want):
                    if not _same(a, b):
                        return f"{name} row {seq}: {col} is {str(a)[:40]!r} in the cache but {str(b)[:40]!r} in the ledger"
                expect += stored[2]
        if expect != size or n != self.count():
            return f"{name} covers {n} rows ({expect} bytes), not the {self.count()} rows ({size} bytes) it claims"
        if self.standing_counts() != self.standing_counts_scan():
            return f"{name}: its kept verdict counts {self.standing_counts()} are not its rows' {self.standing_counts_scan()}"
        return None

    @staticmethod
    def _schema(con: sqlite3.Connection, columns: Sequence[str]) -> None:
        cols = ", ".join(f'"{c}"' for c in columns if c != "seq")
        con.execute("PRAGMA journal_mode=DELETE")
        con.execute("PRAGMA synchronous=NORMAL")
        con.execute("CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT)")
        row = con.execute("SELECT value FROM meta WHERE key='columns'").fetchone()
        want = json.dumps([_VERSION, list(columns)])
        if row is not None and row[0] != want:  # written by another version: rebuild
            con.execute("DROP TABLE IF EXISTS rows")
            con.execute("DROP TABLE IF EXISTS summaries")
            con.execute("DROP TABLE IF EXISTS standing")
            con.execute("DROP TABLE IF EXISTS receipt_keys")
            con.execute("DELETE FROM meta")
        con.execute(f"CREATE TABLE IF NOT EXISTS rows (seq INTEGER PRIMARY KEY, offset INTEGER, length INTEGER, line TEXT, {cols})")
        con.execute("CREATE INDEX IF NOT EXISTS rows_receipt ON rows (receipt_id)")
        con.execute("CREATE INDEX IF NOT EXISTS rows_supersedes ON rows (supersedes)")
        con.execute("CREATE TABLE IF NOT EXISTS summaries (receipt_id TEXT PRIMARY KEY, candidate_name TEXT, bug_class TEXT)")
        con.execute("CREATE TABLE IF NOT EXISTS standing (verdict TEXT PRIMARY KEY, n INTEGER)")
        con.execute("CREATE TABLE IF NOT EXISTS receipt_keys (receipt_id TEXT, key TEXT, created TEXT, PRIMARY KEY (receipt_id, key))")
        if row is None or row[0] != want:  # a write only when the cache is new (each write transaction syncs)
            con.execute("INSERT OR REPLACE INTO meta VALUES ('columns', ?)", (want,))

    def close(self) -> None:
        """Close the SQLite connection."""
        self.con.close()

    def __enter__(self) -> "LedgerCache":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    @classmethod
    def use(cls, ledger_path: str | Path, columns: Sequence[str], fn: "Callable[[LedgerCache], T]") -> T:
        """``fn(cache)`` on the cache of ``ledger_path`` opened and synced (``open``), closed after,
        also when ``fn`` raises; returns what ``fn`` returns. The evidence door's one visit to the
        query cache (``harness.evidence.record``): open, sync and close are one call. Raises what
        ``open`` and ``fn`` raise."""
        cache = cls.open(ledger_path, columns)
        try:
            return fn(cache)
        finally:
            cache.close()

    # ------------------------------------------------------------------ meta

    def meta(self, key: str) -> str | None:
        """A ``meta`` value, or None."""
        row = self.con.execute("SELECT value FROM meta WHERE key=?", (key,)).fetchone()
        return None if row is None else row[0]

    def set_meta(self, key: str, value: Any) -> None:
        """Set a ``meta`` value (stored as text)."""
        self.con.execute("INSERT OR REPLACE INTO meta VALUES (?, ?)", (key, str(value)))

    # ------------------------------------------------------------------ sync

    def _covers(self, f) -> int:
        """The byte count the cache covers and that still ends in its ``last_line``; 0 when the
        cache must be rebuilt."""
        size = int(self.meta("size") or 0)
        last = self.meta("last_line")
        if size == 0 or last is None:
            return 0
        raw = last.encode("utf-8") + b"\n"
        if size < len(raw):
            return 0
        f.seek(size - len(raw))
        return size if f.read(len(raw)) == raw else 0

    def sync(self) -> int:
        """Bring the cache up to the ledger's bytes (module docstring); return the rows added. Long because the catch-up reads, parses and writes in one SQLite transaction, which must not be split."""
        try:
            f = open(self.ledger_path, "rb")
        except FileNotFoundError:
            self.con.execute("BEGIN IMMEDIATE")
            self.con.execute("DELETE FROM rows")
            self.con.execute("DELETE FROM standing")
            self.con.execute("DELETE FROM meta WHERE key='count'")
            self.set_meta("size", 0)
            self.con.execute("DELETE FROM meta WHERE key='last_line'")
            self.con.execute("COMMIT")
            return 0
        added = 0
        with f:
            self.con.execute("BEGIN IMMEDIATE")
            try:
                start = self._covers(f)
                if start == 0:
                    self.con.execute("DELETE FROM rows")
                    self.con.execute("DELETE FROM standing")
                    self.con.execute("DELETE FROM meta WHERE key IN ('size', 'last_line', 'index_seq', 'count')")
                f.seek(start)
                offset, last_line, batch, standing = start, None, [], []
                for raw in f:
                    if not raw.endswith(b"\n"):
                        break  # a partial last line: not a row yet
                    text = raw[:-1].decode("utf-8", errors="replace")
                    try:
                        row = json.loads(text)
                    except ValueError as e:
                        row, err = None, f"not a JSON row: {e}"
                    else:
                        err = seq_problem(row)
                    if err:
                        self.bad_line = (offset, err)
                        break
                    batch.append(self._values(row, offset, len(raw), text))
                    if start:
                        standing.append(row)
                    offset += len(raw)
                    last_line = text
                    if len(batch) >= 5000:
                        added += self._insert(batch)
                        self._count_standing(standing)
                if batch:
                    added += self._insert(batch)
                    self._count_standing(standing)
                if start == 0:  # rebuilt: count from the rows
                    self.con.executemany("INSERT INTO standing VALUES (?, ?)", list(self.standing_counts_scan().items()))
                    self.set_meta("count", self.con.execute("SELECT count(*) FROM rows").fetchone()[0])
                elif added:
                    self.set_meta("count", int(self.meta("count") or 0) + added)
                if last_line is not None:
                    self.set_meta("size", offset)
                    self.set_meta("last_line", last_line)
                self.con.execute("COMMIT")
            except BaseException:
                self.con.execute("ROLLBACK")
                raise
        return added

    def _values(self, row: dict[str, Any], offset: int, length: int, text: str) -> tuple:
        return (row["seq"], offset, length, text, *(_sql_value(row.get(c)) for c in self.columns if c != "seq"))

    def _count_standing(self, rows: list[dict[str, Any]]) -> None:
        """Keep ``standing`` (``{verdict: rows that stand}``) up to date with ``rows``, just
        inserted in seq order: a measurement row counts under its verdict; a supersede row takes
        its target out, unless the target is a supersede row, is missing or was withdrawn by an
        earlier supersede row (what ``standing_counts`` would count from scratch)."""
        delta: dict[str, int] = {}
        for r in rows:
            if r.get("kind") != "supersede":
                v = r.get("verdict") or "n/a"
                delta[v] = delta.get(v, 0) + 1
                continue
            t = r.get("supersedes")
            if not isinstance(t, int) or isinstance(t, bool):
                continue
            before = self.con.execute("SELECT count(*) FROM rows WHERE kind='supersede' AND supersedes=? AND seq < ?",
                                      (t, r["seq"])).fetchone()[0]
            target = self.con.execute("SELECT kind, verdict FROM rows WHERE seq=?", (t,)).fetchone()
            if before == 0 and target is not None and target[0] != "supersede":
                v = target[1] or "n/a"
                delta[v] = delta.get(v, 0) - 1
        rows.clear()
        self.con.executemany("INSERT INTO standing VALUES (?, ?) ON CONFLICT(verdict) DO UPDATE SET n = n + excluded.n",
                             list(delta.items()))

    def _insert(self, batch: list[tuple]) -> int:
        cols = ", ".join(["seq", "offset", "length", "line"] + [f'"{c}"' for c in self.columns if c != "seq"])
        marks = ", ".join("?" * len(batch[0]))
        self.con.executemany(f"INSERT OR REPLACE INTO rows ({cols}) VALUES ({marks})", batch)
        n = len(batch)
        batch.clear()
        return n

    # ------------------------------------------------------------------ reading

    def count(self) -> int:
        """Rows in the cache (kept in ``meta``, so O(1))."""
        return int(self.meta("count") or 0)

    def last_seq(self) -> int:
        """The highest seq in the cache (0 when empty)."""
        return int(self.con.execute("SELECT coalesce(max(seq), 0) FROM rows").fetchone()[0])

    def rows(self, lo: int, hi: int) -> list[dict[str, Any]]:
        """The rows with ``lo <= seq <= hi`` (parsed from their lines), in seq order."""
        cur = self.con.execute("SELECT line FROM rows WHERE seq BETWEEN ? AND ? ORDER BY seq", (lo, hi))
        return [json.loads(line) for (line,) in cur]

    def all_rows(self) -> list[dict[str, Any]]:
        """Every row in seq order (O(rows): for full renders and tests)."""
        return self.rows(1, 2**62)

    def superseded(self, lo: int = 1, hi: int = 2**62) -> dict[int, int]:
        """``{superseded seq: superseding seq}`` for targets in ``lo..hi``; when two supersede
        rows name one target, the later wins (as in a full render, whose map is built oldest
        first)."""
        cur = self.con.execute("SELECT supersedes, seq FROM rows WHERE kind='supersede' AND supersedes BETWEEN ? AND ? ORDER BY seq",
                               (lo, hi))
        return {int(t): int(s) for t, s in cur}

    def supersede_targets(self, lo: int, hi: int) -> list[int]:
        """Targets of the supersede rows with ``lo <= seq <= hi``."""
        cur = self.con.execute("SELECT supersedes FROM rows WHERE kind='supersede' AND seq BETWEEN ? AND ?", (lo, hi))
        return [int(t) for (t,) in cur]

    def seqs_of_receipt(self, receipt_id: str) -> list[int]:
        """Seqs of the rows naming ``receipt_id``."""
        return [int(s) for (s,) in self.con.execute("SELECT seq FROM rows WHERE receipt_id=?", (receipt_id,))]

    def standing_rows(self, kinds: Sequence[str], columns: Sequence[str]) -> list[dict[str, Any]]:
        """``columns`` (always with ``seq``) of the rows of ``kinds`` that stand (no supersede row
        names them) and have a ``receipt_id``, in seq order: what a sign-off judges, read as
        columns without parsing a row's JSON (O(rows) in SQLite)."""
        cols = list(dict.fromkeys(["seq", *columns]))
        marks = ",".join("?" * len(kinds))
        cur = self.con.execute(
            "SELECT " + ", ".join(f'"{c}"' for c in cols) + f" FROM rows WHERE kind IN ({marks}) AND receipt_id IS NOT NULL "
            "AND seq NOT IN (SELECT supersedes FROM rows WHERE kind='supersede' AND supersedes IS NOT NULL) ORDER BY seq", list(kinds))
        return [dict(zip(cols, r)) for r in cur]

    def standing_counts(self) -> dict[str, int]:
        """``{verdict or "n/a": rows}`` over the rows that stand (not supersede rows, not
        superseded), kept up to date by ``sync`` (O(verdicts)); ``standing_counts_scan`` counts
        them from the rows."""
        return {v: int(n) for v, n in self.con.execute("SELECT verdict, n FROM standing WHERE n != 0")}

    def standing_counts_scan(self) -> dict[str, int]:
        """``standing_counts`` counted from every row (O(rows)): what the kept counts must equal."""
        cur = self.con.execute(
            "SELECT coalesce(verdict, 'n/a'), count(*) FROM rows WHERE kind != 'supersede' "
            "AND seq NOT IN (SELECT supersedes FROM rows WHERE kind='supersede') GROUP BY 1")
        return {v: int(n) for v, n in cur}

    def frame_query(self, columns: Iterable[str]) -> str:
        """The SELECT that gives ``columns`` of every row in seq order (for ``pandas.read_sql_query``)."""
        return "SELECT " + ", ".join(f'"{c}"' for c in columns) + " FROM rows ORDER BY seq"

    # ------------------------------------------------------------------ summaries

    def summaries(self, receipt_ids: Iterable[str]) -> dict[str, tuple[str | None, str | None]]:
        """``{receipt_id: (candidate_name, bug_class)}`` for the ids already summarized."""
        ids = list(dict.fromkeys(receipt_ids))
        out: dict[str, tuple[str | None, str | None]] = {}
        for i in range(0, len(ids), 500):
            part = ids[i:i + 500]
            cur = self.con.execute(f"SELECT receipt_id, candidate_name, bug_class FROM summaries WHERE receipt_id IN ({','.join('?' * len(part))})", part)
            out.update({r: (c, b) for r, c, b in cur})
        return out

    def add_summaries(self, items: dict[str, tuple[str | None, str | None]]) -> None:
        """Store receipt summaries (``summaries``)."""
        if items:
            self.con.executemany("INSERT OR REPLACE INTO summaries VALUES (?, ?, ?)", [(k, c, b) for k, (c, b) in items.items()])

    # ------------------------------------------------------------------ sweep's receipt keys

    def receipt_keys(self) -> dict[str, list[tuple[str, str]]]:
        """``{receipt_id: [(typed key, created)]}`` (``harness.release.cells.receipt_keys_of``) of every receipt summarized so far
        (``add_receipt_keys``); a receipt with no key (a calibration receipt, an unreadable file)
        maps to ``[]``."""
        out: dict[str, list[tuple[str, str]]] = {}
        for rid, key, created in self.con.execute("SELECT receipt_id, key, created FROM receipt_keys"):
            keys = out.setdefault(rid, [])
            if key:
                keys.append((key, created))
        return out

    def add_receipt_keys(self, items: dict[str, list[tuple[str, str]]]) -> None:
        """Store the typed keys of receipts read once (``harness.release.cells.known_receipt_keys``, ``harness.release.sweep.existing_receipts``):
        receipts are content-addressed and never replaced, so a receipt's keys never change."""
        if not items:
            return
        rows = [(rid, k, c) for rid, keys in items.items() for k, c in keys] + [(rid, "", "") for rid, keys in items.items() if not keys]
        self.con.execute("BEGIN IMMEDIATE")
        self.con.executemany("INSERT OR REPLACE INTO receipt_keys VALUES (?, ?, ?)", rows)
        self.con.execute("COMMIT")
