"""Judging a measured cell with the two tiers (``harness.judge.tiers``): the release gate every
verdict shows, the calibrated tier where a row fits, and how they combine into the verdict.

Every tier has one line that receipts, reports, ledger rows and the terminal show as it is, e.g.
``release gate cosine ≥ 0.98 over ≥ 64 positions: ok, min 0.99593 over 1479 positions``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

import numpy as np

from harness.engines.base import ASSUMED_CLASS, COMPUTE_CLASSES
from harness.errors import Verdict
from harness.judge.tiers import KLD_GATES, Row, Subject
from harness.measure import metrics
from harness.measure.near_ties import RouterCuts, RouterExcuses


@dataclass
class GateCheck:
    """One judged number: ``ok`` None means it could not be computed (never counted as passed)."""

    tier: str
    name: str
    label: str
    threshold: float
    observed: float | None
    ok: bool | None
    basis_kind: str = "declared"

    def to_dict(self) -> dict[str, Any]:
        return {"tier": self.tier, "name": self.name, "label": self.label, "threshold": self.threshold,
                "observed": self.observed, "ok": self.ok, "basis_kind": self.basis_kind}


@dataclass
class TierResult:
    """A tier's judgement: ``status`` is ``ok``, ``fail`` or ``unmeasured``; ``line`` is the one
    line every receipt, report and ledger row shows; ``command`` measures an unmeasured tier."""

    tier: str
    status: str
    checks: list[GateCheck] = field(default_factory=list)
    line: str = ""
    source: str | None = None
    reason: str | None = None
    command: str | None = None
    failing_positions: int = 0
    first_failing: int | None = None
    worst: int | None = None
    not_judged: np.ndarray | None = None
    """bool [N]: positions this tier did not judge (an MoE prompt cut at a router near-tie; a
    position the release gate excused at one)."""
    router_cuts: dict[str, Any] | None = None
    router_excuses: dict[str, Any] | None = None
    oracle_referee: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        d = {"tier": self.tier, "status": self.status, "line": self.line, "source": self.source,
             "reason": self.reason, "command": self.command, "failing_positions": self.failing_positions,
             "checks": [c.to_dict() for c in self.checks]}
        if self.router_cuts is not None:
            d["router_cuts"] = self.router_cuts
        if self.router_excuses is not None:
            d["router_excuses"] = self.router_excuses
        if self.oracle_referee is not None:
            d["oracle_referee"] = self.oracle_referee
        return d


def _cosine_check(tier: str, per_position: Mapping[str, np.ndarray], threshold: float, basis_kind: str) -> tuple[GateCheck, np.ndarray]:
    fails = metrics.cosine_failures(per_position, threshold)
    cos = np.asarray(per_position["cosine"], dtype=np.float64)
    finite = np.asarray(per_position["finite"], bool) & np.asarray(per_position["ref_finite"], bool) & np.isfinite(cos)
    observed = float(np.min(cos[finite])) if finite.any() else None  # non-finite rows fail through ``fails``
    return GateCheck(tier, "min_cosine", "cosine", float(threshold), observed, bool(cos.size) and fails.size == 0, basis_kind), fails


def worst_position(per_position: Mapping[str, np.ndarray], fails: np.ndarray) -> int | None:
    """Index of the failing position with the lowest cosine (non-finite counts lowest), or None."""
    if not fails.size:
        return None
    cos = np.where(np.isfinite(per_position["cosine"]), per_position["cosine"], -np.inf)
    return int(fails[np.argmin(cos[fails])])


def judge_release(per_position: Mapping[str, np.ndarray], release: Mapping[str, Mapping[str, Any]],
                  excuses: RouterExcuses | None = None, referee: Any = None) -> TierResult:
    """The release gate over concatenated per-position metrics (``metrics.position_metrics``).

    ``release``: ``{"min_cosine": {"value": 0.98, ...}, "min_positions": {"value": 64, ...}}``.
    Status ``unmeasured`` when fewer than ``min_positions`` positions were compared (a cosine
    failure among them is still ``fail``). ``excuses`` (``harness.measure.near_ties.RouterExcuses``,
    MoE models): positions below the floor at a reference router near-tie, which are not
    failures; the minimum and the count are over the other positions, and the line names them.
    ``referee`` (``harness.runs.referee.OracleReferee``): positions where the reference is off the
    exact oracle and the candidate was judged against the oracle instead; left out the same way.
    """
    thr = float(release["min_cosine"]["value"])
    need = int(release["min_positions"]["value"])
    kind = release["min_cosine"].get("basis", {}).get("kind", "declared")
    n = int(np.asarray(per_position["cosine"]).size)
    masks = [e.mask for e in (excuses, referee) if e is not None and e.count]
    left_out = np.logical_or.reduce(masks) if masks else None
    keep = np.flatnonzero(~left_out) if left_out is not None else None
    if keep is None:
        check, fails = _cosine_check("release", per_position, thr, kind)
    else:
        check, fails = _cosine_check("release", {k: np.asarray(v)[keep] for k, v in per_position.items()}, thr, kind)
        fails, n = keep[fails], int(keep.size)
    obs = "non-finite" if check.observed is None else f"{check.observed:.5f}"
    if fails.size:
        status, word = "fail", "FAIL"
    elif n < need:
        status, word = "unmeasured", "UNMEASURED"
        check.ok = None
    else:
        status, word = "ok", "ok"
    line = f"release gate cosine ≥ {thr:g} over ≥ {need} positions: {word}, min {obs} over {n} positions"
    if fails.size:
        line += f" ({fails.size} below)"
    if excuses is not None and (excuses.excused or excuses.notes):
        line += "; " + excuses.line()
    if referee is not None and (referee.judged or referee.notes):
        line += "; " + referee.line()
    return TierResult("release", status, [check], line, "thresholds.yaml release", None, None, int(fails.size),
                      int(fails[0]) if fails.size else None, worst_position(per_position, fails),
                      not_judged=left_out, router_excuses=None if excuses is None else excuses.to_dict(),
                      oracle_referee=None if referee is None else referee.to_dict())


def judge_calibrated(per_position: Mapping[str, np.ndarray], summary: Mapping[str, Any], row: Row | None,
                     subject: Subject, unmeasured_reason: str = "", command: str | None = None,
                     cuts: RouterCuts | None = None, excused: np.ndarray | None = None) -> TierResult:
    """The calibrated tier: ``row``'s cosine and KLD gates (KL(P_ref ‖ P_cand), nats, over all
    positions), or ``unmeasured`` with ``unmeasured_reason`` and the ``command`` that would measure
    it when no row fits (``row`` None). ``cuts`` (``harness.measure.near_ties.RouterCuts``):
    positions of MoE prompts from a verified router near-tie on, which this tier leaves out (its
    line says so); ``excused`` (bool [N]): positions the release gate excused at a router near-tie
    (``RouterExcuses.mask``), left out too, as calibration measured the rows. A row measured over
    a bounded number of positions per prompt (``row.max_tokens``: measured on the subject) judges
    those positions of each prompt only. Failing and worst positions index the whole cell."""
    if row is None:
        line = f"calibrated tier ({subject.key_text()}): UNMEASURED — {unmeasured_reason}"
        if command:
            line += f"; measure it with: {command}"
        return TierResult("calibrated", "unmeasured", [], line, None, unmeasured_reason, command)
    keep, left_out = None, None
    n = np.asarray(per_position["cosine"]).size
    beyond = (np.asarray(per_position["position"]) >= row.max_tokens if row.max_tokens is not None and "position" in per_position
              else np.zeros(n, bool))
    if (cuts is not None and cuts.count) or (excused is not None and excused.any()) or beyond.any():
        left_out = (cuts.mask if cuts is not None else np.zeros(n, bool)) | (excused if excused is not None else False) | beyond
        keep = np.flatnonzero(~left_out)
        if not keep.size:  # nothing left to judge: never a PASS
            reason = "every position follows a router near-tie (" + (cuts.line() if cuts is not None else "excused") + ")"
            return TierResult("calibrated", "unmeasured", [], f"calibrated tier ({subject.key_text()}): UNMEASURED — {reason}",
                              row.source, reason, None, router_cuts=None if cuts is None else cuts.to_dict())
        per_position = {k: np.asarray(v)[keep] for k, v in per_position.items()}
        summary = metrics.summarize(per_position)
    g = row.gates["min_cosine"]
    cos_check, fails = _cosine_check("calibrated", per_position, float(g["value"]), g.get("basis", {}).get("kind", "declared"))
    worst = worst_position(per_position, fails)
    if keep is not None:  # back to the cell's own indices
        fails, worst = keep[fails], (None if worst is None else int(keep[worst]))
    checks = [cos_check]
    for name, (key, label) in KLD_GATES.items():
        if name not in row.gates:
            continue
        thr = float(row.gates[name]["value"])
        observed = (summary.get("kld") or {}).get(key)
        ok = None if observed is None else bool(observed <= thr)
        checks.append(GateCheck("calibrated", name, label, thr, observed, ok, row.gates[name].get("basis", {}).get("kind", "declared")))
    failed = [c for c in checks if c.ok is False]
    status = "fail" if failed else "ok"
    parts = [f"{c.label} {'≥' if c.name == 'min_cosine' else '≤'} {c.threshold:g}: "
             f"{'ok' if c.ok else ('FAIL' if c.ok is False else 'not computed')} ({_fmt(c.observed)})" for c in checks]
    line = f"calibrated tier ({subject.key_text()}, {row.source}): " + "; ".join(parts)
    if cuts is not None and (cuts.cuts or cuts.notes):
        line += "; " + (cuts.line() or "not cut at a router near-tie: " + "; ".join(cuts.notes))
    if excused is not None and excused.any():
        n_ex = int(excused.sum())
        line += f"; the {n_ex} position{'s' if n_ex != 1 else ''} the release gate excused left out"
    if beyond.any():
        line += (f"; judged over each prompt's first {row.max_tokens} positions, as the row was measured "
                 f"({int(beyond.sum())} later positions left to the release gate)")
    return TierResult("calibrated", status, checks, line, row.source, None, None, int(fails.size),
                      int(fails[0]) if fails.size else None, worst, left_out, None if cuts is None else cuts.to_dict())


def _fmt(x: float | None) -> str:
    """An observed number for a tier line: a cosine close to 1 as 1 − cos (two significant
    digits), anything else with three."""
    if x is None:
        return "n/a"
    if 0.999 < x <= 1.0:
        return f"min 1 − {1 - x:.2g}"
    return f"{x:.3g}"


def class_advice(subject: Subject) -> str:
    """The one line telling an engine that declared no class how to declare it."""
    return (f"the candidate declares no compute class, so it was judged as {ASSUMED_CLASS}; if it computes in "
            f"another precision, declare it: \"compute_class\": \"bf16\" in info.json (one of {', '.join(COMPUTE_CLASSES)})")


def overall(release: TierResult, calibrated: TierResult, subject: Subject, require_calibrated: bool = False) -> tuple[Verdict, str]:
    """Combine the tiers into the run's verdict and its one-line message (module docstring)."""
    advice = "" if subject.class_declared else f"; {class_advice(subject)}"
    if release.status == "fail" or calibrated.status == "fail":
        failed = [t.line for t in (release, calibrated) if t.status == "fail"]
        return Verdict.FAIL, "; ".join(failed) + (advice if calibrated.status == "fail" else "")
    if release.status == "unmeasured":
        return Verdict.UNMEASURED, release.line
    if calibrated.status == "unmeasured":
        if require_calibrated:
            return Verdict.UNMEASURED, f"{calibrated.line} (required by --require-calibrated)"
        return Verdict.PASS, f"{release.line}; verdict is the release gate's ({calibrated.line})"
    return Verdict.PASS, f"{release.line}; {calibrated.line}"
