"""The top-k tier: judging a candidate that gives only its top-k logprobs per position (an
``http:NAME`` server) by the top-k KLD mean and p99 of a top-k row of thresholds.yaml
(``Thresholds.topk_rows``), with the metrics of ``harness.measure.topk``.

The cosine of raw logits (the release gate) cannot be computed from top-k logprobs: a top-k cell
says so and never reports it as passed (``release_not_computable``).
"""

from __future__ import annotations

from typing import Any, Mapping

from harness.errors import Verdict
from harness.judge.verdicts import GateCheck, TierResult

TOPK_GATES = {"max_topk_kld_mean": ("mean", "top-k KLD mean"), "max_topk_kld_p99": ("p99", "top-k KLD p99")}
"""Gates of a top-k row: gate name → (key of the summary's ``kld``, label)."""


def release_not_computable(release: Mapping[str, Mapping[str, Any]], k: int, positions: int) -> TierResult:
    """The release gate's tier for a top-k cell: never judged, never passed (module docstring)."""
    thr = float(release["min_cosine"]["value"])
    reason = f"the candidate gives top-{k} logprobs, not logits: per-position logit cosine cannot be computed"
    line = (f"release gate cosine ≥ {thr:g} over ≥ {int(release['min_positions']['value'])} positions: NOT COMPUTED — {reason} "
            f"({positions} positions); it is not reported as passed")
    check = GateCheck("release", "min_cosine", "cosine", thr, None, None, release["min_cosine"].get("basis", {}).get("kind", "declared"))
    return TierResult("release", "unmeasured", [check], line, "thresholds.yaml release", reason)


def judge_topk(summary: Mapping[str, Any], row: Any, subject_text: str, k: int, min_positions: int,
               unmeasured_reason: str = "", command: str | None = None, cuts: Any = None) -> TierResult:
    """The top-k tier: ``row`` (a ``tiers.Row`` of ``Thresholds.topk_rows``, or None) judges the
    top-k KLD mean and p99 over the compared positions. ``unmeasured`` when no row fits (naming
    ``command``, which measures one) or fewer than ``min_positions`` positions were compared.
    ``cuts`` (``harness.measure.near_ties.RouterCuts``, from ``runs.topk.topk_router_cuts``): MoE
    prompts cut at a router near-tie, left out of ``summary`` by the caller; the line says where."""
    compared = int(summary["compared_positions"])
    if row is None:
        line = f"top-k tier ({subject_text}, k {k}): UNMEASURED — {unmeasured_reason}"
        if command:
            line += f"; measure it with: {command}"
        return TierResult("topk", "unmeasured", [], line, None, unmeasured_reason, command)
    checks = []
    for name, (key, label) in TOPK_GATES.items():
        if name not in row.gates:
            continue
        thr = float(row.gates[name]["value"])
        observed = (summary.get("kld") or {}).get(key)
        checks.append(GateCheck("topk", name, label, thr, observed, None if observed is None else bool(observed <= thr),
                                row.gates[name].get("basis", {}).get("kind", "declared")))
    parts = [f"{c.label} ≤ {c.threshold:g}: {'ok' if c.ok else ('FAIL' if c.ok is False else 'not computed')} "
             f"({'n/a' if c.observed is None else f'{c.observed:.3g}'})" for c in checks]
    line = f"top-k tier ({subject_text}, k {row.k} of {k}, {row.source}): " + "; ".join(parts)
    rc = None
    if cuts is not None and (cuts.cuts or cuts.notes):
        line += "; " + (cuts.line() or "not cut at a router near-tie: " + "; ".join(cuts.notes))
        rc = cuts.to_dict()
    if any(c.ok is False for c in checks):
        return TierResult("topk", "fail", checks, line, row.source, router_cuts=rc)
    if compared < min_positions or not checks or any(c.ok is None for c in checks):
        why = f"{compared} positions compared, fewer than {min_positions}" if compared < min_positions else "a gate could not be computed"
        return TierResult("topk", "unmeasured", checks, f"{line} — UNMEASURED: {why}", row.source, why, router_cuts=rc)
    return TierResult("topk", "ok", checks, line, row.source, router_cuts=rc)


def overall_topk(release: TierResult, tier: TierResult) -> tuple[Verdict, str]:
    """A top-k cell's verdict: FAIL when the top-k tier fails, PASS when it is ok, else
    UNMEASURED; the release tier's line (not computed) is always part of the message."""
    if tier.status == "fail":
        return Verdict.FAIL, f"{tier.line}; {release.line}"
    if tier.status == "ok":
        return Verdict.PASS, f"{tier.line}; {release.line}; verdict is the top-k tier's"
    return Verdict.UNMEASURED, f"{tier.line}; {release.line}"
