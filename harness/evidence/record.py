"""The evidence door: every run's evidence enters the record through ``record``.

A run hands its receipt (or, for a sign-off, a supersede or an adopted receipt, its row) to
``record``, which does each step once, in this order, under the ledger's file lock
(``chain.ledger_lock``):

1. write the receipt, its array sidecar and the files it binds (a discharge's obligation records;
   ``receipts.write_receipt``);
2. append its row, chained after the last one (``rows.row_from_receipt``, ``chain.append_locked``);
3. bring the query cache up to the ledger (``LedgerCache.use``: opens it, reads the one new
   line, and closes it after steps 4 to 6);
4. rewrite the LEDGER.md pages the row changed (``pages.render_pages``, from that cache);
5. for a run that asks for it (``page``: what ``harness parity`` and ``harness probe`` do), write
   the receipt's verdict page (``report.render_report``, from the receipt and arrays in hand:
   nothing is read back);
6. rewrite the reports index pages it changed (``index.render_index``, from that cache, so the
   new row links its verdict page at once).

A failure in step 5 or 6 is a warning line, not an error: the evidence is already written, and
both are renderings of it.

Parity, top-k, MTP, probe (serving included), tokenizer, chat parsers, calibration subject, discharge, sweep,
sign-off and ``ledger merge`` all come through here (``record_evidence`` for a new receipt,
``record_discharge`` for a discharge's receipt and the obligation records it binds, ``record_row``
for a row); the cache and the pages are renderings and indexes of the ledger, never the source of a
verdict. Each evidence module is called once by the door: a run hands over the ``EvidencePaths``
its preflight resolved, so the rendering's path is not resolved a second time. A verdict page
written later by ``harness report RECEIPT`` (``harness.runs.explain``) refreshes its own index row
with ``index.refresh_index``.

Layout: ``<ledger dir>/receipts/<id[:2]>/<id>.json`` and ``.npz`` beside the ledger (by default
the project's: ``[tool.harness] ledger``, else ``<evidence>/parity/ledger.jsonl`` with
``<evidence>`` = ``[tool.harness] evidence`` or ``evidence/`` at the project root,
``harness.config``), and the ledger's Markdown rendering (``pages.markdown_path_for``).

``preflight_evidence`` checks, before any engine runs, everything ``record`` will need to write,
so a run never spends engine time and then fails to record (or records a receipt without its row).
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from harness.config import load_config
from harness.errors import HarnessError, InvalidInput
from harness.evidence.chain import append, check_ledger_head
from harness.evidence.index import render_index
from harness.evidence.ledger_cache import LedgerCache
from harness.evidence.page import untrusted
from harness.evidence.pages import markdown_path_for, render_pages
from harness.evidence.receipts import write_receipt
from harness.evidence.report import Explanation, render_report
from harness.evidence.rows import CACHE_COLUMNS, receipt_row
from harness.fschecks import require_writable_dir, require_writable_file


def default_ledger() -> Path:
    """The current project's ledger (module docstring). Raises ``InvalidInput`` for a bad config."""
    return load_config().ledger


@dataclass
class Recorded:
    """What ``record`` wrote: the receipt as on disk (None for a row without a new receipt), its
    path, the ledger row and the ledger it was appended to."""

    receipt: dict[str, Any] | None
    receipt_path: Path | None
    row: dict[str, Any]
    ledger_path: Path
    report_path: Path | None = None
    """The verdict page's ``report.md`` the door wrote (``page``), None when none was asked for or
    it could not be written (a warning said why)."""


@dataclass(frozen=True)
class EvidencePaths:
    """Where a run's evidence goes: the ledger, its rendering and the receipts folder."""

    ledger: Path
    markdown: Path
    receipts: Path


def evidence_paths(ledger: str | Path | None, markdown: str | Path | None = None) -> EvidencePaths:
    """The paths for ``ledger`` (None: ``default_ledger()``) and its rendering ``markdown`` (None:
    the default beside it); raises ``InvalidInput`` for an ambiguous ledger path or a rendering
    path holding a file the harness did not write (``markdown_path_for``)."""
    ledger_path = Path(ledger) if ledger else default_ledger()
    return EvidencePaths(ledger_path, markdown_path_for(ledger_path, markdown), ledger_path.parent / "receipts")


