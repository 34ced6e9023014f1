"""LEDGER.md and its older pages: where the rendering goes, what it holds, and bringing it up to the ledger.

``markdown_path_for`` refuses a rendering path that would destroy a file the harness did not
write; ``render_markdown`` is the full rendering in one text, ``render_page`` one page of it
(``PAGE_ROWS`` rows), ``render_pages`` writes the pages an append changed from the query cache;
``join_pages`` puts the pages back into the full text.
"""

from __future__ import annotations

import functools
import json
import glob
import os
import re
import stat
from pathlib import Path
from typing import Any, Mapping

from harness import display
from harness.errors import InvalidInput
from harness.evidence.ledger_cache import LedgerCache
from harness.evidence.rows import CACHE_COLUMNS, Problem
from harness.rundir import pid_alive

_HEAD_RE = re.compile(r"^Head: seq (\d+) · row_hash `([0-9a-f]{64})`$", re.M)
_EMPTY_HEAD = "Head: none (empty ledger)"


def default_markdown_path(ledger_path: str | Path) -> Path:
    """LEDGER.md at the repo root for ``<root>/evidence/parity/ledger.jsonl``, else the ledger's
    path with suffix ``.md``."""
    p = Path(ledger_path)
    if p.name == "ledger.jsonl" and p.parent.name == "parity" and p.parent.parent.name == "evidence":
        return p.parent.parent.parent / "LEDGER.md"
    return p.with_suffix(".md")


RENDER_TITLE = "# Sign-off ledger"
"""First line of every rendering; with the ``Rendered from `LEDGER`.`` line it marks a file the
harness wrote (``markdown_path_for`` refuses to write over anything else)."""


def _shown_ledger(ledger_path: Path, md_path: Path | None) -> str:
    """How a rendering names its ledger: the ledger's path relative to the rendering's folder."""
    base = md_path.parent if md_path else ledger_path.parent
    try:
        return display.plain(os.path.relpath(ledger_path, base))
    except ValueError:
        return display.plain(ledger_path)


def markdown_path_for(ledger_path: str | Path, markdown_path: str | Path | None = None) -> Path:
    """The rendering ``append_row`` will write for ``ledger_path`` (``markdown_path`` or
    ``default_markdown_path``), refused with ``InvalidInput`` (exit 2) when writing it could
    destroy something the harness did not create:

    - the ledger's name does not end in ``.jsonl`` (``--ledger LEDGER.md`` would make the
      rendering the ledger itself; any other suffix makes the pair ambiguous);
    - the rendering is the ledger file (same path, or a link to it);
    - the rendering exists and is not a regular file, or is not a rendering of this ledger (its
      first line is not ``RENDER_TITLE`` or it names another ledger): ``--ledger
      notes/README.jsonl`` must never overwrite ``notes/README.md``.

    Only the first 4 KiB of an existing rendering are read.
    """
    ledger_path = Path(ledger_path)
    if ledger_path.suffix != ".jsonl":
        raise InvalidInput(f"{ledger_path}: a ledger's file name must end in .jsonl (its Markdown rendering is written "
                           "beside it as .md); refusing an ambiguous ledger path")
    md = Path(markdown_path) if markdown_path else default_markdown_path(ledger_path)
    same = os.path.abspath(md) == os.path.abspath(ledger_path)
    if not same and md.exists() and ledger_path.exists():
        same = os.path.samefile(md, ledger_path)
    if same:
        raise InvalidInput(f"{md}: the rendered ledger would be the ledger itself; refusing")
    try:
        st = os.lstat(md)
    except (FileNotFoundError, NotADirectoryError):  # nothing there to protect (fschecks says whether it can be created)
        return md
    except OSError as e:
        raise InvalidInput(f"{md}: cannot use as the rendered ledger: {e.strerror or e}") from None
    if not stat.S_ISREG(st.st_mode):
        raise InvalidInput(f"{md}: the rendered ledger path is not a regular file; refusing to write over it")
    try:
        with open(md, "rb") as f:
            head = f.read(4096).decode("utf-8", errors="replace").split("\n")
    except OSError as e:
        raise InvalidInput(f"{md}: cannot read the rendered ledger: {e.strerror or e}") from None
    if head[0] != RENDER_TITLE or not any(ln.startswith("Rendered from `") for ln in head[1:4]):
        raise InvalidInput(f"{md}: exists and is not a ledger rendering written by the harness; refusing to overwrite it "
                           f"(choose a --ledger whose .md sibling is free)")
    shown = _shown_ledger(ledger_path, md)
    if not any(ln.startswith(f"Rendered from `{shown}`") for ln in head[1:4]):
        raise InvalidInput(f"{md}: is the rendering of another ledger, not {shown}; refusing to overwrite it")
    return md


