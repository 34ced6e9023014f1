"""The exact check: a candidate that dequantizes, judged against the float64 oracle as well, on
low-bit i-quant files (issue 59; docs/gates.md, "The exact check on low-bit i-quant files").

On an i-quant file llama.cpp's CPU kernels round each quantized matmul's activations to 8 bits
(``ggml_vec_dot_iq2_xxs_q8_K`` and kin: ``vec_dot_type`` Q8_K), so the reference itself is off the
exact forward by about as much as a subtle trunk fault: on ``trained-qwen35-256-IQ2_M`` the
float64 oracle measures KLD mean 5.9e-4 against llama.cpp, and ``mutant:gdn-chunk-state-not-carried``
6.2e-4. The calibrated row for such a file is made from correct engines, so it admits both; no
bound on the distance from llama.cpp can tell them apart.

An engine that computes the file's weights dequantized to floats (no activation rounding) carries
none of that noise. Such an engine says so with the capability ``dequantized_weights`` (the
harness's own oracle, its mutants, mlx and transformers state it; a command engine states it in
its ``info.json``). On a file whose weights hold a low-bit i-quant type (``LOW_BIT_TYPES``), such a
candidate is also compared with the float64 oracle on the same prompts, and judged by the
calibrated row of the same architecture and class on float (F32) weights: the tier a correct
engine meets where nothing rounds the activations. A FAIL there fails the cell. An engine
without the capability is judged against llama.cpp alone, as before, and the check says it did
not run and why.

Cost: one more run of the candidate and one of the oracle over the cell's prompts.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Any, Callable

from harness.errors import HarnessError, Verdict
from harness.judge import tiers, verdicts
from harness.model.gguf_model import GGUFModel
from harness.runs.inputs import subject_of

CAPABILITY = "dequantized_weights"
"""An engine capability: it computes quantized weights dequantized to floats, its activations not
rounded for a quantized dot product (docs/engine-protocol.md)."""

LOW_BIT_TYPES = frozenset({"IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S"})
"""ggml tensor types of the low-bit i-quant file types (IQ1_S … IQ3_M; ``general.file_type`` IQ2_M
is IQ2_S and IQ3_S tensors) whose CPU dot products in llama.cpp round the activations to Q8_K:
a weights key holding any of them makes the exact check apply."""

FLOAT_WEIGHTS = ("F32", "ALL_F32")
"""The weights key and file type of the row the exact check judges by."""


@dataclass
class ExactCheck:
    """The exact check of one cell: ``status`` (``pass`` / ``fail`` / ``unmeasured``, or ``not-run``
    where the file is a low-bit i-quant one but the candidate does not dequantize), its one-line
    ``line``, the row it judged by (``row``: ``source`` and gates; None when none fits), the
    comparison's summary (``summary``: positions, min cosine, KLD mean and p99, where the worst
    position is) and ``seconds``."""

    status: str
    line: str
    row: dict[str, Any] | None = None
    summary: dict[str, Any] | None = None
    seconds: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        d = {"status": self.status, "line": self.line, "row": self.row, "summary": self.summary, "seconds": round(self.seconds, 3)}
        if self.status != "not-run":
            d["reference"] = "oracle (float64, the file's weights dequantized)"
        return d


def float_subject(subject: tiers.Subject) -> tiers.Subject:
    """``subject`` on float weights (``FLOAT_WEIGHTS``): the subject whose calibrated row judges the
    exact check (same architecture, class and shape)."""
    return replace(subject, weights=FLOAT_WEIGHTS[0], file_type=FLOAT_WEIGHTS[1])


def row_record(row: Any) -> dict[str, Any]:
    """The exact check's record of the row that judged it, as its receipt keeps it
    (``gated.exact_check.row``): ``source`` (``…thresholds.yaml calibrated[i]``), ``weights``,
    ``compute_class`` and ``gates`` (name → value; their bases are the row's in thresholds.yaml).
    ``harness.release.rejudge`` builds the same record from a thresholds file now to compare."""
    return {"source": row.source, "weights": row.weights, "compute_class": row.compute_class,
            "gates": {k: v["value"] for k, v in row.gates.items()}}


def low_bit_types(model: GGUFModel) -> list[str]:
    """The ``LOW_BIT_TYPES`` in ``model``'s weights key, sorted (empty: the check does not apply)."""
    return sorted(set(model.weights_key.split("+")) & LOW_BIT_TYPES)


def applies(model: GGUFModel, candidate_info: dict[str, Any]) -> bool:
    """Whether the exact check runs for this cell: the file holds a low-bit i-quant type, the
    candidate has the capability ``dequantized_weights`` and is not the oracle itself."""
    if not low_bit_types(model):
        return False
    name = str(candidate_info.get("name") or "")
    return CAPABILITY in (candidate_info.get("capabilities") or []) and name != "oracle"


def not_run_line(model: GGUFModel, candidate_info: dict[str, Any]) -> str | None:
    """Why the exact check did not run on a low-bit i-quant file (None: not such a file, or it ran)."""
    types = low_bit_types(model)
    if not types or applies(model, candidate_info):
        return None
    if str(candidate_info.get("name") or "") == "oracle":
        return None
    return (f"exact check: not run — the candidate does not state the capability {CAPABILITY!r}, so it is judged against "
            f"llama.cpp alone, whose activation rounding on {'/'.join(types)} hides faults below it (docs/gates.md)")


def run(model: GGUFModel, thresholds: Any, candidate: Any, candidate_info: dict[str, Any], prompts: list[Any],
        load_oracle: Callable[[], Any], measure: Callable[..., Any], near_tie_margin: float) -> ExactCheck:
    """Compare ``candidate`` with the float64 oracle on ``prompts`` (``measure``:
    ``harness.runs.parity.measure_cell``, the oracle as its reference) and judge the comparison by
    the calibrated row for F32 weights of the candidate's class and the model's architecture
    (``tiers.find_row`` over ``thresholds.rows``). ``load_oracle`` returns the oracle engine.

    Returns an ``ExactCheck``: ``unmeasured`` when the oracle cannot be loaded or run, or no row
    fits (its line says which), never a PASS then. Engine failures of the candidate propagate
    (``EngineError``), as in the cell's own comparison.
    """
    t0 = time.perf_counter()
    subject = float_subject(subject_of(model, candidate_info))
    row, misfit = tiers.find_row(thresholds.rows, subject)
    head = f"exact check (candidate against the float64 oracle on the dequantized weights, {subject.key_text()})"
    if row is None:
        return ExactCheck("unmeasured", f"{head}: UNMEASURED — {misfit}", seconds=time.perf_counter() - t0)
    row_rec = row_record(row)
    try:
        oracle = load_oracle()
    except HarnessError as e:
        return ExactCheck("unmeasured", f"{head}: UNMEASURED — the oracle could not be loaded ({str(e).splitlines()[0][:200]})",
                          row_rec, seconds=time.perf_counter() - t0)
    m = measure(model, oracle, candidate, prompts, near_tie_margin)
    tier = verdicts.judge_calibrated(m.per_position, m.summary, row, subject)
    s = m.summary
    kld = s.get("kld") or {}
    summary = {"positions": int(s["positions"]), "min_cosine": s["min_cosine"], "min_cosine_where": m.where(s["min_cosine_index"]),
               "kld_mean": kld.get("mean"), "kld_p99": kld.get("p99")}
    line = f"{head}: {tier.line}"
    status = {"ok": "pass", "fail": "fail"}.get(tier.status, "unmeasured")
    return ExactCheck(status, line, row_rec, summary, time.perf_counter() - t0)


def combine(verdict: Verdict, message: str, check: ExactCheck) -> tuple[Verdict, str]:
    """The cell's verdict and message with the exact check added: its FAIL fails the cell (its line
    first); otherwise its line is appended and the verdict stands."""
    if check.status == "fail":
        return Verdict.FAIL, f"{check.line}; {message}" if verdict is Verdict.FAIL else f"{check.line}; against llama.cpp: {message}"
    return verdict, f"{message}; {check.line}"

