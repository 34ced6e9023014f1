"""One parity cell: a prompt set × one model × a candidate and a reference engine → a receipt.

Both engines get identical token ids (tokenized by the reference, llama.cpp, unless a prompt
carries its own ids). Logits are compared block by block as the two engines stream them, so
nothing holds ``n_tokens × n_vocab`` when a block will do. Two tiers judge the cell
(``harness.judge.tiers``): the release gate (per-position cosine of raw logits ≥ 0.98 over ≥ 64
positions) and the calibrated tier (cosine, KLD mean, KLD p99 from the row for the file's
weights × the candidate's compute class, or measured on the subject); greedy agreement, margins
and top-k overlap are recorded as report-only fields, and so is free-running greedy generation
(``report_only.free_running``: ``harness.runs.greedy``, ``greedy_tokens`` steps per prompt).

Verdicts: FAIL when either tier fails (a non-finite candidate row fails at its position); else
UNMEASURED when fewer than the release gate's positions were compared (or the calibrated tier is
unmeasured and required); else PASS. Differing vocab sizes or out-of-range / mismatched token ids
are NOT-COMPARABLE; an engine that fails is ENGINE-ERROR — including a reference that returns a
non-finite logit (it cannot judge anything, so the candidate is not blamed).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Callable, Iterator, Sequence

import numpy as np

from harness.engines.base import Engine, LogitBlock, logits_each, prestart
from harness.engines.timing import timed
from harness.errors import EngineError, HarnessError, InvalidInput, Verdict
from harness.evidence.receipts import report_only_headline
from harness.evidence.record import preflight_evidence
from harness.evidence.report import prewarm_plots
from harness.judge import tiers, verdicts
from harness.judge.calibrated import resolve_row
from harness.judge.reproducer import Reproducer, causes_breaking, failure_message
from harness.judge.thresholds import ResolvedThresholds
from harness.measure import metrics, near_ties, text_windows
from harness.measure.prompts import PromptTokens
from harness.model.gguf_model import GGUFModel
from harness.runs.cell import CellResult, Measured, ParityOutcome, ParityRequest, Progress, build_receipt, check_comparable, finish
from harness.runs.inputs import subject_of
from harness.runs.localize import DEFAULT_MAX_TOKENS
from harness.runs import exact_check, reference_cache
from harness.runs.referee import OracleReferee, referee
from harness.runs.topk import run_topk_parity

__all__ = ["CellResult", "Measured", "ParityOutcome", "ParityRequest", "Progress", "build_receipt", "check_comparable",
           "compare_prompt", "judge_cell", "measure_cell", "run_cell", "run_parity", "run_topk_parity", "subject_of"]
"""The parity cell's public names; the request, result and receipt types live in
``harness.runs.cell`` (shared with the top-k cell) and are re-exported here."""



def _guarded(name: str, blocks: Iterator[LogitBlock]) -> Iterator[LogitBlock]:
    """Re-raise anything an engine throws while streaming as ``EngineError`` naming it."""
    try:
        yield from blocks
    except HarnessError:
        raise
    except Exception as e:  # an in-process engine's own bug is that engine's error
        raise EngineError(f"{name} raised {type(e).__name__}: {e}") from None


def _rows(blocks: Iterator[LogitBlock], name: str, n_tokens: int, n_vocab: int, first: int = 0) -> Iterator[np.ndarray]:
    """Validate an engine's block stream (order, width, count) and yield its blocks: positions
    ``first`` .. ``n_tokens`` − 1, the first block starting at ``first``. (The reference's
    logits must also be finite: ``compare_prompt`` checks that from the metrics' ``ref_finite``,
    which the metrics' own pass computes, so no pass of its own reads the rows again.)
    """
    expect = first
    for start, block in _guarded(name, blocks):
        block = np.asarray(block)
        if block.ndim != 2 or block.shape[1] != n_vocab:
            raise EngineError(f"{name} returned a logit block of shape {block.shape}; expected [B, {n_vocab}]")
        if start != expect:
            raise EngineError(f"{name} returned a block starting at position {start}; expected {expect}")
        expect += block.shape[0]
        if expect > n_tokens:
            raise EngineError(f"{name} returned {expect} positions for a {n_tokens}-token prompt")
        yield block
    if expect != n_tokens:
        raise EngineError(f"{name} returned {expect - first} positions for a {n_tokens}-token prompt"
                          + (f" asked from position {first}" if first else ""))


def compare_prompt(ref: Engine, cand: Engine, tokens: Sequence[int], n_vocab: int, progress: Callable[[int], None] | None = None,
                   prompt_id: str = "?", score_from: int = 0,
                   streams: tuple[Iterator[LogitBlock], Iterator[LogitBlock]] | None = None, judge_from: int = 0) -> dict[str, np.ndarray]:
    """Per-position metrics (``metrics.position_metrics`` and ``metrics.next_token_metrics``
    keys) of one prompt, streamed.

    The two engines' blocks are re-cut to common boundaries so neither side is gathered whole.
    Positions ``score_from`` .. n − 2 (those with a next token) are scored for perplexity and Δp
    (``PromptTokens.score_from``: a text window's second half, as ``llama-perplexity`` scores).
    Raises ``EngineError`` on a malformed stream, and when the reference returns a non-finite
    logit (naming the reference, ``prompt_id`` and the position; the candidate's non-finite rows
    are measured and FAIL at their positions). ``streams``: the two engines' block streams of
    this prompt when the caller has them already (``harness.engines.base.logits_each``), else each
    engine's ``logits(tokens)``. ``judge_from``: only positions ``judge_from`` .. n − 1 are
    compared (``PromptTokens.judge_from``); ``streams`` then hold those positions alone
    (``harness.engines.base.logits_each`` with ``first_rows``), and the metrics' rows are theirs.
    """
    n = len(tokens)
    following = np.append(np.asarray(tokens[1:], np.int64), -1)  # the token each position predicts; none after the last
    ref_blocks, cand_blocks = streams if streams is not None else (ref.logits(tokens), cand.logits(tokens))
    ref_name = f"reference {ref.info.name}"
    ref_it = _rows(ref_blocks, ref_name, n, n_vocab, first=judge_from)
    cand_it = _rows(cand_blocks, f"candidate {cand.info.name}", n, n_vocab, first=judge_from)
    parts = []
    r_buf = np.zeros((0, n_vocab), np.float32)
    c_buf = np.zeros((0, n_vocab), np.float32)
    done = judge_from
    while done < n:
        # the candidate's block first: the reference's worker is running already (its stream
        # was opened), and a candidate that starts on its first request then starts at once
        # and decodes beside it, instead of after the reference's first block
        while c_buf.shape[0] == 0:
            c_buf = next(cand_it)
        while r_buf.shape[0] == 0:
            r_buf = next(ref_it)
        k = min(r_buf.shape[0], c_buf.shape[0])
        at = np.arange(done, done + k)
        parts.append(metrics.position_metrics(r_buf[:k], c_buf[:k], following[at], (at >= score_from) & (following[at] >= 0)))
        bad = np.flatnonzero(~parts[-1]["ref_finite"])
        if bad.size:  # the reference failed, not the candidate it was to judge: never a FAIL in the candidate's name
            raise EngineError(f"{ref_name} returned non-finite logits (NaN or Inf) at prompt {prompt_id!r} position {done + int(bad[0])} "
                              f"({bad.size} position(s) in this block); a reference that fails cannot judge the candidate")
        r_buf, c_buf = r_buf[k:], c_buf[k:]
        done += k
        if progress:
            progress(done - judge_from)
    for it in (ref_it, cand_it):  # drain: lets the streams check their final counts
        for extra in it:
            raise EngineError(f"engine returned {extra.shape[0]} extra positions")
    return metrics.concat_metrics(parts)


def same_engine(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """True when two engine infos name the same build and settings (a self-consistency run)."""
    keys = ("name", "version", "settings", "build")
    return all(a.get(k) == b.get(k) for k in keys)


PARITY_OBLIGATION = "QE2E-PAR-001"
"""The e2e contract's parity obligation: the mutants that break it are a parity FAIL's likely causes."""


def _prompt_summary(p: PromptTokens, pm: dict[str, np.ndarray], min_cosine: float, near_tie_margin: float,
                    judged: np.ndarray | None = None) -> dict[str, Any]:
    s = metrics.summarize(pm, near_tie_margin)
    fails = metrics.cosine_failures(pm, min_cosine)
    if judged is not None:  # positions the applied tier left out (a router near-tie cut) do not fail
        fails = fails[judged[fails]]
    at = np.asarray(pm["position"]) if "position" in pm else np.arange(len(p.tokens))  # a judged row's position in the prompt
    return {
        "id": p.id,
        "positions": len(p.tokens) - p.judge_from,
        "min_cosine": s["min_cosine"],
        "min_cosine_position": None if s["min_cosine_index"] is None else int(at[s["min_cosine_index"]]),
        "mean_cosine": s["mean_cosine"],
        **report_only_headline(s),
        "failing_positions": int(fails.size),
        "first_failing_position": int(at[fails[0]]) if fails.size else None,
        "nonfinite_positions": s["nonfinite_positions"],
    }


def measure_cell(model: GGUFModel, reference: Engine, candidate: Engine, prompts: list[PromptTokens],
                 near_tie_margin: float = metrics.NEAR_TIE_MARGIN, progress: Progress | None = None) -> Measured:
    """Run both engines over ``prompts`` and compute every per-position metric (nothing judged).

    Raises ``NotComparable`` (``check_comparable``) and ``EngineError``.
    """
    n_vocab = check_comparable(model, reference, candidate, prompts)
    parts = []
    total = sum(len(p.tokens) - p.judge_from for p in prompts)
    done_before = 0
    # each engine's prompts as one run where it can (the llama.cpp reference: one worker for all);
    # with judge_from, each asked for the judged rows alone where it can (else they are cut here)
    firsts = [p.judge_from for p in prompts] if any(p.judge_from for p in prompts) else None
    ref_each = _guarded(f"reference {reference.info.name}", logits_each(reference, [p.tokens for p in prompts], firsts))
    cand_each = _guarded(f"candidate {candidate.info.name}", logits_each(candidate, [p.tokens for p in prompts], firsts))
    for i, p in enumerate(prompts):
        cb = (lambda d, pid=p.id, base=done_before: progress(pid, base + d, total)) if progress else None
        pm = compare_prompt(reference, candidate, p.tokens, n_vocab, cb, p.id, p.score_from, (next(ref_each), next(cand_each)),
                            p.judge_from)
        pm["prompt_index"] = np.full(len(p.tokens) - p.judge_from, i, np.int32)
        pm["position"] = np.arange(p.judge_from, len(p.tokens), dtype=np.int32)
        parts.append(pm)
        done_before += len(p.tokens) - p.judge_from
    for each in (ref_each, cand_each):  # the engines' runs end and check themselves
        next(each, None)
    per_position = metrics.concat_metrics(parts)
    summary = metrics.summarize(per_position, near_tie_margin)
    return Measured(prompts, per_position, summary, candidate.info.to_dict(), reference.info.to_dict(), n_vocab)


def cell_gate(m: Measured, rel: verdicts.TierResult, cal: verdicts.TierResult, release: dict[str, dict[str, Any]],
              row: tiers.Row | None, subject: tiers.Subject) -> dict[str, Any]:
    """The receipt's ``gated`` fields for judged tiers: the cosine threshold that applied (the
    calibrated row's, else the release gate's) with its failing, first and worst positions (each
    as prompt id / position / token), both tiers, the class, the KLD gates and where the largest
    KLD is. Judges nothing itself."""
    pp = m.per_position
    applied = cal if cal.status != "unmeasured" else rel
    cos_thr = applied.checks[0].threshold
    fails = metrics.cosine_failures(pp, cos_thr)
    if applied.not_judged is not None:  # an MoE prompt cut at a router near-tie: those positions are not this tier's
        fails = fails[~applied.not_judged[fails]]
    worst = verdicts.worst_position(pp, fails)
    kld = np.asarray(pp.get("kld", np.zeros(0)), np.float64)
    worst_kld = int(np.argmax(np.where(np.isfinite(kld), kld, -np.inf))) if np.isfinite(kld).any() else None
    return {
        "metric": "cosine",
        "min_cosine": cos_thr,
        "min_positions": int(release["min_positions"]["value"]),
        "positions": int(m.summary["positions"]),
        "failing_positions": int(fails.size),
        "first_failing": m.where(int(fails[0])) if fails.size else None,
        "worst": m.where(worst),
        "worst_cosine": (None if worst is None or not np.isfinite(pp["cosine"][worst]) else float(pp["cosine"][worst])),
        "min_cosine_observed": m.summary["min_cosine"],
        "min_cosine_where": m.where(m.summary["min_cosine_index"]),
        "nonfinite_positions": m.summary["nonfinite_positions"],
        "first_nonfinite": m.where(m.summary["first_nonfinite_index"]),
        "max_kld": None if worst_kld is None else float(kld[worst_kld]),
        "max_kld_where": m.where(worst_kld),
        "release": rel.to_dict(),
        "calibrated": cal.to_dict(),
        "compute_class": subject.compute_class,
        "class_declared": subject.class_declared,
        "basis_kind": (row.gates["min_cosine"].get("basis", {}).get("kind", "declared") if row is not None and cal.status != "unmeasured"
                       else release["min_cosine"].get("basis", {}).get("kind", "declared")),
        "distribution_gates": [{"name": c.name, "label": c.label, "threshold": c.threshold, "observed": c.observed, "ok": bool(c.ok)}
                               for c in cal.checks if c.name != "min_cosine"],
    }


def failure_text(gate: dict[str, Any], message: str, prompts: list[PromptTokens], case: Reproducer) -> str:
    """A FAIL's message as a reproducer (``harness.judge.reproducer``): the failed tiers' lines,
    the first and worst failing positions, the largest KLD when a KLD gate failed, the case on the
    first failing prompt, and the ``harness localize`` command that names the first divergent op."""
    parts = [message]
    if gate["failing_positions"]:
        f, w = gate["first_failing"], gate["worst"]
        worst_cos = gate["worst_cosine"] if gate["worst_cosine"] is not None else "non-finite"
        parts.append(f"first failing: prompt {f['prompt']!r} position {f['position']}; worst: prompt {w['prompt']!r} "
                     f"position {w['position']} (cosine {worst_cos})")
        first = next(p for p in prompts if p.id == f["prompt"])
        case = replace(case, prompt=first.id, n_tokens=len(first.tokens))
    if any(g["ok"] is False and g["observed"] is not None for g in gate["distribution_gates"]) and gate.get("max_kld_where"):
        w = gate["max_kld_where"]
        parts.append(f"largest KLD {gate['max_kld']:.3g} at prompt {w['prompt']!r} position {w['position']}")
    off = (gate["release"].get("oracle_referee") or {}).get("reference_off_oracle") or []
    if off:  # the reference's own divergence (harness.runs.referee): localize the reference, not the candidate
        e = off[0]
        ref_case = replace(case, candidate=REFERENCE_NAME, candidate_args=(), prompt=e["prompt"])
        parts.append(f"the reference is off the exact oracle at {len(off)} of these positions (first: prompt {e['prompt']!r} position "
                     f"{e['position']}, oracle vs reference cosine {e['oracle_vs_reference']:.4f}): that divergence is the reference's; "
                     f"`{_localize_command(ref_case, e)}` names its first op off the oracle")
    fallback = f"the first op that leaves the oracle, which `{_localize_command(case, gate['first_failing'])}` names"
    return failure_message("; ".join(parts), case, causes_breaking(PARITY_OBLIGATION), fallback)


REFERENCE_NAME = "llama.cpp"


def _localize_command(case: Reproducer, first_failing: dict[str, Any] | None) -> str:
    """``harness localize`` on the failing prompt, over enough tokens to reach the first failure."""
    args: list[object] = []
    if first_failing is not None:
        args += ["--prompt", first_failing["prompt"]]
        if first_failing["position"] >= DEFAULT_MAX_TOKENS:
            args += ["--max-tokens", first_failing["position"] + 1]
    return case.harness("localize", *args)


def judge_cell(m: Measured, release: dict[str, dict[str, Any]], row: tiers.Row | None, subject: tiers.Subject,
               near_tie_margin: float = metrics.NEAR_TIE_MARGIN, unmeasured_reason: str = "",
               command: str | None = None, require_calibrated: bool = False, case: Reproducer | None = None,
               cuts: near_ties.RouterCuts | None = None, excuses: near_ties.RouterExcuses | None = None,
               referee: OracleReferee | None = None) -> CellResult:
    """Judge a measured cell with the two tiers (``harness.judge.verdicts``): the release gate
    (``release``: ``{"min_cosine": {"value"}, "min_positions": {"value"}}``) and the calibrated
    row (None: unmeasured, with ``unmeasured_reason`` and the ``command`` that would measure it).
    ``case`` starts a failure's reproducer (default: the candidate's name and the model's sha256).
    ``cuts``: MoE prompts the calibrated tier judges only up to a router near-tie (``router_cuts``);
    ``excuses``: positions below the release floor excused at one (``release_excuses``), which
    neither tier counts (``router_near_ties`` finds both); ``referee``: positions where the
    reference is off the exact oracle, judged against the oracle instead (``harness.runs.referee``),
    which neither tier counts against the reference either."""
    pp = m.per_position
    rel = verdicts.judge_release(pp, release, excuses, referee)
    cal = verdicts.judge_calibrated(pp, m.summary, row, subject, unmeasured_reason, command, cuts, rel.not_judged)
    verdict, msg = verdicts.overall(rel, cal, subject, require_calibrated)
    gate = cell_gate(m, rel, cal, release, row, subject)
    if verdict is Verdict.FAIL:
        msg = failure_text(gate, msg, m.prompts, case or Reproducer(m.candidate_info["name"], "MODEL", subject.sha256))
    applied = cal if cal.status != "unmeasured" else rel
    judged = ~applied.not_judged if applied.not_judged is not None else np.ones(pp["cosine"].size, bool)
    per_prompt = [_prompt_summary(p, {k: v[pp["prompt_index"] == i] for k, v in pp.items()}, gate["min_cosine"], near_tie_margin,
                                  judged[pp["prompt_index"] == i])
                  for i, p in enumerate(m.prompts)]
    kind = "self-consistency" if same_engine(m.candidate_info, m.reference_info) else "parity"
    return CellResult(verdict, kind, m.prompts, pp, m.summary, per_prompt, gate, m.candidate_info, m.reference_info, m.n_vocab, msg)


def release_excuses_for(m: Measured, resolved: ResolvedThresholds, model: GGUFModel, reference: Engine) -> near_ties.RouterExcuses | None:
    """``near_ties.release_excuses`` of the cell with thresholds.yaml ``release.moe_router_tie_gap``
    and ``release.moe_router_max_excused``, or None where the rule does not apply (a dense model,
    a thresholds file without them, no position below the release floor)."""
    h, rel = model.hparams, resolved.release
    if h.n_expert <= 0 or "moe_router_tie_gap" not in rel or "moe_router_max_excused" not in rel:
        return None
    fails = metrics.cosine_failures(m.per_position, float(rel["min_cosine"].value))  # below the floor, or non-finite
    if not fails.size:
        return None
    below = np.zeros(np.asarray(m.per_position["cosine"]).size, bool)
    below[fails] = True
    return near_ties.release_excuses(m.per_position, below, m.prompts, reference, h.n_layer, h.n_expert_used,
                                     float(rel["moe_router_tie_gap"].value), float(rel["moe_router_max_excused"].value))


def router_cuts_for(m: Measured, resolved: ResolvedThresholds, model: GGUFModel, reference: Engine,
                    excused: np.ndarray | None = None) -> near_ties.RouterCuts | None:
    """``near_ties.router_cuts`` of the cell with thresholds.yaml ``probes.moe_router_max_gap``, or
    None where the rule does not apply: a dense model, no calibrated row, a class or a file the
    rule is not for (``near_ties.cuts_apply``: f64/f32 on unquantized weights), or a thresholds
    file without the gap. A position is outside the
    row's bounds when its cosine is below the row's or its KLD above the row's p99 gate; one the
    release gate excused (``excused``, bool [N]) is not looked at."""
    row, h = resolved.row, model.hparams
    gap = resolved.probes.get("moe_router_max_gap")
    if (row is None or h.n_expert <= 0 or gap is None
            or not near_ties.cuts_apply(resolved.subject.compute_class, resolved.subject.weights)):
        return None
    pp = m.per_position
    with np.errstate(invalid="ignore"):
        inside = pp["finite"] & pp["ref_finite"] & (pp["cosine"] >= float(row.gates["min_cosine"]["value"]))
        if "max_kld_p99" in row.gates:
            inside &= pp["kld"] <= float(row.gates["max_kld_p99"]["value"])
    if excused is not None:
        inside |= excused
    return near_ties.router_cuts(pp, ~inside, m.prompts, reference, h.n_layer, h.n_expert_used, float(gap.value))


def router_near_ties(m: Measured, resolved: ResolvedThresholds, model: GGUFModel,
                     reference: Engine) -> tuple[near_ties.RouterExcuses | None, near_ties.RouterCuts | None]:
    """How ``harness parity`` treats an MoE model's router near-ties (``harness.measure.near_ties``):
    the release gate's excused positions, then the calibrated tier's cuts among the others. Both
    None on a dense model."""
    excuses = release_excuses_for(m, resolved, model, reference)
    return excuses, router_cuts_for(m, resolved, model, reference, None if excuses is None else excuses.mask)


def exact_check_for(inputs: Any, candidate: Engine, m: Measured, prompts: list[PromptTokens]) -> exact_check.ExactCheck | None:
    """``harness.runs.exact_check.run`` for the cell where it applies (a low-bit i-quant file, a
    candidate with the capability ``dequantized_weights``), else None."""
    if not exact_check.applies(inputs.model, m.candidate_info):
        return None
    return exact_check.run(inputs.model, inputs.thresholds, candidate, m.candidate_info, prompts,
                           lambda: inputs.engine("oracle"), measure_cell, inputs.thresholds.near_tie_margin)


def oracle_referee(m: Measured, resolved: ResolvedThresholds, inputs: Any, reference: Engine, candidate: Engine,
                   excuses: near_ties.RouterExcuses | None) -> OracleReferee | None:
    """``harness.runs.referee.referee`` of the cell at the release floor, on the positions below it
    that no router near-tie excused; the oracle is the candidate itself when it is ``oracle``,
    else a float64 ``oracle`` loaded on the model (None when every position is above the floor)."""
    floor = float(resolved.release["min_cosine"].value)
    pp = dict(m.per_position)
    if excuses is not None and excuses.count:
        pp["cosine"] = np.where(excuses.mask, 1.0, pp["cosine"])
    with np.errstate(invalid="ignore"):
        if bool(np.all(np.asarray(pp["cosine"]) >= floor)):
            return None
    is_oracle = m.candidate_info.get("name") == "oracle"
    oracle: Any = candidate if is_oracle else None
    if oracle is None:
        try:
            oracle = inputs.engine("oracle")
        except HarnessError:
            oracle = None
    return referee(pp, floor, m.prompts, reference, candidate, oracle, is_oracle, m.n_vocab, compare_prompt)


def run_cell(
    model: GGUFModel,
    reference: Engine,
    candidate: Engine,
    prompts: list[PromptTokens],
    min_cosine: float = 0.98,
    min_positions: int = 64,
    near_tie_margin: float = metrics.NEAR_TIE_MARGIN,
    progress: Progress | None = None,
    row: tiers.Row | None = None,
    resolved: ResolvedThresholds | None = None,
) -> CellResult:
    """Measure and judge one cell: the release gate ``min_cosine`` over ``min_positions`` and,
    when given, the calibrated ``row`` (``measure_cell`` + ``judge_cell``). Used where the caller
    already knows the row; ``run_parity`` resolves it from thresholds.yaml. With ``resolved``
    (the thresholds that apply to the subject, ``Thresholds.resolve``), an MoE model's router
    near-ties are treated as ``harness parity`` treats them (``router_near_ties``).

    Raises ``NotComparable`` (vocab sizes differ, token id out of range) and ``EngineError``.
    """
    m = measure_cell(model, reference, candidate, prompts, near_tie_margin, progress)
    release = {"min_cosine": {"value": min_cosine}, "min_positions": {"value": min_positions}}
    subject = subject_of(model, m.candidate_info)
    case = Reproducer(m.candidate_info["name"], str(model.path), model.sha256, overrides=[o.to_flag() for o in model.overrides.values()])
    excuses, cuts = router_near_ties(m, resolved, model, reference) if resolved is not None else (None, None)
    return judge_cell(m, release, row, subject, near_tie_margin, "no calibrated row given" if row is None else "", case=case,
                      cuts=cuts, excuses=excuses)


def text_prompts(inputs: Any, reference: Engine, text: text_windows.TextFile, n_ctx: int,
                 second_half: bool = False) -> tuple[list[PromptTokens], dict[str, Any]]:
    """``harness parity --text``: the text's windows of ``n_ctx`` tokens as the cell's prompts
    (``harness.measure.text_windows``, as ``llama-perplexity`` cuts them), tokenized by the
    reference's tokenizer (``RunInputs.tokenizer``), each window's first token BOS when the GGUF's
    ``tokenizer.ggml.add_bos_token`` is true (``tokenizer.ggml.bos_token_id``), and the receipt's
    ``prompts.text`` record; ``second_half`` (``--score-second-half``): each window judged from
    ``n_ctx // 2`` on, recorded as ``prompts.text.judged``. Raises ``InvalidInput`` for a text
    shorter than one window."""
    model = inputs.model
    bos = model.metadata("tokenizer.ggml.bos_token_id") if model.metadata("tokenizer.ggml.add_bos_token", False) else None
    tokens = text_windows.tokenize_text(text.text, inputs.tokenizer(reference))
    windows = text_windows.text_windows(tokens, n_ctx, bos, text.path, second_half)
    record = text_windows.text_record(text, n_ctx, len(tokens), windows, bos)
    if second_half:
        record["judged"] = text_windows.judged_record(windows)
    return windows, record


# ---------------------------------------------------------------------------------------------
# The main job: resolve inputs, run the cell, write the receipt and the ledger row
# ---------------------------------------------------------------------------------------------


def run_parity(req: ParityRequest, progress: Progress | None = None, log: Callable[[str], None] | None = None) -> ParityOutcome:
    """Run one parity cell end to end and write its evidence.

    Order matters for honest failures: inputs (thresholds, model, prompts) are validated before
    any engine runs (``resolve_inputs``), so a threshold without a basis refuses to gate
    (``InvalidInput``) without spending engine time. The calibrated tier is resolved after the
    engines ran (a command engine states its compute class in its ``info.json``): the committed
    row that fits, else the tier measured on the subject (``compare.calibrated.resolve_row``), else UNMEASURED.
    Raises ``InvalidInput``, ``EngineError``, ``NotComparable``.
    """
    inputs = req.resolve()
    text = None
    if req.text is not None:  # checked before any engine runs
        text = text_windows.load_text(req.text)
        text_windows.check_ctx(req.ctx, inputs.model.hparams.context_length)
    evidence = preflight_evidence(req.ledger) if req.write_evidence else None
    reference = timed(lambda: inputs.engine(req.reference, **req.reference_settings))
    candidate = timed(lambda: inputs.engine(req.candidate, **req.candidate_settings))
    prestart(candidate)  # its start-up beside the reference's tokenization, not after it
    if req.write_evidence and req.report:
        prewarm_plots()  # the report's matplotlib import while the engines start, not after them
    if text is not None:
        prompts, text_rec = text_prompts(inputs, reference.engine, text, req.ctx, req.score_second_half)
    else:
        prompts, text_rec = inputs.tokens(reference.engine), None
    if "topk" in candidate.info.capabilities:
        if text is not None:
            raise InvalidInput(f"--text: not with a top-k candidate ({req.candidate} gives top-k logprobs, not the full rows perplexity needs)")
        return run_topk_parity(req, inputs, reference, candidate, prompts, evidence)
    cached = reference_cache.wrap(reference, inputs.model.sha256, req.reference_cache)  # the gated rows only
    m = measure_cell(inputs.model, cached, candidate, prompts, inputs.thresholds.near_tie_margin, progress)
    measure = req.measure_tier if req.write_evidence else None
    resolved, cal_id, cal_path, command = resolve_row(inputs.thresholds_for(m.candidate_info), req.model, req.ledger,
                                                      measure, req.calibrate_max_tokens, log)
    excuses, cuts = router_near_ties(m, resolved, inputs.model, reference.engine)
    ruling = oracle_referee(m, resolved, inputs, reference.engine, candidate.engine, excuses)
    result = judge_cell(m, resolved.release_gates, resolved.row, resolved.subject, inputs.thresholds.near_tie_margin,
                        resolved.row_misfit, command, req.require_calibrated, inputs.reproducer(req.candidate, settings=req.candidate_settings),
                        cuts, excuses, ruling)
    exact = exact_check_for(inputs, candidate.engine, m, prompts)
    if exact is not None:
        verdict, message = exact_check.combine(result.verdict, result.message, exact)
        result = replace(result, verdict=verdict, message=message)
    elif (why := exact_check.not_run_line(inputs.model, m.candidate_info)) is not None:
        result = replace(result, message=f"{result.message}; {why}")
        exact = exact_check.ExactCheck("not-run", why)
    receipt = build_receipt(req, inputs, result, resolved, cal_id)
    if exact is not None:
        receipt["gated"]["exact_check"] = exact.to_dict()
    if text_rec is not None:  # the prompts are the text's windows: the receipt names the text file, not a prompt set
        receipt["prompts"].update(id=text_rec["path"].rsplit("/", 1)[-1], path=text_rec["path"], sha256=text_rec["sha256"], text=text_rec)
    return finish(req, inputs, reference, candidate, prompts, result, receipt, cal_path, reference_cache.record_of(cached), evidence, log)


# ---------------------------------------------------------------------------------------------
# A candidate that gives top-k logprobs (an http:NAME server): the top-k tier judges it
# ---------------------------------------------------------------------------------------------