def _write_text_atomic(path: Path, text: str) -> None:
    """Write ``text`` to a temporary file beside ``path`` and rename it over ``path``; the
    temporary file is removed when anything fails, and those of killed runs (their process is
    gone) are removed first. Called under the ledger lock."""
    path.parent.mkdir(parents=True, exist_ok=True)
    for stale in path.parent.glob(f".{glob.escape(path.name)}.*.tmp"):  # left by runs killed mid-render
        pid = stale.name[len(path.name) + 2 : -4]
        if pid.isdigit() and int(pid) != os.getpid() and not pid_alive(int(pid)):
            stale.unlink(missing_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _fmt(v: Any, spec: str) -> str:
    if v is None:
        return "—"
    return format(v, spec)


def _cell(v: Any) -> str:
    """A row's value as a Markdown table cell (``display.md_text``: no control characters, no cell
    breaks, links, code spans or HTML). Strings are memoized (``_cell_str``): a ledger repeats its
    models, candidates and dates on every row, and a full verification renders every row."""
    return _cell_str(v) if type(v) is str else display.md_text(v)


@functools.lru_cache(maxsize=4096)
def _cell_str(v: str) -> str:
    return display.md_text(v)


def _speed(r: Mapping[str, Any]) -> str:
    """The candidate's prefill tokens/s and wall seconds of a row, or a dash (rows before timings)."""
    tps, wall = r.get("candidate_tokens_per_s"), r.get("candidate_wall_s")
    if tps is None and wall is None:
        return "—"
    return f"{_fmt(tps, ',.0f')} ({_fmt(wall, '.1f')})"


def _table_line(r: Mapping[str, Any], superseded: Mapping[Any, Any], speed: bool) -> str:
    """One LEDGER.md table line: row ``r``'s fields, its verdict struck through when a later row
    in ``superseded`` (seq → superseding seq) withdraws it, and the speed column when ``speed``."""
    verdict = _cell(r.get("verdict") or "—")
    if r.get("seq") in superseded:
        verdict = f"~~{verdict}~~ (superseded by #{superseded[r.get('seq')]})"
    model = _cell(r.get("model") or "—")
    if r.get("kind") == "supersede":
        model = f"supersedes #{r.get('supersedes')}: {_cell(r.get('reason', ''))}"
    if r.get("kind") == "discharge":  # no model: the contract and its obligations per result
        counts = r.get("obligations") or {}
        model = f"contract {_cell(r.get('contract'))}: " + ", ".join(f"{n} {_cell(k)}" for k, n in sorted(counts.items()))
    flips = "—" if r.get("near_tie_flips") is None else f"{r.get('near_tie_flips')} / {r.get('hard_flips')}"
    receipt = f"`{r['receipt_id'][:12]}`" if r.get("receipt_id") else "—"
    return (
        "| "
        + " | ".join(
            [
                str(r.get("seq")),
                _cell(str(r.get("time") or "")[:10]),
                _cell(r.get("kind")),
                model,
                _cell(r.get("quant") or "—"),
                _cell(r.get("candidate") or "—"),
                _cell(r.get("reference") or "—"),
                _fmt(r.get("positions"), "d"),
                _fmt(r.get("min_cosine"), ".6f"),
                verdict,
                _fmt(r.get("argmax_agreement"), ".4f"),
                flips,
                _fmt(r.get("kld_mean"), ".3g"),
                _cell(r.get("basis_kind") or "—"),
                receipt,
            ]
            + ([_speed(r)] if speed else [])
        )
        + " |"
    )


PAGE_ROWS = 100
"""Rows per LEDGER.md page: page ``c`` holds seqs ``(c-1)*PAGE_ROWS+1 .. c*PAGE_ROWS``. LEDGER.md
shows the newest page (the head's); older pages are files in ``<stem>-pages/`` beside it
(``page_path``), newest first inside each, so an append rewrites one page of at most 100 rows."""

_TABLE_HEADER = ("| seq | date | kind | model | quant | candidate | reference | positions | min cos | verdict | argmax agr | "
                 "near-tie / hard flips | KLD mean | basis | receipt | candidate tok/s (wall s) |")
_TABLE_RULE = "|---:|---|---|---|---|---|---|---:|---:|---|---:|---:|---:|---|---|---:|"
_SIGNOFF_HEAD = ["", "## Sign-offs", "",
                 "Each row lists every receipt it relied on (`harness ledger verify` checks they exist, match and come before it); "
                 "`head` is the chain's head when it was signed.", "",
                 "| seq | date | release | builds | cells | verdict | head |", "|---:|---|---|---|---|---|---|"]
_PAGES_LINE = "Older rows, newest first: "


PAGE_LINKS = 10
"""How many of the newest older pages LEDGER.md (and the index) link by number; the first page is
linked too, and every older page links the one before it, so the line stays the same length at
any ledger size."""


def linked_pages(top: int) -> list[int | None]:
    """The older pages the head's page ``top`` links, newest first: the ``PAGE_LINKS`` newest, then
    (None: a gap, shown as an ellipsis) page 1 when it is not among them."""
    newest = list(range(top - 1, max(top - 1 - PAGE_LINKS, 0), -1))
    if newest and newest[-1] > 1:
        newest += ([None] if newest[-1] > 2 else []) + [1]
    return newest


def page_of(seq: int) -> int:
    """The page (1-based) holding row ``seq``."""
    return (int(seq) - 1) // PAGE_ROWS + 1


def page_seqs(page: int) -> tuple[int, int]:
    """The first and last seq of ``page``."""
    return (page - 1) * PAGE_ROWS + 1, page * PAGE_ROWS


def pages_dir(markdown_path: str | Path) -> Path:
    """Where the older pages of a rendering live: ``<stem>-pages/`` beside it (``LEDGER-pages/``)."""
    md = Path(markdown_path)
    return md.with_name(md.stem + "-pages")


def page_path(markdown_path: str | Path, page: int) -> Path:
    """The file of older page ``page`` (``LEDGER-pages/page-000001.md``)."""
    return pages_dir(markdown_path) / f"page-{page:06d}.md"


def _preamble(shown: str, head: Mapping[str, Any] | None) -> list[str]:
    return [RENDER_TITLE, "",
            f"Rendered from `{shown}`, the source of truth, after every append. Do not edit by hand:",
            "`harness ledger verify` checks the hash chain, this file's head and each row against its receipt.", "",
            f"Head: seq {head['seq']} · row_hash `{head['row_hash']}`" if head else _EMPTY_HEAD, ""]


def _body(rows: list[Mapping[str, Any]], superseded: Mapping[Any, Any]) -> tuple[list[str], list[str]]:
    """The table lines and the sign-off lines of ``rows``, newest first."""
    newest = sorted(rows, key=lambda r: -(r.get("seq") or 0))
    return ([_table_line(r, superseded, True) for r in newest if r.get("kind") != "signoff"],
            [_signoff_line(r, superseded) for r in newest if r.get("kind") == "signoff"])


def _assemble(top: list[str], table: list[str], signoffs: list[str]) -> str:
    lines = top + [_TABLE_HEADER, _TABLE_RULE] + table
    if signoffs:
        lines += _SIGNOFF_HEAD + signoffs
    return "\n".join(lines) + "\n"


def render_markdown(rows: list[Mapping[str, Any]], ledger_path: str | Path, markdown_path: str | Path | None = None) -> str:
    """The full rendering of ``rows`` in one text: a header, the head (last seq and row_hash), one
    table line per row, newest first, and the sign-offs in their own section, newest first.

    Superseded rows stay, their verdict struck through and pointing at the superseding row. The
    last column shows the candidate's prefill tokens/s and wall seconds (a dash for rows without
    timings). What ``append_row`` writes is this text cut into pages (``render_page``);
    ``join_pages`` puts them back together into exactly this text.
    """
    ledger_path = Path(ledger_path)
    shown = _shown_ledger(ledger_path, Path(markdown_path) if markdown_path else None)
    superseded = {r.get("supersedes"): r.get("seq") for r in rows if r.get("kind") == "supersede"}
    table, signoffs = _body(rows, superseded)
    return _assemble(_preamble(shown, rows[-1] if rows else None), table, signoffs)


def render_page(page: int, rows: list[Mapping[str, Any]], superseded: Mapping[Any, Any], head: Mapping[str, Any] | None,
                ledger_path: str | Path, markdown_path: str | Path) -> str:
    """One page of the rendering: ``rows`` are the rows of ``page`` (``page_seqs``) that exist,
    ``superseded`` maps each of them that a later row withdraws to that row's seq. The head's
    page (``page == page_of(head seq)``) is LEDGER.md itself: the full rendering's header and
    head, a line linking the newest older pages and the first (``linked_pages``), and its rows;
    an older page has a title naming its seqs and a line linking back and to the page before it. Both have the same table and sign-off section as the full
    rendering, restricted to their rows."""
    md = Path(markdown_path)
    shown = _shown_ledger(Path(ledger_path), md)
    table, signoffs = _body(rows, superseded)
    last = page_of(head["seq"]) if head else 1
    if page == last:
        top = _preamble(shown, head)
        if last > 1:
            folder = pages_dir(md).name
            links = ", ".join("…" if n is None else f"[{n}]({folder}/page-{n:06d}.md)" for n in linked_pages(last))
            top += [f"{_PAGES_LINE}{links}.", ""]
        return _assemble(top, table, signoffs)
    lo, hi = page_seqs(page)
    before = f" The rows before these: [page {page - 1}](page-{page - 1:06d}.md)." if page > 1 else ""
    top = [f"{RENDER_TITLE}: rows {lo}–{hi}", "", f"Rendered from `{shown}`; page {page}. "
           f"The head and the newest rows are in [{md.name}](../{md.name}).{before} Do not edit by hand.", ""]
    return _assemble(top, table, signoffs)


def join_pages(head_text: str, older: list[str]) -> str:
    """The full rendering (``render_markdown``) rebuilt from LEDGER.md's text and its older pages'
    texts, newest page first: LEDGER.md's header and head, then every page's table lines, then
    every page's sign-off lines. Raises ``ValueError`` for a text that is not a page."""
    def split(text: str) -> tuple[list[str], list[str], list[str]]:
        lines = text.rstrip("\n").split("\n")
        i = lines.index(_TABLE_HEADER)
        j = lines.index(_SIGNOFF_HEAD[1]) if _SIGNOFF_HEAD[1] in lines else len(lines)
        return lines[:i], lines[i + 2:j], lines[j + len(_SIGNOFF_HEAD) - 1:] if j < len(lines) else []
    top, table, signoffs = split(head_text)
    top = [ln for ln in top if not ln.startswith(_PAGES_LINE)]
    if top and top[-1] == "" and len(top) >= 2 and top[-2] == "":
        top = top[:-1]
    for text in older:
        _, t, so = split(text)
        table += t
        signoffs += so
    return _assemble(top, table, signoffs)


def rendered_head_seq(markdown_path: str | Path) -> int | None:
    """The head seq a rendering shows (0: ``Head: none``), from its first 4 KiB; None when the file
    is missing or shows no head."""
    try:
        with open(markdown_path, "rb") as f:
            head = f.read(4096).decode("utf-8", errors="replace")
    except OSError:
        return None
    m = _HEAD_RE.search(head)
    if m:
        return int(m.group(1))
    return 0 if _EMPTY_HEAD in head else None


def render_pages(ledger_path: str | Path, markdown_path: str | Path | None = None, *, full: bool = False,
                 cache: LedgerCache | None = None) -> list[Path]:
    """Bring the rendering up to the ledger (called by ``append_row`` under the ledger lock):
    write the pages that changed since the head the rendering shows (``rendered_head_seq``), and
    return their paths. Those are the head's page (LEDGER.md), pages that filled up since, and the
    page of each row a new supersede row withdraws; older pages first, LEDGER.md last, so a head
    in LEDGER.md means every page before it is written. ``full`` (or a rendering without a
    head) writes every page. Rows come from the query cache (``LedgerCache``), so the cost is the
    pages written, not the ledger. Raises ``OSError`` when a page cannot be written."""
    ledger_path = Path(ledger_path)
    md = Path(markdown_path) if markdown_path else default_markdown_path(ledger_path)
    own = cache is None
    cache = cache or LedgerCache.open(ledger_path, CACHE_COLUMNS, check=full)  # a full render is checked against the ledger
    try:
        last = cache.last_seq()
        head = cache.rows(last, last)[0] if last else None
        shown = rendered_head_seq(md)
        top = page_of(last) if last else 1
        if full or shown is None or shown > last:
            todo = set(range(1, top + 1))
        else:
            todo = set(range(page_of(max(shown, 1)), top + 1))
            todo |= {page_of(t) for t in cache.supersede_targets(shown + 1, last) if 1 <= t <= last}
        written = []
        for page in sorted(todo):
            lo, hi = page_seqs(page)
            text = render_page(page, cache.rows(lo, hi), cache.superseded(lo, hi), head, ledger_path, md)
            path = md if page == top else page_path(md, page)
            if path != md:
                path.parent.mkdir(parents=True, exist_ok=True)
            _write_text_atomic(path, text)
            written.append(path)
        return written
    finally:
        if own:
            cache.close()


def _signoff_line(r: Mapping[str, Any], superseded: Mapping[Any, Any]) -> str:
    """One line of LEDGER.md's sign-off section: release, each candidate's build (12 hex digits),
    cells signed of all, verdict (struck through when superseded) and the head it was signed at."""
    verdict = _cell(r.get("verdict") or "—")
    if r.get("seq") in superseded:
        verdict = f"~~{verdict}~~ (superseded by #{superseded[r.get('seq')]})"
    builds = ", ".join(f"{_cell(k)} `{str(v)[:12]}`" for k, v in sorted((r.get("builds") or {}).items())) or "—"
    cells = r.get("cells") or []
    ok = sum(1 for c in cells if c.get("status") == "ok")
    return (f"| {r.get('seq')} | {_cell(str(r.get('time') or '')[:10])} | {_cell(r.get('release_name'))} | {builds} | "
            f"{ok}/{len(cells)} ok | {verdict} | `{str(r.get('prev_hash'))[:12]}` |")


# ----------------------------------------------------------------------------- the rendering's check (``verify_ledger``)


class _PageCheck:
    """The older pages of a rendering checked while ``verify_ledger`` streams the ledger, so a
    full verification reads the ledger once: when a page's rows are complete (``done``) it is
    rendered with the supersede rows seen so far and compared with its file; only a page that
    differs, or that a later supersede row withdraws a row of, is checked again at the end from
    its byte span (``recheck``)."""

    def __init__(self, ledger_path: Path, md_path: Path):
        self.ledger_path, self.md_path = ledger_path, md_path
        shown = rendered_head_seq(md_path)
        self.head = {"seq": shown} if shown else None
        self.older = page_of(shown) - 1 if shown else 0  # pages that are files in <stem>-pages/
        self.start = 0
        self.spans: dict[int, tuple[int, int]] = {}  # page -> byte span of its rows in the ledger
        self.used: dict[int, dict[int, int]] = {}  # page -> the supersede map it matched with
        self.twice: set[int] = set()  # pages whose rows are not in one run of lines (a broken ledger)

    def done(self, rows: list[dict[str, Any]], end: int, supersedes: list[tuple[int, int, int]]) -> None:
        """Page ``rows`` (one page's rows, complete; they end at byte ``end``) seen: compare it
        with its file under the supersede rows so far."""
        page = page_of(rows[0]["seq"])
        if page > self.older or self.head is None:
            return
        if page in self.spans:
            self.twice.add(page)
            return
        self.spans[page] = (self.start, end)
        sup = _within({t: s for s, t, _ in supersedes if s <= self.head["seq"]}, page)
        want = render_page(page, rows, sup, self.head, self.ledger_path, self.md_path)
        try:
            got = page_path(self.md_path, page).read_text(encoding="utf-8", errors="replace")
        except OSError:
            return
        if got == want:
            self.used[page] = sup

    def recheck(self, f, sup: Mapping[int, int], head: Mapping[str, Any], last_page: int) -> list[tuple[int, list[dict[str, Any]]]]:
        """``(page, rows)`` of pages 1..``last_page`` still to compare: those that did not match,
        or matched with another supersede map than ``sup`` (the final one), read again from their
        byte spans; every page, read from the start (``_pages``), when the ledger's pages are
        not in order, a page has no rows, or ``head`` is not the one the pages were checked for."""
        if (self.twice or self.head is None or head.get("seq") != self.head["seq"]
                or any(p not in self.spans for p in range(1, last_page + 1))):
            return list(_pages(f, last_page))
        out = []
        for page in range(1, last_page + 1):
            if self.used.get(page) == _within(sup, page):
                continue
            lo, hi = self.spans[page]
            f.seek(lo)
            rows = []
            for raw in f.read(hi - lo).splitlines():
                try:
                    row = json.loads(raw)
                except ValueError:
                    continue
                if isinstance(row, dict) and isinstance(row.get("seq"), int):
                    rows.append(row)
            out.append((page, rows))
        return out


def _check_rendering(f, ledger_path: Path, md_path: Path, last: dict[str, Any] | None, tail: list[dict[str, Any]],
                     supersedes: list[tuple[int, int, int]], incremental: bool, pages: _PageCheck | None = None) -> list[Problem]:
    """HEAD and MARKDOWN problems of the rendering (``verify_ledger``): LEDGER.md's head against
    the last row, LEDGER.md against ``render_page`` of the newest page's rows (``tail``), and,
    unless ``incremental``, every older page against its rows (checked as the ledger streamed
    past them, ``_PageCheck``; else the ledger ``f`` read again, one page at a time). A rendering
    that stops at an earlier head, exactly as a run killed between its append and its render
    leaves it, is not a problem: the next append re-renders."""
    if not md_path.exists():
        if last is None:
            return []
        return [Problem("HEAD", f"{md_path} is missing, so removal of the last row cannot be ruled out", last.get("seq"), None)]
    text = md_path.read_text(encoding="utf-8", errors="replace")
    m = _HEAD_RE.search(text)
    if m is None:
        if _EMPTY_HEAD in text and last is None:
            return []
        if _EMPTY_HEAD in text:
            return [Problem("MARKDOWN", f"{md_path} shows an empty ledger but the ledger has rows (not re-rendered?)")]
        return [Problem("HEAD", f"{md_path} has no head line ('Head: seq N · row_hash `…`')")]
    md_seq, md_hash = int(m.group(1)), m.group(2)
    if last is None:
        return [Problem("HEAD", f"the ledger is empty but {md_path.name} shows head seq {md_seq}: every row was removed", md_seq)]
    last_seq = last.get("seq")
    if not isinstance(last_seq, int):
        return []
    if md_seq > last_seq:
        return [Problem("HEAD", f"{md_path.name} shows head seq {md_seq} but the ledger ends at seq {last_seq}: "
                        f"{md_seq - last_seq} row(s) removed from the end", md_seq)]
    if md_seq == last_seq and md_hash != last.get("row_hash"):
        return [Problem("HEAD", f"{md_path.name} head row_hash differs from the ledger's last row: the last row was replaced", md_seq)]
    upto = md_seq  # the rendering stands for the rows up to its head
    sup = {t: s for s, t, _ in supersedes if s <= upto}
    if md_seq != last_seq:
        rows = [r for r in _rows_of_page(f, page_of(md_seq), tail, md_seq) if r.get("seq", 0) <= md_seq]
        head = next((r for r in rows if r.get("seq") == md_seq), None)
        if head is None or head.get("row_hash") != md_hash or text != render_page(page_of(md_seq), rows, _within(sup, page_of(md_seq)), head, ledger_path, md_path):
            return [Problem("MARKDOWN", f"{md_path.name} shows head seq {md_seq} but the ledger ends at seq {last_seq} (not re-rendered?)", last_seq)]
    elif text != render_page(page_of(last_seq), tail, _within(sup, page_of(last_seq)), last, ledger_path, md_path):
        return [Problem("MARKDOWN", f"{md_path.name} is not the rendering of the ledger's newest rows (edited by hand?)")]
    if incremental:
        return []
    head = last if md_seq == last_seq else {"seq": md_seq, "row_hash": md_hash}
    problems = []
    todo = pages.recheck(f, sup, head, page_of(md_seq) - 1) if pages is not None else _pages(f, page_of(md_seq) - 1)
    for page, rows in todo:
        path = page_path(md_path, page)
        want = render_page(page, rows, _within(sup, page), head, ledger_path, md_path)
        try:
            got = path.read_text(encoding="utf-8", errors="replace")
        except OSError:
            problems.append(Problem("MARKDOWN", f"{path} (rows {page_seqs(page)[0]}–{page_seqs(page)[1]}) is missing"))
            continue
        if got != want:
            problems.append(Problem("MARKDOWN", f"{path.name} is not the rendering of rows {page_seqs(page)[0]}–{page_seqs(page)[1]} (edited by hand?)"))
    return problems


def _within(superseded: Mapping[int, int], page: int) -> dict[int, int]:
    lo, hi = page_seqs(page)
    return {t: s for t, s in superseded.items() if isinstance(t, int) and lo <= t <= hi}


def _rows_of_page(f, page: int, tail: list[dict[str, Any]], upto: int) -> list[dict[str, Any]]:
    """The rows of ``page`` (from ``tail`` when it is that page, else read from ``f``)."""
    if tail and page_of(tail[0]["seq"]) == page:
        return tail
    return next((rows for p, rows in _pages(f, page) if p == page), [])


def _pages(f, last_page: int):
    """``(page, rows)`` for pages 1..``last_page`` of the ledger file ``f``, reading it once
    from the start (lines that are not rows are passed over: they are reported already)."""
    if last_page < 1:
        return
    f.seek(0)
    page, rows = 1, []
    for raw in f:
        try:
            row = json.loads(raw)
        except ValueError:
            continue
        if not isinstance(row, dict) or not isinstance(row.get("seq"), int):
            continue
        p = page_of(row["seq"])
        if p != page:
            yield page, rows
            if page >= last_page:
                return
            page, rows = p, []
        rows.append(row)
    if page <= last_page:
        yield page, rows
