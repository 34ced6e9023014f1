"""Recording a run's evidence: its receipt (JSON + array sidecar) and its ledger row, in that
order, the one path every command that writes evidence takes (parity, probe, and what builds on
them), followed by the evidence index (``harness.evidence.index``: reports/index.md and .html),
a rendering regenerated from the ledger that never stands in for it.

Layout: ``<ledger dir>/receipts/<id>.json`` and ``<id>.npz`` beside the ledger (by default the
project's: ``[tool.harness] ledger``, else ``<evidence>/parity/ledger.jsonl`` with ``<evidence>``
= ``[tool.harness] evidence`` or ``evidence/`` at the project root, ``harness.config``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from harness.config import load_config
from harness.evidence.index import refresh_index_quietly
from harness.evidence.ledger import append_row, row_from_receipt, timing_fields
from harness.evidence.receipts import write_receipt


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


def record_evidence(receipt: Mapping[str, Any], arrays: Mapping[str, np.ndarray], ledger: str | Path | None) -> Recorded:
    """Write ``receipt`` (and ``arrays``, per-position float/int arrays) into the receipts folder
    beside ``ledger`` (None: ``default_ledger()``), then append its row to the ledger, then
    regenerate the evidence index (a failure there is a warning, not an error).

    Raises ``InvalidInput`` (receipt breaks its schema, an unwritable folder) and whatever
    ``append_row`` raises (a ledger that does not verify, a lock not obtained in time).
    """
    ledger_path = Path(ledger) if ledger else default_ledger()
    json_path, _ = write_receipt(receipt, {k: np.asarray(v) for k, v in arrays.items()}, ledger_path.parent / "receipts")
    written = json.loads(json_path.read_text())
    # The row carries this run's timings (``receipt``), also when an identical earlier run wrote
    # the receipt file (``written``) and so its timings.
    row = append_row(ledger_path, {**row_from_receipt(written), **timing_fields(receipt)}, json_path)
    refresh_index_quietly(ledger_path)
    return Recorded(written, json_path, row, ledger_path)
