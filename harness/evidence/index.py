"""The evidence index: ``reports/index.md`` and ``reports/index.html`` beside the ledger.

One line per ledger row, newest first: verdict, kind, candidate, model, class (the candidate's
compute class, ``f32 compute``, and the planted bug class of a ``mutant:*`` candidate, i.e.
known-bad evidence: ``row_class``), key numbers, and links to the
row's verdict page and receipt. It is regenerated after every append (the evidence door, ``record.record``) and
after every report written to the default folder (``write_report``), under the ledger's file
lock so concurrent runs leave the newest view. It is a rendering for people: the hash-chained
``ledger.jsonl`` stays the record (``harness ledger verify``), and the index links to it.

It is paged as LEDGER.md is (``ledger.PAGE_ROWS`` rows a page, ``ledger.page_of``):
``index.md``/``index.html`` show the newest page and the standing counts, older pages are
``index-pages/page-NNNNNN.md`` and ``.html``. A refresh rewrites only the pages that changed
since the seq it last rendered (kept in the query cache, ``LedgerCache``): the newest page, the
page of a row a new supersede row withdraws, and the page of a receipt whose report was just
written. Each receipt is read once: its summary (the candidate engine's name and a mutant's
bug class) is kept in the cache. Concatenated, the pages' tables are the table of the full
index (``build_index``).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any, Mapping, Sequence

from filelock import Timeout

from harness.errors import HarnessError, InvalidInput
from harness.evidence import fmt
from harness.evidence.chain import ledger_lock
from harness.evidence.pages import default_markdown_path, linked_pages, page_of, page_seqs
from harness.evidence.rows import CACHE_COLUMNS, read_rows
from harness.evidence.ledger_cache import LedgerCache
from harness.evidence.page import Badge, Code, Inline, Link, Page, untrusted
from harness.evidence.receipts import receipt_file
from harness.evidence.report import REPORT_HTML, REPORT_MD

INDEX_MD, INDEX_HTML = "index.md", "index.html"
INDEX_PAGES = "index-pages"
_COLUMNS = ["#", "time", "verdict", "kind", "candidate", "model", "class", "key numbers", "report", "receipt"]
_ALIGN = "rnnlnllnll"


def reports_dir(ledger_path: str | Path) -> Path:
    """``reports/`` beside the ledger (where ``write_report`` puts each receipt's folder)."""
    return Path(ledger_path).parent / "reports"


def receipt_summary(rec: Any) -> tuple[str | None, str | None]:
    """``(candidate engine name, bug class)`` of a parsed receipt (None, None where it has none)."""
    try:
        cand = rec.get("engines", {}).get("candidate", {})
        return cand.get("name"), (cand.get("build") or {}).get("bug_class")
    except AttributeError:
        return None, None


def _summary(receipts: Path, rid: str) -> tuple[str | None, str | None]:
    """``receipt_summary`` of receipt ``rid``, read from its file (None, None when unreadable)."""
    try:
        return receipt_summary(json.loads(receipt_file(receipts, rid).read_text(encoding="utf-8")))
    except (OSError, ValueError):
        return None, None


def _summaries(cache: LedgerCache | None, receipts: Path, rows: list[dict[str, Any]]) -> dict[str, tuple[str | None, str | None]]:
    """The summaries of the rows' receipts: from the cache, reading (and storing) only the new ones."""
    ids = [r["receipt_id"] for r in rows if r.get("receipt_id") and r.get("kind") not in ("supersede", "signoff")]
    known = cache.summaries(ids) if cache is not None else {}
    new = {rid: _summary(receipts, rid) for rid in ids if rid not in known}
    if cache is not None:
        cache.add_summaries({k: v for k, v in new.items() if v != (None, None)})
    return {**known, **new}


def _key_numbers(row: dict[str, Any]) -> str:
    parts = []
    if row.get("min_cosine") is not None:
        parts.append(f"lowest cosine {fmt.cosine(row['min_cosine'])}")
    if row.get("kld_mean") is not None:
        parts.append(f"KLD mean {fmt.kld(row['kld_mean'])}")
    if row.get("argmax_agreement") is not None:
        parts.append(f"argmax {fmt.percent(row['argmax_agreement'])}")
    if row.get("hard_flips") is not None:
        parts.append(f"{row['hard_flips']} hard flips")
    if row.get("positions") is not None:
        parts.append(f"{row['positions']} positions")
    return " · ".join(parts) or fmt.NA


def _rel(target: Path, base: Path) -> str | None:
    try:
        return os.path.relpath(target, base).replace(os.sep, "/")
    except ValueError:
        return None


def row_class(row: Mapping[str, Any], bug_class: str | None) -> str:
    """The index's class cell of a measurement row: its compute class (``f32 compute``; rows of
    receipts that judge two tiers record it), then ``known-bad: BUG CLASS`` for a mutant or
    ``self-check`` for a self-consistency row, joined by " · "; "—" when none applies."""
    parts = [f"{row['compute_class']} compute"] if row.get("compute_class") else []
    if bug_class:
        parts.append(f"known-bad: {bug_class}")
    elif row.get("kind") == "self-consistency":
        parts.append("self-check")
    return " · ".join(parts) or "—"


def _row_cells(row: dict[str, Any], superseded: dict[int, int], ledger_dir: Path, out: Path,
               summary: tuple[str | None, str | None] = (None, None)) -> list[Inline]:
    rid = row.get("receipt_id")
    verdict: Inline = Badge(row.get("verdict") or fmt.NA)
    if row.get("seq") in superseded:
        verdict = [verdict, f" (withdrawn by #{superseded[row['seq']]})"]
    cand_name = summary[0] or str(row.get("candidate") or fmt.NA).split(" ")[0]
    klass = row_class(row, summary[1])
    model = f"{row.get('model') or fmt.NA}" + (f" ({row['quant']})" if row.get("quant") else "")
    if row.get("kind") == "supersede":
        return [str(row.get("seq")), fmt.when(row.get("time")), "", "supersede", "", f"withdraws #{row.get('supersedes')}: {row.get('reason', '')}",
                "", "", "", ""]
    if row.get("kind") == "signoff":
        cells = row.get("cells") or []
        return [str(row.get("seq")), fmt.when(row.get("time")), verdict, "signoff", "", f"release {row.get('release_name')}", "",
                f"{sum(c.get('status') == 'ok' for c in cells)}/{len(cells)} cells ok; {len(row.get('relied_on') or [])} receipts", "", ""]
    if row.get("kind") == "discharge":  # no verdict page: the receipt names each obligation record
        counts = row.get("obligations") or {}
        return [str(row.get("seq")), fmt.when(row.get("time")), verdict, "discharge", Code(cand_name), f"contract {row.get('contract')}",
                "", ", ".join(f"{n} {k}" for k, n in sorted(counts.items())), "", _receipt_cell(rid, ledger_dir, out)]
    report: Inline = "not rendered"
    folder = out / rid[:16] if rid else None
    if folder is not None and (folder / REPORT_MD).is_file():
        html = REPORT_HTML if (folder / REPORT_HTML).is_file() else REPORT_MD
        report = Link("verdict page", f"{rid[:16]}/{REPORT_MD}", f"{rid[:16]}/{html}")
    return [str(row.get("seq")), fmt.when(row.get("time")), verdict, str(row.get("kind") or ""), Code(cand_name), model, klass,
            _key_numbers(row), report, _receipt_cell(rid, ledger_dir, out)]


def _receipt_cell(rid: str | None, ledger_dir: Path, out: Path) -> Inline:
    """The index's receipt cell: its id linked to its file, or marked missing."""
    if not rid:
        return fmt.NA
    target = receipt_file(ledger_dir / "receipts", rid)
    href = _rel(target, out) if target.is_file() else None
    return Link(Code(rid[:12]), href) if href else [Code(rid[:12]), " (missing)"]


def _intro(page: Page, ledger_path: Path, out: Path, n_rows: int, counts: dict[str, int]) -> None:
    links: list[Inline] = []
    href = _rel(ledger_path, out)
    if href:
        links.append(Link(Code(ledger_path.name), href))
    md = default_markdown_path(ledger_path)
    if md.is_file() and (mhref := _rel(md, out)):
        links += [" (rendered: ", Link(Code(md.name), mhref), ")"]
    page.p("Every receipt of the ledger ", *links, ", newest first. The hash-chained ledger is the record and ",
           Code("harness ledger verify"), " checks it; this page is regenerated from it after every append and every report.")
    standing = ", ".join(f"{n} {v}" for v, n in sorted(counts.items())) or "none"
    page.p(f"{n_rows} rows; standing results: {standing}.")


def _table(page: Page, cells: list[list[Inline]]) -> None:
    page.table(_COLUMNS, cells, _ALIGN)
    if any(c[8] == "not rendered" for c in cells):
        page.note("A row without a verdict page: render it with ", Code("harness report RECEIPT"), ".")


def build_index(ledger_path: str | Path) -> Page:
    """The whole index in one page (rows newest first): what the paged index (``index_page``)
    shows, cut into pages. Reads every receipt; for tests and one-off renders. Raises
    ``InvalidInput`` on a malformed ledger line."""
    ledger_path = Path(ledger_path)
    out = reports_dir(ledger_path)
    rows = read_rows(ledger_path)
    superseded = {r.get("supersedes"): r.get("seq") for r in rows if r.get("kind") == "supersede"}
    counts: dict[str, int] = {}
    for r in rows:
        if r.get("kind") != "supersede" and r.get("seq") not in superseded:
            counts[r.get("verdict") or "n/a"] = counts.get(r.get("verdict") or "n/a", 0) + 1
    page = Page("Evidence index").h(1, "Evidence index")
    _intro(page, ledger_path, out, len(rows), counts)
    summaries = _summaries(None, ledger_path.parent / "receipts", rows)
    _table(page, [_row_cells(r, superseded, ledger_path.parent, out, summaries.get(r.get("receipt_id"), (None, None)))
                  for r in sorted(rows, key=lambda r: -(r.get("seq") or 0))])
    return page


def index_page(ledger_path: Path, cache: LedgerCache, page_no: int) -> Page:
    """Page ``page_no`` of the index from the query cache: the newest page (the head's) is
    ``index.md`` with the intro, the standing counts (kept in the cache: ``standing_counts``) and
    links to the newest older pages and the first (``ledger.linked_pages``); an older page
    (``index-pages/page-NNNNNN``) has its rows, a link back and one to the page before it."""
    out = reports_dir(ledger_path)
    last = cache.last_seq()
    top = page_of(last) if last else 1
    lo, hi = page_seqs(page_no)
    rows = cache.rows(lo, hi)
    superseded = cache.superseded(lo, hi)
    summaries = _summaries(cache, ledger_path.parent / "receipts", rows)
    cells = [_row_cells(r, superseded, ledger_path.parent, out, summaries.get(r.get("receipt_id"), (None, None)))
             for r in sorted(rows, key=lambda r: -(r.get("seq") or 0))]
    if page_no == top:
        page = Page("Evidence index").h(1, "Evidence index")
        _intro(page, ledger_path, out, cache.count(), cache.standing_counts())
        if top > 1:
            links: list[Inline] = ["Older rows, newest first: "]
            for n in linked_pages(top):  # bounded: the newest pages and the first; each page links the one before
                links += ["… " if n is None else [Link(str(n), f"{INDEX_PAGES}/page-{n:06d}.md", f"{INDEX_PAGES}/page-{n:06d}.html"), " "]]
            page.p(*links)
    else:
        page = Page(f"Evidence index: rows {lo}–{hi}").h(1, f"Evidence index: rows {lo}–{hi}")
        before: list[Inline] = [" The rows before these: ", Link(f"page {page_no - 1}", f"page-{page_no - 1:06d}.md",
                                                                 f"page-{page_no - 1:06d}.html"), "."] if page_no > 1 else []
        page.p(f"Page {page_no}; the newest rows and the standing counts are in ",
               Link(Code(INDEX_MD), f"../{INDEX_MD}", f"../{INDEX_HTML}"), ".", *before)
    _table(page, cells)
    return page


def render_index(ledger_path: str | Path, cache: LedgerCache, *, receipt_id: str | None = None, full: bool = False,
                 known: Sequence[Mapping[str, Any]] = ()) -> tuple[Path, Path]:
    """Write the pages of the index that changed (module docstring) from the open query cache
    ``cache`` (synced with the ledger by its caller), with the ledger's lock held by the caller
    (the evidence door, ``harness.evidence.record.record``, or ``refresh_index``): the newest,
    pages completed since the last refresh, the pages of rows new supersede rows withdraw and,
    given ``receipt_id``, the pages of the rows naming it; every page when ``full`` or when the
    index was never rendered. ``known``: receipts the caller holds (the door's new one), whose
    summaries are stored without reading their files again. Return the paths of ``index.md`` and
    ``index.html``. Raises ``InvalidInput`` for a malformed ledger line and ``OSError`` when a
    page cannot be written."""
    ledger_path = Path(ledger_path)
    out = reports_dir(ledger_path)
    cache.add_summaries({r["id"]: receipt_summary(r) for r in known if receipt_summary(r) != (None, None)})
    if cache.bad_line is not None:
        read_rows(ledger_path)  # names the malformed line (InvalidInput)
    last = cache.last_seq()
    top = page_of(last) if last else 1
    done = cache.meta("index_seq")
    if full or done is None or not (out / INDEX_MD).is_file() or int(done) > last:
        todo = set(range(1, top + 1))
    else:
        shown = int(done)
        todo = set(range(page_of(max(shown, 1)), top + 1))
        todo |= {page_of(t) for t in cache.supersede_targets(shown + 1, last) if 1 <= t <= last}
    if receipt_id:
        todo |= {page_of(s) for s in cache.seqs_of_receipt(receipt_id)}
    md = html = None
    cache.con.execute("BEGIN IMMEDIATE")  # the summaries and index_seq in one write transaction
    try:
        for n in sorted(todo):
            page = index_page(ledger_path, cache, n)
            if n == top:
                md, html = page.write(out / INDEX_MD, out / INDEX_HTML)
            else:
                page.write(out / INDEX_PAGES / f"page-{n:06d}.md", out / INDEX_PAGES / f"page-{n:06d}.html")
        cache.set_meta("index_seq", last)
        cache.con.execute("COMMIT")
    except BaseException:
        if cache.con.in_transaction:
            cache.con.execute("ROLLBACK")
        raise
    return md or out / INDEX_MD, html or out / INDEX_HTML


def refresh_index(ledger_path: str | Path, *, lock_timeout: float = 60.0, receipt_id: str | None = None,
                  full: bool = False) -> tuple[Path, Path]:
    """``render_index`` under the ledger's lock, from the query cache opened for it (checked
    against the ledger when ``full``): what a verdict page written after its run, ``harness
    ledger index`` and ``harness ledger render`` call. Return the paths of ``index.md`` and
    ``index.html``. Raises ``InvalidInput`` (malformed ledger, unwritable folder, lock not
    obtained within ``lock_timeout`` seconds)."""
    ledger_path = Path(ledger_path)
    try:
        with ledger_lock(ledger_path, lock_timeout):
            with LedgerCache.open(ledger_path, CACHE_COLUMNS, check=full) as cache:  # a full render is checked against the ledger
                return render_index(ledger_path, cache, receipt_id=receipt_id, full=full)
    except Timeout as e:
        raise InvalidInput(f"{ledger_path}: could not take the ledger lock within {lock_timeout:g} s to render the index") from e
    except OSError as e:
        raise InvalidInput(f"{reports_dir(ledger_path)}: cannot write the index: {e.strerror or e}") from e


def refresh_index_quietly(ledger_path: str | Path, receipt_id: str | None = None) -> bool:
    """``refresh_index``; on failure one warning line on stderr and False (the evidence is already
    written and the index is only a rendering of it)."""
    try:
        refresh_index(ledger_path, receipt_id=receipt_id)
    except HarnessError as e:
        sys.stderr.write(f"harness: warning: evidence index not regenerated: {untrusted(e)}\n")
        return False
    return True
