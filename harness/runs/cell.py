"""What every logit cell shares (the parity cell, ``harness.runs.parity``, and the top-k cell,
``harness.runs.topk``): the request, what was measured and judged, the receipt built from it,
and the last step that completes the receipt (free-running greedy, timings) and records it with
its ledger row.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np

from harness.engines.base import Engine
from harness.errors import HarnessError, NotComparable, Verdict
from harness.evidence.receipts import harness_info, host_info, prepare_receipt
from harness.evidence.record import EvidencePaths, record_evidence
from harness.judge.calibrated import MeasureTier
from harness.judge.thresholds import ResolvedThresholds
from harness.measure.prompts import PromptTokens
from harness.measure.text_windows import DEFAULT_CTX
from harness.model.gguf_model import GGUFModel
from harness.paths import SOURCE_ROOT
from harness.runs import greedy
from harness.runs.explain import explain
from harness.runs.inputs import RunInputs, RunRequest, engine_record

Progress = Callable[[str, int, int], None]
"""``progress(prompt_id, positions_done, positions_total)``."""


@dataclass
class CellResult:
    """Everything a parity cell measured; ``per_position`` arrays are concatenated over prompts
    (``prompt_index`` and ``position`` say where each row came from)."""

    verdict: Verdict
    kind: str  # "parity" or "self-consistency"
    prompts: list[PromptTokens]
    per_position: dict[str, np.ndarray]
    summary: dict[str, Any]
    per_prompt: list[dict[str, Any]]
    gate: dict[str, Any]
    candidate_info: dict[str, Any]
    reference_info: dict[str, Any]
    n_vocab: int
    message: str = ""


def check_comparable(model: GGUFModel, reference: Engine, candidate: Engine, prompts: list[PromptTokens]) -> int:
    """The shared vocab size of both engines and the model. Raises ``NotComparable`` when the
    vocab sizes differ or a token id is outside the vocab."""
    n_vocab_ref, n_vocab_cand = int(reference.n_vocab), int(candidate.n_vocab)
    if n_vocab_ref != n_vocab_cand:
        raise NotComparable(f"vocab sizes differ: reference {n_vocab_ref}, candidate {n_vocab_cand}")
    n_model = model.hparams.n_vocab
    if n_model and n_model != n_vocab_ref:
        raise NotComparable(f"engines report vocab {n_vocab_ref} but the model's token list has {n_model}")
    for p in prompts:
        bad = [t for t in p.tokens if not 0 <= t < n_vocab_ref]
        if bad:
            raise NotComparable(f"prompt {p.id!r}: token id {bad[0]} outside the vocab [0, {n_vocab_ref})")
    return n_vocab_ref


@dataclass
class Measured:
    """Both engines run over the prompts: per-position metrics (concatenated, with
    ``prompt_index``/``position``), the report-only summary, and both engines' infos."""

    prompts: list[PromptTokens]
    per_position: dict[str, np.ndarray]
    summary: dict[str, Any]
    candidate_info: dict[str, Any]
    reference_info: dict[str, Any]
    n_vocab: int

    def where(self, idx: int | None) -> dict[str, Any] | None:
        """``{prompt, position, token}`` of a concatenated index."""
        if idx is None:
            return None
        pi, pos = int(self.per_position["prompt_index"][idx]), int(self.per_position["position"][idx])
        return {"prompt": self.prompts[pi].id, "position": pos, "token": int(self.prompts[pi].tokens[pos])}


@dataclass(kw_only=True)
class ParityRequest(RunRequest):
    """Inputs of one ``harness parity`` cell (``RunRequest``), and how the calibrated tier is
    found when no committed row fits: ``measure_tier`` (measures it on the model:
    ``harness.runs.subject.measure_and_record``; None leaves it unmeasured), ``require_calibrated``
    (an unmeasured tier makes the verdict UNMEASURED), ``calibrate_max_tokens`` (per prompt);
    ``candidate_settings`` are engine-specific (``dtype`` for ``transformers``)."""

    measure_tier: MeasureTier | None = None
    require_calibrated: bool = False
    calibrate_max_tokens: int = 128
    candidate_settings: dict[str, Any] = field(default_factory=dict)
    greedy_tokens: int = greedy.DEFAULT_TOKENS
    """Free-running greedy steps per prompt (``harness.runs.greedy``, report-only); 0: skipped."""
    reference_cache: bool = True
    """Read and store the reference's logits in the content-addressed cache
    (``harness.runs.reference_cache``; its folder from the environment); False: always run it."""
    text: str | None = None
    """``--text FILE``: the prompts are this text's windows of ``ctx`` tokens, as ``llama-perplexity``
    cuts them (``harness.measure.text_windows``), instead of the prompt set."""
    ctx: int = DEFAULT_CTX
    """``--ctx N``: the window length in tokens with ``text`` (``llama-perplexity``'s ``n_ctx``)."""
    score_second_half: bool = False
    """``--score-second-half`` (with ``text``): compare and judge only each window's positions from
    ``ctx // 2`` on, the rows ``llama-perplexity`` asks llama.cpp for, each engine asked for those
    rows alone where it can (``PromptTokens.judge_from``)."""


