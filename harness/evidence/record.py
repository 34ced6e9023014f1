"""Recording a run's evidence: its receipt (JSON + array sidecar) and its ledger row, in that
order, the one path every command that writes evidence takes (parity, probe, and what builds on
them), followed by the evidence index (``harness.evidence.index``: reports/index.md and .html),
a rendering regenerated from the ledger that never stands in for it.

Layout: ``<ledger dir>/receipts/<id>.json`` and ``<id>.npz`` beside the ledger (by default the
project's: ``[tool.harness] ledger``, else ``<evidence>/parity/ledger.jsonl`` with ``<evidence>``
= ``[tool.harness] evidence`` or ``evidence/`` at the project root, ``harness.config``), and the
ledger's Markdown rendering (``ledger.markdown_path_for``).

``preflight_evidence`` checks, before any engine runs, everything ``record_evidence`` will need
to write, so a run never spends engine time and then fails to record (or records a receipt
without its row).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from harness.config import load_config
from harness.errors import InvalidInput
from harness.evidence.index import refresh_index_quietly
from harness.evidence.ledger import (
    append_row,
    check_ledger_head,
    markdown_path_for,
    row_from_receipt,
    timing_fields,
)
from harness.evidence.receipts import write_receipt
from harness.fschecks import require_writable_dir, require_writable_file


def default_ledger() -> Path:
    """The current project's ledger (module docstring). Raises ``InvalidInput`` for a bad config."""
    return load_config().ledger


@dataclass
class Recorded:
    """What ``record_evidence`` wrote: the receipt as on disk, its path, the ledger row and the
    ledger it was appended to."""

    receipt: dict[str, Any]
    receipt_path: Path
    row: dict[str, Any]
    ledger_path: Path


@dataclass(frozen=True)
class EvidencePaths:
    """Where a run's evidence goes: the ledger, its rendering and the receipts folder."""

    ledger: Path
    markdown: Path
    receipts: Path


def evidence_paths(ledger: str | Path | None) -> EvidencePaths:
    """The paths for ``ledger`` (None: ``default_ledger()``); raises ``InvalidInput`` for an
    ambiguous ledger path or a rendering path holding a file the harness did not write
    (``markdown_path_for``)."""
    ledger_path = Path(ledger) if ledger else default_ledger()
    return EvidencePaths(ledger_path, markdown_path_for(ledger_path), ledger_path.parent / "receipts")


def preflight_evidence(ledger: str | Path | None) -> EvidencePaths:
    """Check that a run's evidence can be recorded, before any engine runs; nothing is created.

    Refuses with ``InvalidInput`` (exit 2, one line) when: the ledger path is ambiguous or its
    rendering path holds a file the harness did not write; the ledger, its lock file or the
    rendering exists read-only or is not a regular file; the receipts folder, or the folder any
    of them would be created in, cannot be written (``harness.fschecks``); the receipts or
    reports folder is a symbolic link (followed, it would put evidence outside the evidence
    folder: docs/release.md, "Hostile evidence folders and inputs"); or the ledger's last
    row cannot be extended (partial, malformed or edited: ``check_ledger_head``).
    """
    paths = evidence_paths(ledger)
    for folder, what in ((paths.receipts, "receipts folder"), (paths.ledger.parent / "reports", "reports folder")):
        if folder.is_symlink():  # evidence stays inside its folder (the ledger, lock and cache files are refused as links too)
            raise InvalidInput(f"{folder}: the {what} is a symbolic link; evidence is written only inside {paths.ledger.parent}")
    require_writable_file(paths.ledger, "ledger")
    require_writable_file(str(paths.ledger) + ".lock", "ledger lock file")
    require_writable_file(paths.markdown, "rendered ledger", replace=True)
    require_writable_dir(paths.receipts, "receipts folder")
    check_ledger_head(paths.ledger)
    return paths


def record_evidence(receipt: Mapping[str, Any], arrays: Mapping[str, np.ndarray], ledger: str | Path | None) -> Recorded:
    """Write ``receipt`` (and ``arrays``, per-position float/int arrays) into the receipts folder
    beside ``ledger`` (None: ``default_ledger()``), then append its row to the ledger, then
    regenerate the evidence index (a failure there is a warning, not an error).

    Runs ``preflight_evidence`` again first (cheap), so nothing is written when the row could
    not be. Raises ``InvalidInput`` (receipt breaks its schema, an unwritable or ambiguous path)
    and whatever ``append_row`` raises (a ledger that does not verify, a lock not obtained in
    time).
    """
    paths = preflight_evidence(ledger)
    json_path, _ = write_receipt(receipt, {k: np.asarray(v) for k, v in arrays.items()}, paths.receipts)
    written = json.loads(json_path.read_text(encoding="utf-8"))
    # The row carries this run's timings (``receipt``), also when an identical earlier run wrote
    # the receipt file (``written``) and so its timings.
    row = append_row(paths.ledger, {**row_from_receipt(written), **timing_fields(receipt)}, json_path, paths.markdown)
    refresh_index_quietly(paths.ledger)
    return Recorded(written, json_path, row, paths.ledger)