def preflight_evidence(ledger: str | Path | None, head: bool = True) -> EvidencePaths:
    """Check that a run's evidence can be recorded, before any engine runs; nothing is created.

    Refuses with ``InvalidInput`` (exit 2, one line) when: the ledger path is ambiguous or its
    rendering path holds a file the harness did not write; the ledger, its lock file or the
    rendering exists read-only or is not a regular file; the receipts folder, or the folder any
    of them would be created in, cannot be written (``harness.fschecks``); the receipts or
    reports folder is a symbolic link (followed, it would put evidence outside the evidence
    folder: docs/release.md, "Hostile evidence folders and inputs"); or, with ``head``, the
    ledger's last row cannot be extended (partial, malformed or edited: ``check_ledger_head``;
    the door checks it again under the lock before it writes anything).
    """
    paths = evidence_paths(ledger)
    _check_writable(paths)
    if head:
        check_ledger_head(paths.ledger)
    return paths


def _check_writable(paths: EvidencePaths) -> None:
    """The file checks of ``preflight_evidence`` (links, writability), none of them in an evidence
    module: ``harness.fschecks``. Raises ``InvalidInput``."""
    for folder, what in ((paths.receipts, "receipts folder"), (paths.ledger.parent / "reports", "reports folder")):
        if folder.is_symlink():  # evidence stays inside its folder (the ledger, lock and cache files are refused as links too)
            raise InvalidInput(f"{folder}: the {what} is a symbolic link; evidence is written only inside {paths.ledger.parent}")
    require_writable_file(paths.ledger, "ledger")
    require_writable_file(str(paths.ledger) + ".lock", "ledger lock file")
    require_writable_file(paths.markdown, "rendered ledger", replace=True)
    require_writable_dir(paths.receipts, "receipts folder")


def record(paths: EvidencePaths, *, receipt: Mapping[str, Any] | None = None, arrays: Mapping[str, np.ndarray] | None = None,
           row: Mapping[str, Any] | None = None, receipt_path: str | Path | None = None, index: bool = True,
           page: Explanation | None = None, documents: Mapping[Path, bytes] | None = None, lock_timeout: float = 120.0) -> Recorded:
    """The evidence door (module docstring): under the ledger's lock (``chain.append``), once the
    head is known to be extendable, write ``receipt`` (with ``arrays``: per-position numeric
    arrays, into ``paths.receipts``), append its row (``row`` fields over it, e.g. a merged row's
    time; without a receipt, ``row`` is the whole row and ``receipt_path`` the existing receipt
    file it binds, if any), update the query cache, rewrite the LEDGER.md pages, with ``page``
    (what the caller looked up for it: ``harness.runs.explain.explain``) write the receipt's
    verdict page, and with ``index`` the reports index: each once. ``documents`` (path: bytes) are
    files the receipt binds by sha256, written with it (``receipts.write_receipt``).

    The row carries this run's timings (``receipt``'s, ``rows.receipt_row``), also when an
    identical earlier run wrote the receipt file. Raises ``InvalidInput`` when the receipt breaks
    its schema or cannot be written, the row breaks the row schema or names another receipt, the
    ledger's last row cannot be extended (nothing is written then), the lock is not taken within
    ``lock_timeout`` seconds, or the ledger or LEDGER.md cannot be written (naming the row
    already appended). A verdict page or index that cannot be written is a warning line.
    """
    written: list[dict[str, Any]] = []  # the receipt as on disk, once written
    bound: list[Path | None] = [Path(receipt_path) if receipt_path is not None else None]
    shown: list[Path | None] = [None]
    held = {k: np.asarray(v) for k, v in (arrays or {}).items()}

    def make_row() -> tuple[Mapping[str, Any], Path | None]:
        if receipt is None:
            return row or {}, bound[0]
        bound[0], _ = write_receipt(receipt, held, paths.receipts, documents)
        written.append(json.loads(bound[0].read_text(encoding="utf-8")))
        return {**receipt_row(written[0], receipt), **(row or {})}, bound[0]

    def render(new: dict[str, Any]) -> None:
        def renderings(cache: LedgerCache) -> None:
            try:
                render_pages(paths.ledger, paths.markdown, cache=cache)
            except OSError as e:
                raise InvalidInput(f"{paths.markdown}: row seq {new['seq']} was appended to {paths.ledger}, but the rendering "
                                   f"could not be rewritten ({e.strerror or e}); the next append re-renders it") from None
            if page is not None and written and bound[0] is not None:
                shown[0] = _page_quietly(written[0], held, bound[0], page)
            if index:
                _index_quietly(paths.ledger, cache, written)

        LedgerCache.use(paths.ledger, CACHE_COLUMNS, renderings)  # the query cache reads the new line

    new = append(paths.ledger, make_row, render, lock_timeout=lock_timeout)
    return Recorded(written[0] if written else None, bound[0], new, paths.ledger, shown[0])


