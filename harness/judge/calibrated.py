"""Which calibrated row judges a run: the committed row that fits, else one measured on this model
before (a calibration receipt in the ledger), else — when the caller can measure it — one
measured now, else none (the tier is UNMEASURED, with the command that would measure it).

Measuring (``harness.runs.subject.measure_and_record``) sits above this layer, so a caller that
wants it passes it in (``harness parity`` and ``harness probe`` do; ``--no-calibrate`` does not).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any, Callable

from harness.errors import InvalidInput
from harness.evidence.ledger import read_rows
from harness.evidence.receipts import load_receipt, receipt_file
from harness.evidence.record import default_ledger
from harness.judge.thresholds import ResolvedThresholds
from harness.judge.tiers import Row, calibrate_command

MeasureTier = Callable[..., tuple[Row, str, Path]]
"""``measure(model_spec, compute_class, ledger, max_tokens=, log=)`` → (row, receipt id, receipt
path): ``harness.runs.subject.measure_and_record``."""


def row_from_calibration_receipt(receipt: dict[str, Any], receipt_id: str) -> Row:
    """The ``Row`` a ``harness-calibration-receipt/v1`` recorded (its source names the receipt)."""
    r = receipt["row"]
    return Row(r["weights"], r["compute_class"], tuple(r["basis_models"]), r["gates"], r.get("probes", {}),
               f"calibration receipt {receipt_id[:12]}", r.get("file_type", ""), max_tokens=r.get("max_tokens"))


def find_recorded(ledger: str | Path | None, model_sha256: str, compute_class: str) -> tuple[Row, str] | None:
    """The newest recorded calibration of this model and class in ``ledger``: (row, receipt id),
    or None. Receipts that fail to load are passed over (``harness ledger verify`` reports them)."""
    ledger_path = Path(ledger) if ledger else default_ledger()
    if not ledger_path.exists():
        return None
    for row in reversed(read_rows(ledger_path)):
        if row.get("kind") != "calibration" or row.get("model_sha256") != model_sha256 or row.get("compute_class") != compute_class:
            continue
        try:
            rec = load_receipt(receipt_file(ledger_path.parent / "receipts", row["receipt_id"])).receipt
        except InvalidInput:
            continue
        return row_from_calibration_receipt(rec, rec["id"]), rec["id"]
    return None


def resolve_row(resolved: ResolvedThresholds, model_spec: str, ledger: str | Path | None, measure: MeasureTier | None,
                max_tokens: int = 128, log: Callable[[str], None] | None = None
                ) -> tuple[ResolvedThresholds, str | None, Path | None, str | None]:
    """The thresholds with the calibrated row for a run (module docstring). Returns (thresholds,
    calibration receipt id, its path when written now, the command that would measure the tier
    when it stays unmeasured)."""
    if resolved.row is not None:
        return resolved, None, None, None
    s = resolved.subject
    found = find_recorded(ledger, s.sha256, s.compute_class)
    if found:
        return resolved.with_row(found[0]), found[1], None, None
    command = calibrate_command(model_spec, s.compute_class)
    if measure is None:
        return resolved, None, None, command
    try:
        row, rid, path = measure(model_spec, s.compute_class, ledger, max_tokens=max_tokens, log=log or (lambda m: None))
    except InvalidInput as e:  # e.g. a bf16 class without a real engine of it here: say so, judge by the release gate
        return replace(resolved, row_misfit=f"{resolved.row_misfit}; measuring it here failed: {e}"), None, None, command
    return resolved.with_row(row), rid, path, None
