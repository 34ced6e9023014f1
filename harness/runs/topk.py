"""The top-k cell: a parity cell whose candidate gives top-k logprobs (an ``http:NAME`` server),
measured with ``harness.measure.topk`` and judged by the top-k tier (``harness.judge.topk``); its
receipt and ledger row are a parity receipt's, written through ``harness.runs.cell``.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from harness.engines.base import Engine, TopK, checked_blocks
from harness.errors import EngineError, Verdict
from harness.judge import tiers, verdicts
from harness.judge import topk as topk_tier
from harness.measure import metrics, near_ties, topk
from harness.measure.prompts import PromptTokens
from harness.evidence.record import EvidencePaths
from harness.runs.cell import CellResult, Measured, ParityOutcome, ParityRequest, build_receipt, check_comparable, finish
from harness.runs.inputs import RunInputs


def measure_topk_prompts(reference: Any, candidate: Any, prompts: Sequence[Any], n_vocab: int, k: int | None = None) -> dict[str, np.ndarray]:
    """Top-k metrics of every prompt (``PER_POSITION_KEYS`` plus ``prompt_index``/``position``),
    concatenated: the reference's logits, block by block as it streams them (never ``[T, V]``),
    against ``candidate.topk`` (``[T, k]``) cut to ``k`` entries when given (a row measured with
    k judges k entries).

    Raises ``EngineError`` (either engine; the reference's non-finite logit naming the prompt and
    position) and ``NotComparable`` (the candidate's).
    """
    parts = []
    for i, p in enumerate(prompts):
        n = len(p.tokens)
        top = candidate.topk(p.tokens)
        if top.ids.shape[0] != n:
            raise EngineError(f"candidate {candidate.info.name} gave top-k rows for {top.ids.shape[0]} of {n} positions")
        top = topk.truncate(top, k) if k else top
        start = 0
        for block in checked_blocks(reference.logits(p.tokens), n):
            if block.shape[1] != n_vocab:
                raise EngineError(f"reference returned logits of width {block.shape[1]}; expected {n_vocab}")
            bad = np.flatnonzero(~np.isfinite(block).all(axis=1))
            if bad.size:
                raise EngineError(f"reference returned non-finite logits at prompt {p.id!r} position {start + int(bad[0])}")
            end = start + block.shape[0]
            dropped = None if top.dropped_max is None else top.dropped_max[start:end]
            parts.append({**topk.topk_position_metrics(block, TopK(top.ids[start:end], top.logprobs[start:end], dropped)),
                          "prompt_index": np.full(end - start, i, np.int32), "position": np.arange(start, end, dtype=np.int32)})
            start = end
    return metrics.concat_metrics(parts)


def topk_router_cuts(pp: dict[str, np.ndarray], row: tiers.Row | None, resolved: Any, model: Any, reference: Engine,
                     prompts: Sequence[PromptTokens]) -> near_ties.RouterCuts | None:
    """Where the top-k tier stops judging each prompt of an MoE model: ``near_ties.router_cuts``
    with a position outside the top-k row when its top-k KLD is above the row's p99 gate, and
    thresholds.yaml ``probes.moe_router_max_gap``, as the calibrated tier cuts a full-logits cell
    (``parity.router_cuts_for``). None where the rule does not apply: no top-k row, a dense model,
    a class or file it is not for (``near_ties.cuts_apply``), no gap in the thresholds file.

    Why: a correct server on an MoE model picks another expert where the reference's router is
    near a tie, and from there its recurrent state differs. llama-server on ``trained-qwen35moe``
    (F32) reached top-20 KLD 0.096 at prompt 0 position 724 and a KLD mean of 7.2e-5 against the
    f32 top-k row's 1e-6, whose known-good pairs were measured on each prompt's first 256 tokens
    (docs/gates.md, "Top-k cells on a model with experts")."""
    h = model.hparams
    gap = resolved.probes.get("moe_router_max_gap")
    if row is None or h.n_expert <= 0 or gap is None or "max_topk_kld_p99" not in row.gates \
            or not near_ties.cuts_apply(resolved.subject.compute_class, resolved.subject.weights):
        return None
    finite = np.asarray(pp["finite"], bool) & np.asarray(pp["ref_finite"], bool)
    with np.errstate(invalid="ignore"):
        outside = finite & (np.asarray(pp["kld"], np.float64) > float(row.gates["max_topk_kld_p99"]["value"]))
    return near_ties.router_cuts(pp, outside, prompts, reference, h.n_layer, h.n_expert_used, float(gap.value))


def topk_cell(inputs: RunInputs, reference: Engine, candidate: Any, prompts: list[PromptTokens]) -> tuple[CellResult, tiers.Row | None]:
    """Measure and judge a top-k cell (``harness.measure.topk``), and the top-k row used: the row
    that fits the subject and the candidate's k judges the top-k KLD mean and p99; the release
    gate's cosine is not computed and says so; no top-k row makes the verdict UNMEASURED, naming
    the command that measures one. Raises ``NotComparable`` and ``EngineError``."""
    n_vocab = check_comparable(inputs.model, reference, candidate, prompts)
    cinfo = candidate.info.to_dict()
    resolved = inputs.thresholds_for(cinfo)
    k = int(cinfo["settings"].get("max_logprobs") or 0)
    row, misfit = inputs.thresholds.resolve_topk(resolved.subject, k)
    pp = measure_topk_prompts(reference, candidate, prompts, n_vocab, row.k if row is not None else None)
    cinfo = candidate.info.to_dict()  # after the requests: it names the model the server answered for
    near = inputs.thresholds.near_tie_margin
    summary = topk.summarize_topk(pp, near)
    rel = topk_tier.release_not_computable(resolved.release_gates, k, int(summary["positions"]))
    cls = resolved.subject.compute_class
    cuts = topk_router_cuts(pp, row, resolved, inputs.model, reference, prompts)
    judged = summary if cuts is None or not cuts.count else topk.summarize_topk({n: np.asarray(v)[~cuts.mask] for n, v in pp.items()}, near)
    tier = topk_tier.judge_topk(judged, row, resolved.subject.key_text(), k, resolved.min_positions, misfit,
                                tiers.topk_calibrate_command(k, cls), cuts)
    verdict, msg = topk_tier.overall_topk(rel, tier)
    m = Measured(prompts, pp, summary, cinfo, reference.info.to_dict(), n_vocab)
    worst = (summary.get("kld") or {}).get("max_index")
    where = m.where(worst)
    if verdict is Verdict.FAIL and where is not None:
        msg += (f"; largest top-k KLD {summary['kld']['max']:.3g} at prompt {where['prompt']!r} position {where['position']}; "
                f"reproduce: {inputs.reproducer(candidate.info.name).harness('parity')}")
    cal = verdicts.TierResult("calibrated", "unmeasured", [], "calibrated tier: not applicable — its cosine and full-vocabulary "
                              "KLD gates need logits; the top-k tier judges this cell", None, "top-k candidate")
    gate = {
        "metric": "cosine", "min_cosine": resolved.release_min_cosine, "min_positions": resolved.min_positions,
        "positions": int(summary["positions"]), "failing_positions": 0, "first_failing": None, "worst": None,
        "worst_cosine": None, "min_cosine_observed": None, "min_cosine_where": None,
        "nonfinite_positions": int(summary["nonfinite_positions"]), "first_nonfinite": m.where(summary["first_nonfinite_index"]),
        "max_kld": (summary.get("kld") or {}).get("max"), "max_kld_where": where,
        "release": rel.to_dict(), "calibrated": cal.to_dict(), "topk": {**tier.to_dict(), "k": k, "row_k": row.k if row else None},
        "cosine_computed": False, "compute_class": cls, "class_declared": resolved.subject.class_declared,
        "basis_kind": row.gates["max_topk_kld_mean"].get("basis", {}).get("kind", "declared") if row is not None else "declared",
        "distribution_gates": [{"name": c.name, "label": c.label, "threshold": c.threshold, "observed": c.observed, "ok": c.ok}
                               for c in tier.checks],
    }
    per_prompt = topk.per_prompt_topk([p.id for p in prompts], [len(p.tokens) for p in prompts], pp, near)
    return CellResult(verdict, "parity", prompts, pp, summary, per_prompt, gate, cinfo, m.reference_info, n_vocab, msg), row


def run_topk_parity(req: ParityRequest, inputs: RunInputs, reference: Any, candidate: Any, prompts: list[PromptTokens],
                    evidence: EvidencePaths | None = None) -> ParityOutcome:
    """``run_parity`` for a top-k candidate (``topk_cell``): same receipt and ledger row, with the
    top-k tier and the top-k row used (``thresholds.topk``); ``evidence``: the paths the run's
    preflight resolved (``cell.finish``)."""
    result, row = topk_cell(inputs, reference, candidate, prompts)
    resolved = inputs.thresholds_for(result.candidate_info)
    receipt = build_receipt(req, inputs, result, resolved, None)
    receipt["thresholds"]["topk"] = {**row.to_receipt(), "k": row.k} if row is not None else None
    return finish(req, inputs, reference, candidate, prompts, result, receipt, evidence=evidence)
