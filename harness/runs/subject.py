"""The calibrated tier measured on the subject itself and recorded (reused by
``harness.judge.calibrated``).

Where no committed row of thresholds.yaml fits a subject (a file type or compute class never
measured, or a model more than twice the size of every row's basis model), ``harness parity``
measures the tier on the subject (``calibrate.calibrate_subject``) unless told not to, records it
as a calibration receipt (``harness-calibration-receipt/v1``) and a ``calibration`` ledger row,
and copies the derived gates and that receipt's id into the parity receipt, so a reviewer can
re-run it. A later run on the same model (sha256) and class reuses the recorded row.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

from harness.evidence.receipts import harness_info, host_info
from harness.evidence.record import record_evidence
from harness.judge.calibrated import row_from_calibration_receipt
from harness.judge.tiers import Row
from harness.paths import SOURCE_ROOT
from harness.runs.calibrate import SubjectCalibration, calibrate_subject


def calibration_receipt(sc: SubjectCalibration, argv: list[str]) -> dict[str, Any]:
    """The ``harness-calibration-receipt/v1`` dict of a subject calibration (before id/arrays)."""
    mm = sc.model
    return {
        "schema": "harness-calibration-receipt/v1",
        "kind": "calibration",
        "host": host_info(),
        "harness": harness_info(SOURCE_ROOT),
        "command": argv,
        "model": {"path": str(mm.path), "name": mm.spec, "sha256": mm.dims["sha256"], "arch": mm.dims["arch"],
                  "file_type": mm.file_type, "weights": mm.weights, "n_layer": mm.dims["n_layer"], "n_embd": mm.dims["n_embd"]},
        "compute_class": sc.row.compute_class,
        "row": sc.row.to_receipt(),
        "pairs": [p.to_dict() for p in sc.goods],
        "positions": sum(p.n for p in sc.goods),
        "verdict": "MEASURED",
        "skipped": sc.skipped,
    }


def measure_and_record(spec: str, compute_class: str, ledger: str | Path | None, argv: list[str] | None = None,
                       max_tokens: int = 128, log: Callable[[str], None] = print) -> tuple[Row, str, Path]:
    """Measure the tier on ``spec`` for ``compute_class``, write its receipt and ledger row;
    return (row, receipt id, receipt path). Raises what ``calibrate_subject`` raises."""
    sc = calibrate_subject(spec, compute_class, max_tokens=max_tokens, log=log)
    argv = argv or ["harness", "calibrate", "--model", spec, "--class", compute_class]
    rec = record_evidence(calibration_receipt(sc, argv), {}, ledger)
    return row_from_calibration_receipt(rec.receipt, rec.receipt["id"]), rec.receipt["id"], rec.receipt_path


def describe_row(row: Row) -> str:
    """One line: the row's gates."""
    g = row.gates
    parts = [f"cosine ≥ {g['min_cosine']['value']}"] + [f"{n} ≤ {g[n]['value']}" for n in ("max_kld_mean", "max_kld_p99") if n in g]
    return ", ".join(parts)
