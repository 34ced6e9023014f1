"""One parity cell: a prompt set × one model × a candidate and a reference engine → a receipt.

Both engines get identical token ids (tokenized by the reference, llama.cpp, unless a prompt
carries its own ids). Logits are compared block by block as the two engines stream them, so
nothing holds ``n_tokens × n_vocab`` when a block will do. The gate is the per-position cosine of
raw logits against ``min_cosine`` over at least ``min_positions`` positions (thresholds.yaml);
greedy agreement, margins, KLD and top-k overlap are recorded as report-only fields.

Verdicts (docs/design.md, "Verdicts and exit codes"): FAIL when any position fails the gate (a non-finite candidate
row fails at its position); else UNMEASURED when fewer than ``min_positions`` positions were
compared; else PASS. Differing vocab sizes or out-of-range / mismatched token ids are
NOT-COMPARABLE; an engine that fails is ENGINE-ERROR — including a reference that returns a
non-finite logit (it cannot judge anything, so the candidate is not blamed).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import numpy as np

from harness.compare import metrics
from harness.compare.inputs import RunInputs, RunRequest
from harness.compare.localize import DEFAULT_MAX_TOKENS
from harness.compare.prompts import PromptTokens
from harness.compare.reproducer import Reproducer, causes_breaking, failure_message
from harness.engines.base import Engine, LogitBlock
from harness.engines.timing import timed
from harness.errors import (
    EngineError,
    HarnessError,
    InvalidInput,
    NotComparable,
    Verdict,
)
from harness.evidence import fmt
from harness.evidence.receipts import (
    harness_info,
    host_info,
    prepare_receipt,
    report_only_headline,
)
from harness.evidence.record import preflight_evidence, record_evidence
from harness.model.gguf_model import GGUFModel

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


def _guarded(name: str, blocks: Iterator[LogitBlock]) -> Iterator[LogitBlock]:
    """Re-raise anything an engine throws while streaming as ``EngineError`` naming it."""
    try:
        yield from blocks
    except HarnessError:
        raise
    except Exception as e:  # an in-process engine's own bug is that engine's error
        raise EngineError(f"{name} raised {type(e).__name__}: {e}") from None


def _rows(blocks: Iterator[LogitBlock], name: str, n_tokens: int, n_vocab: int, finite: str | None = None) -> Iterator[np.ndarray]:
    """Validate an engine's block stream (order, width, count) and yield its blocks.

    ``finite`` (the prompt id) demands finite logits: the reference's. A reference that returns
    NaN or Inf has failed, not the candidate it was to judge: ``EngineError`` naming it and the
    position, never a FAIL in the candidate's name.
    """
    expect = 0
    for start, block in _guarded(name, blocks):
        block = np.asarray(block)
        if block.ndim != 2 or block.shape[1] != n_vocab:
            raise EngineError(f"{name} returned a logit block of shape {block.shape}; expected [B, {n_vocab}]")
        if start != expect:
            raise EngineError(f"{name} returned a block starting at position {start}; expected {expect}")
        if finite is not None:
            bad = np.flatnonzero(~np.isfinite(block).all(axis=1))
            if bad.size:
                raise EngineError(f"{name} returned non-finite logits (NaN or Inf) at prompt {finite!r} position {start + int(bad[0])} "
                                  f"({bad.size} position(s) in this block); a reference that fails cannot judge the candidate")
        expect += block.shape[0]
        if expect > n_tokens:
            raise EngineError(f"{name} returned {expect} positions for a {n_tokens}-token prompt")
        yield block
    if expect != n_tokens:
        raise EngineError(f"{name} returned {expect} positions for a {n_tokens}-token prompt")


def compare_prompt(ref: Engine, cand: Engine, tokens: Sequence[int], n_vocab: int, progress: Callable[[int], None] | None = None,
                   prompt_id: str = "?") -> dict[str, np.ndarray]:
    """Per-position metrics (``metrics.position_metrics`` keys) of one prompt, streamed.

    The two engines' blocks are re-cut to common boundaries so neither side is gathered whole.
    Raises ``EngineError`` on a malformed stream, and when the reference returns a non-finite
    logit (naming the reference, ``prompt_id`` and the position; the candidate's non-finite rows
    are measured and FAIL at their positions).
    """
    n = len(tokens)
    ref_it = _rows(ref.logits(tokens), f"reference {ref.info.name}", n, n_vocab, finite=prompt_id)
    cand_it = _rows(cand.logits(tokens), f"candidate {cand.info.name}", n, n_vocab)
    parts = []
    r_buf = np.zeros((0, n_vocab), np.float32)
    c_buf = np.zeros((0, n_vocab), np.float32)
    done = 0
    while done < n:
        while r_buf.shape[0] == 0:
            r_buf = next(ref_it)
        while c_buf.shape[0] == 0:
            c_buf = next(cand_it)
        k = min(r_buf.shape[0], c_buf.shape[0])
        parts.append(metrics.position_metrics(r_buf[:k], c_buf[:k]))
        r_buf, c_buf = r_buf[k:], c_buf[k:]
        done += k
        if progress:
            progress(done)
    for it in (ref_it, cand_it):  # drain: lets the streams check their final counts
        for extra in it:
            raise EngineError(f"engine returned {extra.shape[0]} extra positions")
    return metrics.concat_metrics(parts)


def same_engine(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """True when two engine infos name the same build and settings (a self-consistency run)."""
    keys = ("name", "version", "settings", "build")
    return all(a.get(k) == b.get(k) for k in keys)


PARITY_OBLIGATION = "QE2E-PAR-001"
"""The contract obligation a failing parity cell breaks (contracts/qwen35-e2e-verification-v1.yaml)."""
KLD_GATES = {"max_kld_mean": ("mean", "KLD mean"), "max_kld_p99": ("p99", "KLD p99")}
"""Optional distribution gates (added by calibration): gate name → (summary key, label)."""
PARITY_GATES = ("min_cosine", "min_positions", *KLD_GATES)


def check_comparable(model: GGUFModel, reference: Engine, candidate: Engine, prompts: list[PromptTokens]) -> int:
    """The cell's vocab size, once both engines, the model's token list and every prompt's token
    ids agree on it. Raises ``NotComparable`` naming the first disagreement."""
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


def _prompt_row(p: PromptTokens, pm: dict[str, np.ndarray], min_cosine: float, near_tie_margin: float) -> dict[str, Any]:
    """The receipt's ``per_prompt`` entry of one prompt's per-position metrics."""
    s = metrics.summarize(pm, near_tie_margin)
    fails = metrics.cosine_failures(pm, min_cosine)
    return {
        "id": p.id,
        "positions": len(p.tokens),
        "min_cosine": s["min_cosine"],
        "min_cosine_position": s["min_cosine_index"],
        "mean_cosine": s["mean_cosine"],
        **report_only_headline(s),
        "failing_positions": int(fails.size),
        "first_failing_position": int(fails[0]) if fails.size else None,
        "nonfinite_positions": s["nonfinite_positions"],
    }


def compare_prompts(reference: Engine, candidate: Engine, prompts: list[PromptTokens], n_vocab: int, min_cosine: float,
                    near_tie_margin: float, progress: Progress | None = None) -> tuple[dict[str, np.ndarray], list[dict[str, Any]]]:
    """Per-position metrics of every prompt, concatenated (with ``prompt_index`` and ``position``
    saying where each row came from), and the per-prompt summaries. Raises ``EngineError``."""
    parts, per_prompt = [], []
    total = sum(len(p.tokens) for p in prompts)
    done_before = 0
    for i, p in enumerate(prompts):
        cb = (lambda d, pid=p.id, base=done_before: progress(pid, base + d, total)) if progress else None
        pm = compare_prompt(reference, candidate, p.tokens, n_vocab, cb, p.id)
        pm["prompt_index"] = np.full(len(p.tokens), i, np.int32)
        pm["position"] = np.arange(len(p.tokens), dtype=np.int32)
        parts.append(pm)
        per_prompt.append(_prompt_row(p, pm, min_cosine, near_tie_margin))
        done_before += len(p.tokens)
    return metrics.concat_metrics(parts), per_prompt


def judge_gates(per_position: dict[str, np.ndarray], summary: dict[str, Any], prompts: list[PromptTokens], min_cosine: float,
                min_positions: int, kld_gates: dict[str, float] | None = None) -> dict[str, Any]:
    """The receipt's gated fields: the cosine gate per position (failing positions, the first and
    the worst, each as prompt id / position / token) and each KLD gate on the whole set
    (``distribution_gates``: threshold, observed, ok). Judges; decides no verdict."""
    fails = metrics.cosine_failures(per_position, min_cosine)

    def where(idx: int | None) -> dict[str, Any] | None:
        if idx is None:
            return None
        pi, pos = int(per_position["prompt_index"][idx]), int(per_position["position"][idx])
        return {"prompt": prompts[pi].id, "position": pos, "token": int(prompts[pi].tokens[pos])}

    worst = None
    if fails.size:
        cos = np.where(np.isfinite(per_position["cosine"]), per_position["cosine"], -np.inf)
        worst = int(fails[np.argmin(cos[fails])])
    kld_results = []
    for name, value in (kld_gates or {}).items():
        key, label = KLD_GATES[name]
        observed = (summary.get("kld") or {}).get(key)
        ok = observed is not None and observed <= value
        kld_results.append({"name": name, "label": label, "threshold": float(value), "observed": observed, "ok": bool(ok)})
    kld = np.asarray(per_position.get("kld", np.zeros(0)), np.float64)
    worst_kld = int(np.argmax(np.where(np.isfinite(kld), kld, -np.inf))) if np.isfinite(kld).any() else None
    return {
        "metric": "cosine",
        "min_cosine": min_cosine,
        "min_positions": min_positions,
        "positions": int(summary["positions"]),
        "failing_positions": int(fails.size),
        "first_failing": where(int(fails[0])) if fails.size else None,
        "worst": where(worst),
        "worst_cosine": (None if worst is None or not np.isfinite(per_position["cosine"][worst]) else float(per_position["cosine"][worst])),
        "min_cosine_observed": summary["min_cosine"],
        "min_cosine_where": where(summary["min_cosine_index"]),
        "nonfinite_positions": summary["nonfinite_positions"],
        "first_nonfinite": where(summary["first_nonfinite_index"]),
        "distribution_gates": kld_results,
        "max_kld": None if worst_kld is None else float(kld[worst_kld]),
        "max_kld_where": where(worst_kld),  # the position a distribution-gate failure is reported at
    }


def cell_verdict(gate: dict[str, Any], summary: dict[str, Any], prompts: list[PromptTokens],
                 case: Callable[[], Reproducer]) -> tuple[Verdict, str]:
    """The verdict of judged gates, and its message (docs/design.md, "Verdicts and exit codes").

    FAIL when a cosine position or a measured KLD gate failed: the message is a reproducer
    (``harness.compare.reproducer``) of ``case()`` (called only then: it may hash the model) on the
    first failing prompt; UNMEASURED when fewer than ``min_positions`` positions were compared;
    else PASS.
    """
    n_pos, min_cosine = gate["positions"], gate["min_cosine"]
    kld_failed = [g for g in gate["distribution_gates"] if not g["ok"] and g["observed"] is not None]
    if gate["failing_positions"] or kld_failed:
        case_, parts = case(), []
        if gate["failing_positions"]:
            f, w = gate["first_failing"], gate["worst"]
            worst_cos = fmt.cosine(gate["worst_cosine"]) if gate["worst_cosine"] is not None else "non-finite"
            parts.append(f"{gate['failing_positions']} of {n_pos} positions below cosine {min_cosine}; first: prompt {f['prompt']!r} "
                         f"position {f['position']}; worst: prompt {w['prompt']!r} position {w['position']} (cosine {worst_cos})")
            first = next(p for p in prompts if p.id == f["prompt"])
            case_ = replace(case_, prompt=first.id, n_tokens=len(first.tokens))
        parts += [f"{g['label']} {g['observed']:.3g} > {g['threshold']:.3g} ({g['name']})" for g in kld_failed]
        if kld_failed and gate.get("max_kld_where"):
            w = gate["max_kld_where"]
            parts.append(f"largest KLD {gate['max_kld']:.3g} at prompt {w['prompt']!r} position {w['position']}")
        fallback = f"the first op that leaves the oracle, which `{_localize_command(case_, gate['first_failing'])}` names"
        return Verdict.FAIL, failure_message("; ".join(parts), case_, causes_breaking(PARITY_OBLIGATION), fallback)
    if n_pos < gate["min_positions"]:
        return Verdict.UNMEASURED, f"only {n_pos} positions compared; the gate needs at least {gate['min_positions']}"
    return Verdict.PASS, f"all {n_pos} positions have cosine >= {min_cosine} (min {fmt.cosine(summary['min_cosine'])})"


def _localize_command(case: Reproducer, first_failing: dict[str, Any] | None) -> str:
    """``harness localize`` on the failing prompt, over enough tokens to reach the first failure."""
    args: list[object] = []
    if first_failing is not None:
        args += ["--prompt", first_failing["prompt"]]
        if first_failing["position"] >= DEFAULT_MAX_TOKENS:
            args += ["--max-tokens", first_failing["position"] + 1]
    return case.harness("localize", *args)


def run_cell(
    model: GGUFModel,
    reference: Engine,
    candidate: Engine,
    prompts: list[PromptTokens],
    min_cosine: float,
    min_positions: int,
    near_tie_margin: float = metrics.NEAR_TIE_MARGIN,
    progress: Progress | None = None,
    kld_gates: dict[str, float] | None = None,
    case: Reproducer | None = None,
) -> CellResult:
    """Run both engines over ``prompts`` and judge the gates: comparability
    (``check_comparable``), the numbers (``compare_prompts``), the gate judgement (``judge_gates``)
    and the verdict with its message (``cell_verdict``).

    The cosine gate is per position; ``kld_gates`` (``max_kld_mean``, ``max_kld_p99``: KL(P_ref ‖
    P_cand) in nats over all positions), when given, are judged on the whole prompt set and FAIL
    the cell when exceeded — they see scale errors that cosine cannot. ``case`` is the reproducer a
    failure message starts from (candidate and model as the user named them, sha256, overrides,
    prompt file); default: the candidate's info name and the model's path, sha256 and overrides.
    Raises ``NotComparable`` (vocab sizes differ, token id out of range) and ``EngineError``.
    """
    n_vocab = check_comparable(model, reference, candidate, prompts)
    per_position, per_prompt = compare_prompts(reference, candidate, prompts, n_vocab, min_cosine, near_tie_margin, progress)
    summary = metrics.summarize(per_position, near_tie_margin)
    gate = judge_gates(per_position, summary, prompts, min_cosine, min_positions, kld_gates)
    ci, ri = candidate.info.to_dict(), reference.info.to_dict()
    default_case = lambda: Reproducer(ci["name"], str(model.path), model.sha256, overrides=[o.to_flag() for o in model.overrides.values()])  # noqa: E731
    verdict, msg = cell_verdict(gate, summary, prompts, (lambda: case) if case else default_case)
    kind = "self-consistency" if same_engine(ci, ri) else "parity"
    return CellResult(verdict, kind, prompts, per_position, summary, per_prompt, gate, ci, ri, n_vocab, msg)


# ---------------------------------------------------------------------------------------------
# The main job: resolve inputs, run the cell, write the receipt and the ledger row
# ---------------------------------------------------------------------------------------------
@dataclass(kw_only=True)
class ParityRequest(RunRequest):
    """Inputs of one ``harness parity`` cell (``RunRequest``)."""


@dataclass
class ParityOutcome:
    """A finished cell: its result, the receipt as written, and where evidence went."""

    result: CellResult
    receipt: dict[str, Any]
    receipt_path: Path | None
    ledger_row: dict[str, Any] | None
    ledger_path: Path | None


def build_receipt(req: ParityRequest, inputs: RunInputs, result: CellResult) -> dict[str, Any]:
    """The receipt dict (schema ``harness-parity-receipt/v1``, before id/arrays are added)."""
    prompt_set = inputs.prompt_set
    return {
        "kind": result.kind,
        "host": host_info(),
        "harness": harness_info(),
        "command": list(req.argv) or ["harness", "parity"],
        "model": inputs.model_record(),
        "engines": {"reference": result.reference_info, "candidate": result.candidate_info},
        "prompts": {
            "id": prompt_set.id,
            "path": str(prompt_set.path),
            "sha256": prompt_set.sha256,
            "count": len(result.prompts),
            "positions": sum(len(p.tokens) for p in result.prompts),
            "items": [{"id": p.id, "source": p.source, "tokens": p.tokens} for p in result.prompts],
        },
        "thresholds": inputs.resolved.to_receipt(),
        "gated": {"verdict": result.verdict.value, "message": result.message, **result.gate},
        "report_only": result.summary,
        "per_prompt": result.per_prompt,
    }


def run_parity(req: ParityRequest, progress: Progress | None = None) -> ParityOutcome:
    """Run one parity cell end to end and write its evidence.

    Order matters for honest failures: inputs (thresholds, model, prompts) are validated before
    any engine runs (``resolve_inputs``), so a threshold without a basis refuses to gate
    (``InvalidInput``) without spending engine time; so does evidence that could not be recorded
    (``preflight_evidence``: an unwritable or ambiguous ledger path). Raises ``InvalidInput``, ``EngineError``,
    ``NotComparable``.
    """
    inputs = req.resolve()
    if req.write_evidence:
        preflight_evidence(req.ledger)
    resolved = inputs.resolved
    unknown = [g for g in resolved.gates if g not in PARITY_GATES]
    if unknown:
        raise InvalidInput(f"{resolved.path}: unknown gate {unknown[0]!r}; parity gates: {', '.join(PARITY_GATES)}")
    reference = timed(lambda: inputs.engine(req.reference))
    candidate = timed(lambda: inputs.engine(req.candidate))
    prompts = inputs.tokens(reference.engine)
    kld_gates = {g: float(resolved.gates[g].value) for g in KLD_GATES if g in resolved.gates}
    result = run_cell(inputs.model, reference, candidate, prompts, resolved.min_cosine, resolved.min_positions,
                      inputs.thresholds.near_tie_margin, progress, kld_gates, inputs.reproducer(req.candidate))
    receipt = build_receipt(req, inputs, result)
    receipt["timings"] = {"reference": reference.timings(), "candidate": candidate.timings()}
    if not req.write_evidence:
        prepare_receipt(receipt, result.per_position)  # a dry run refuses what a recording run would
        return ParityOutcome(result, receipt, None, None, None)
    rec = record_evidence(receipt, result.per_position, req.ledger)
    return ParityOutcome(result, rec.receipt, rec.receipt_path, rec.row, rec.ledger_path)
