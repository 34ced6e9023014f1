"""The sign-off ledger, one import away: ``harness.evidence.ledger`` re-exports the ledger's modules.

``evidence/parity/ledger.jsonl`` is the source of truth: one canonical-JSON row per line, each
carrying the hash of the row before it and its own, and the sha256 of its receipt file; LEDGER.md
is its rendering. The ledger is five modules, each one thing (docs/design.md, "The evidence
layer"):

- ``rows``: the row's fields, schema and hash, the row a receipt determines, reading rows;
- ``chain``: the ledger's file lock and the chained append of one line;
- ``pages``: LEDGER.md and its older pages (paths, rendering, the pages an append changed, and
  their check);
- ``verify``: ``verify_ledger`` (full, deep, incremental from a ``Checkpoint``);
- ``views``: the pandas frames, summaries, filters and trends of ``ledger show``.

Evidence enters through one door, ``harness.evidence.record.record`` (receipt, row, query cache,
pages, index, each once under the lock); ``append_row`` here is that door without the index, kept
for the callers of earlier releases. Nothing in ``harness.evidence`` imports this module.
"""

from __future__ import annotations

import sys
import types

from harness.evidence import chain, pages, record, rows, verify, views
from harness.evidence.receipts import canonical_json  # noqa: F401  (re-exported, as before the split)

from harness.evidence.rows import (  # noqa: F401
    CACHE_COLUMNS, _complete, FREE_RUNNING_FIELD, free_running_headline, GENESIS, KINDS, OPTIONAL_FIELDS,
    Problem, read_rows, RECEIPT_FIELDS, REPORT_ONLY_MIN_RECORDS, ROW_FIELDS, row_from_receipt,
    receipt_row, row_hash, ROW_SCHEMA, SIGNOFF_FIELDS, supersede_row, TIER_FIELDS, TIMING_FIELDS, timing_fields,
)
from harness.evidence.chain import (  # noqa: F401
    append, check_ledger_head, ledger_lock, LOCK_NOTICE_EVERY_S, LOCK_NOTICE_S, MakeRow, Timeout,
)
from harness.evidence.pages import (  # noqa: F401
    default_markdown_path, join_pages, linked_pages, markdown_path_for, PAGE_LINKS, page_of,
    page_path, PAGE_ROWS, page_seqs, pages_dir, render_markdown, render_page, render_pages,
    RENDER_TITLE, rendered_head_seq, _write_text_atomic,
)
from harness.evidence.verify import (  # noqa: F401
    Checkpoint, CHECKPOINT_MAX_BYTES, default_checkpoint_path, _ReceiptHasher, _sha256_of, verify_ledger, VerifyStats,
)
from harness.evidence.views import (  # noqa: F401
    candidate_trends, engine_name, filter_frame, ledger_frame, _num, pd,
    proposed_report_only_thresholds, summarize_ledger,
)
from harness.evidence.record import append_row  # noqa: F401

_MODULES = (rows, chain, pages, verify, views, record)


class _Facade(types.ModuleType):
    """This module, forwarding an attribute set on it (``monkeypatch.setattr(ledger, "PAGE_ROWS",
    4)``, as callers and tests of the single module did) to every ledger module holding the same
    object, so the setting reaches the code that reads it."""

    def __setattr__(self, name: str, value: object) -> None:
        old = self.__dict__.get(name, _MISSING)
        if old is not _MISSING:
            for m in _MODULES:
                if m.__dict__.get(name, _MISSING) is old:
                    setattr(m, name, value)
        super().__setattr__(name, value)


_MISSING = object()
sys.modules[__name__].__class__ = _Facade
__all__ = [
    "CACHE_COLUMNS", "CHECKPOINT_MAX_BYTES", "Checkpoint", "FREE_RUNNING_FIELD", "GENESIS", "KINDS",
    "LOCK_NOTICE_EVERY_S", "LOCK_NOTICE_S", "OPTIONAL_FIELDS", "PAGE_LINKS", "PAGE_ROWS", "Problem",
    "RECEIPT_FIELDS", "RENDER_TITLE", "REPORT_ONLY_MIN_RECORDS", "ROW_FIELDS", "ROW_SCHEMA",
    "SIGNOFF_FIELDS", "TIER_FIELDS", "TIMING_FIELDS", "VerifyStats", "append", "append_row",
    "candidate_trends", "check_ledger_head", "default_checkpoint_path", "default_markdown_path",
    "engine_name", "filter_frame", "free_running_headline", "join_pages", "ledger_frame",
    "ledger_lock", "linked_pages", "markdown_path_for", "page_of", "page_path",
    "page_seqs", "pages_dir", "proposed_report_only_thresholds", "read_rows", "receipt_row", "render_markdown",
    "render_page", "render_pages", "rendered_head_seq", "row_from_receipt", "row_hash",
    "summarize_ledger", "supersede_row", "timing_fields", "verify_ledger"
]