@dataclass
class ParityOutcome:
    """A finished cell: its result, the receipt as written, and where evidence went."""

    result: CellResult
    receipt: dict[str, Any]
    receipt_path: Path | None
    ledger_row: dict[str, Any] | None
    ledger_path: Path | None
    calibration_receipt: Path | None = None
    report_path: Path | None = None
    """The verdict page's ``report.md``, when the run asked for it (``req.report``) and it was written."""


def build_receipt(req: ParityRequest, inputs: RunInputs, result: CellResult, resolved: ResolvedThresholds,
                  self_calibration: str | None = None) -> dict[str, Any]:
    """The receipt dict (schema ``harness-parity-receipt/v1``, before id/arrays are added)."""
    prompt_set = inputs.prompt_set
    return {
        "kind": result.kind,
        "host": host_info(),
        "harness": harness_info(SOURCE_ROOT),
        "command": list(req.argv) or ["harness", "parity"],
        "model": inputs.model_record(),
        "engines": {"reference": engine_record(result.reference_info, req.reference),
                    "candidate": engine_record(result.candidate_info, req.candidate, req.candidate_settings)},
        "prompts": {
            "id": prompt_set.id,
            "path": str(prompt_set.path),
            "sha256": prompt_set.sha256,
            "count": len(result.prompts),
            "positions": sum(len(p.tokens) for p in result.prompts),
            "items": [{"id": p.id, "source": p.source, "tokens": p.tokens} for p in result.prompts],
        },
        "thresholds": {**resolved.to_receipt(), "self_calibration": self_calibration},
        "gated": {"verdict": result.verdict.value, "message": result.message, **result.gate},
        "report_only": result.summary,
        "per_prompt": result.per_prompt,
    }


@contextmanager
def _timings_kept(*engines: Any) -> Iterator[None]:
    """Restore each engine's own ``timings`` dict (llama.cpp's summed load/decode seconds) after
    the block: free-running generation is not part of the prefill speed a receipt records."""
    saved = [(e, dict(e.timings)) for e in engines if isinstance(getattr(e, "timings", None), dict)]
    try:
        yield
    finally:
        for e, t in saved:
            e.timings.clear()
            e.timings.update(t)


def _add_free_running(req: ParityRequest, inputs: RunInputs, reference: Any, candidate: Any, prompts: list[PromptTokens],
                      receipt: dict[str, Any]) -> None:
    """Free-running greedy (``harness.runs.greedy``, ``req.greedy_tokens`` steps per prompt)
    into ``receipt["report_only"]["free_running"]``; report-only, so an engine that cannot
    generate gives an ``unmeasured`` entry and never changes the verdict."""
    if req.greedy_tokens <= 0:
        return
    try:
        with _timings_kept(reference.engine, candidate.engine):  # the timings stay those of the gated comparison
            fr = greedy.free_running(reference.engine, candidate.engine, prompts, req.greedy_tokens, greedy.eos_token_ids(inputs.model),
                                     inputs.thresholds.near_tie_margin)
    except HarnessError as e:
        fr = {"n_tokens": req.greedy_tokens, "unmeasured": f"{e.verdict.value}: {str(e).splitlines()[0][:300]}"}
    receipt["report_only"]["free_running"] = fr


def finish(req: ParityRequest, inputs: RunInputs, reference: Any, candidate: Any, prompts: list[PromptTokens], result: CellResult,
           receipt: dict[str, Any], cal_path: Path | None = None, reference_cache: dict[str, Any] | None = None,
           evidence: EvidencePaths | None = None, log: Callable[[str], None] | None = None) -> ParityOutcome:
    """A judged cell's receipt completed (free-running greedy, both engines' timings, whether the
    reference's rows came from the cache: ``reference_cache``, ``ReferenceCache.record()``) and,
    unless ``req.write_evidence`` is off, recorded through the evidence door (into ``evidence``,
    the paths the run's preflight resolved, else ``req.ledger``) with its ledger row and, with
    ``req.report``, its verdict page (``harness.runs.explain.explain``, localizing as
    ``req.localize`` says; ``log`` hears its progress); a dry run still refuses the receipt a
    recording run would refuse (``prepare_receipt``)."""
    _add_free_running(req, inputs, reference, candidate, prompts, receipt)
    receipt["timings"] = {"reference": reference.timings(), "candidate": candidate.timings()}
    receipt["timings"]["reference_cache"] = reference_cache or {"enabled": False}
    if not req.write_evidence:
        prepare_receipt(receipt, result.per_position)
        return ParityOutcome(result, receipt, None, None, None)
    page = explain(receipt, req.localize, log, inputs.model) if req.report else None
    rec = record_evidence(receipt, result.per_position, evidence or req.ledger, page)
    return ParityOutcome(result, rec.receipt, rec.receipt_path, rec.row, rec.ledger_path, cal_path, rec.report_path)