def _page_quietly(rec: dict[str, Any], arrays: Mapping[str, np.ndarray], json_path: Path, page: Explanation) -> Path | None:
    """``render_report`` of the receipt just written into its default folder; a failure is one
    warning line on stderr and None (the page is a rendering of evidence already written)."""
    try:
        return render_report(rec, arrays, json_path, None, page)
    except OSError as e:
        sys.stderr.write(f"harness: warning: report not written: {untrusted(e.strerror or e)}\n")
    except HarnessError as e:
        sys.stderr.write(f"harness: warning: report not written: {untrusted(e)}\n")
    return None


def _index_quietly(ledger_path: Path, cache: LedgerCache, written: list[dict[str, Any]]) -> None:
    """``render_index`` from the door's cache, the new receipt given so it is not read again; a
    failure is one warning line on stderr (the index is only a rendering of the ledger)."""
    try:
        render_index(ledger_path, cache, known=written)
    except OSError as e:
        sys.stderr.write(f"harness: warning: evidence index not regenerated: {untrusted(e.strerror or e)}\n")
    except HarnessError as e:
        sys.stderr.write(f"harness: warning: evidence index not regenerated: {untrusted(e)}\n")


def _door_paths(ledger: str | Path | EvidencePaths | None) -> EvidencePaths:
    """The paths a run hands the door: its preflight's ``EvidencePaths`` checked again (cheaply:
    the files may have changed while the engines ran), or a ledger path preflighted here (the head
    is checked by ``record`` under the lock). Raises ``InvalidInput``."""
    if isinstance(ledger, EvidencePaths):
        _check_writable(ledger)
        return ledger
    return preflight_evidence(ledger, head=False)


def record_evidence(receipt: Mapping[str, Any], arrays: Mapping[str, np.ndarray], ledger: str | Path | EvidencePaths | None,
                    page: Explanation | None = None) -> Recorded:
    """A run's new receipt through the door. ``ledger``: the ``EvidencePaths`` the run's
    ``preflight_evidence`` returned (their files are checked again, cheaply, since they may have
    changed while the engines ran), or a ledger path (None: ``default_ledger()``), preflighted
    here; the head is checked by ``record`` under the lock, before the receipt is written.
    ``page``: write the receipt's verdict page too (``record``). Raises as they do."""
    return record(_door_paths(ledger), receipt=receipt, arrays=arrays, page=page)


def record_discharge(ledger: str | Path | EvidencePaths | None, receipt: Mapping[str, Any], documents: Mapping[Path, bytes]) -> Recorded:
    """A discharge through the door (``harness discharge``): its obligation records ``documents``
    (path: the bytes whose sha256 ``receipt`` names) and its ``harness-discharge-receipt/v1``
    receipt written, its row appended, the cache, LEDGER.md and the reports index refreshed, each
    once, under the ledger's lock; nothing is written when the ledger's head cannot be extended.
    ``ledger``: as ``record_evidence``. Raises as ``record`` does."""
    return record(_door_paths(ledger), receipt=receipt, documents=documents)


def record_row(ledger: str | Path | None, row: Mapping[str, Any], receipt_path: str | Path | None = None,
               markdown: str | Path | None = None) -> dict[str, Any]:
    """A row without a new receipt through the door (a sign-off, a supersede row, a receipt a
    killed sweep wrote, a merged host's receipt): ``record`` with the reports index; returns the
    row. Raises as ``record`` does, and ``InvalidInput`` for a refused ledger or rendering path."""
    return record(evidence_paths(ledger, markdown), row=row, receipt_path=receipt_path).row


def append_row(ledger_path: str | Path, row: Mapping[str, Any], receipt_path: str | Path | None = None,
               markdown_path: str | Path | None = None, *, lock_timeout: float = 120.0) -> dict[str, Any]:
    """The library call of earlier releases: ``record`` of ``row`` without the reports index
    (the ledger, the query cache and LEDGER.md only); returns the row. Every command uses
    ``record_evidence`` or ``record_row``. Raises as ``record`` does."""
    paths = evidence_paths(ledger_path, markdown_path)
    return record(paths, row=row, receipt_path=receipt_path, index=False, lock_timeout=lock_timeout).row
