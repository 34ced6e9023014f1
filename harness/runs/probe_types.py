"""What every probe returns: its tolerance, each comparison it made and its result
(``harness.runs.probes`` runs the self-consistency probes, ``harness.runs.serving`` the serving
probe; both build on these types, so neither imports the other)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterator

import numpy as np

from harness.errors import EngineError, Verdict
from harness.evidence.receipts import acceptance_rows
from harness.measure import metrics

@dataclass
class ProbeTolerance:
    """Bounds a probe's comparison must meet: per-position cosine ≥ ``min_cosine`` and KLD ≤
    ``max_kld`` (nats). ``exact`` demands bit-identical logits (determinism).

    ``excursions``: how many positions of one comparison may leave those bounds, provided the
    comparison's last position is back within them and none is non-finite. Zero on a dense model. On an MoE model
    (``expert_count`` > 0) it is thresholds.yaml ``probes.moe_excursions``: an expert-router
    near-tie makes a correct engine pick another expert when the same prompt is fed in other
    pieces, which moves a burst of a few positions far past the class's bounds and then recovers
    (llama.cpp on ``fixture:tiny-qwen35moe``: 5 positions below cosine 0.99999, the worst at 0.99864 and KLD 8.6e-3, fed one
    token per call; on a 97-token counting prompt split anywhere before position 83, 9 positions
    from 83 on, the worst at cosine 0.974, back within the bounds from 93). A burst ends; a state
    fault (state dropped, reset or drifting between calls, a KV cache lost) lasts to the last
    position, so it still fails however few positions follow the split; a fault confined to the
    first position of each call moves every position of the decode probe, which still sees it."""

    min_cosine: float = 0.99999
    max_kld: float = 1e-4
    exact: bool = False
    excursions: int = 0


@dataclass
class Comparison:
    """One variant compared with its baseline; ``chunks``: the piece lengths the variant was fed
    in (None: whole); ``excursions``: positions outside the bounds that the tolerance allowed
    (``ProbeTolerance.excursions``), so a PASS says how many it forgave."""

    label: str
    positions: int
    ok: bool
    min_cosine: float | None
    max_kld: float | None
    max_abs_diff: float | None
    first_bad_position: int | None
    chunks: list[int] | None = None
    excursions: int = 0
    case: dict[str, Any] | None = None
    """What a generation case fed (the speculative probe): ``{"prompt": source prompt, "n_tokens":
    tokens fed, "chunks": piece lengths or None (whole), "generated": tokens generated}``, the
    reproducer's context of a failure here (``harness.runs.probes.probe_failure``); None for a
    logits comparison, whose context is its probe's."""
    obligation: str | None = None
    """The contract obligation this comparison judges where it is not its probe's (the speculative
    probe's acceptance gate: QMTP-ACCEPT-011), whose mutants are a failure's likely cause
    (``harness.runs.probes.probe_failure``); None: the probe's own (``PROBES``)."""

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass
class ProbeResult:
    """A probe's verdict with every comparison it made; ``reason`` explains UNMEASURED/FAIL;
    ``bounds`` states the tolerance the comparisons were held to; ``reproducer`` is the failure's
    reproducer line when ``run_probes`` ran it (``probe_failure``)."""

    name: str
    verdict: Verdict
    comparisons: list[Comparison] = field(default_factory=list)
    reason: str = ""
    reproducer: str = ""
    bounds: str = ""
    details: dict[str, Any] = field(default_factory=dict)

    @property
    def first_failure(self) -> Comparison | None:
        return next((c for c in self.comparisons if not c.ok), None)

    def summary(self) -> str:
        if self.verdict is Verdict.UNMEASURED:
            return self.reason
        f = self.first_failure
        if f is None:
            worst = min((c.min_cosine for c in self.comparisons if c.min_cosine is not None), default=None)
            mk = max((c.max_kld for c in self.comparisons if c.max_kld is not None), default=None)
            ex = sum(c.excursions for c in self.comparisons)
            forgiven = f"; {ex} position{'s' if ex != 1 else ''} outside the bounds allowed as MoE router near-ties" if ex else ""
            return (f"{len(self.comparisons)} comparisons; min cosine {worst:.8f}, max KLD {mk:.3g}{forgiven}" if worst is not None
                    else f"{len(self.comparisons)} comparisons{self._acceptance()}")
        if self.name == "serving":  # the failure line names scenario, request, step, tokens, slot and what was in flight
            return self.reason
        if self.name == "speculative":  # token comparisons: the label names the case, sequence, step and token
            return f"{f.label}{self._acceptance()}"
        return (
            f"{f.label}: first differing position {f.first_bad_position}, min cosine "
            f"{f.min_cosine if f.min_cosine is None else round(f.min_cosine, 8)}, max KLD {f.max_kld if f.max_kld is None else f'{f.max_kld:.3g}'}"
        )

    def _acceptance(self) -> str:
        """``; acceptance per case in details (first drafts gated against the reference head, the
        rest report-only)`` when the details hold per-case draft counts (speculative), else ``""``:
        cases of other draft_max count different things, so no sum over them is shown
        (``acceptance_rows``)."""
        return ("; acceptance per case in details (first drafts gated against the reference head, the rest report-only)"
                if acceptance_rows(self.details) else "")

    def to_dict(self) -> dict[str, Any]:
        d = {"name": self.name, "verdict": self.verdict.value, "reason": self.reason, "summary": self.summary(),
             "comparisons": [c.to_dict() for c in self.comparisons]}
        d = {**d, "details": self.details} if self.details else d
        return {**d, "reproducer": self.reproducer} if self.reproducer else d


def acceptance_lines(details: dict[str, Any]) -> list[str]:
    """The console's lines of ``acceptance_rows``: a heading, then per case ``CASE: A/P = RATE``
    (every draft) and, for a head-drafted case, its acceptance gate: the first drafts accepted
    beside the reference head's at the same steps and the verdict (``gate_text``); then what each
    kind of case counts."""
    rows = acceptance_rows(details)
    if not rows:
        return []
    out = ["speculative acceptance per case (all drafts report-only; first drafts gated against the reference head):"]
    for r in rows:
        rate = "n/a" if r["acceptance"] is None else f"{r['acceptance']:.3f}"
        gate = f"; {gate_text(r['gate'])}" if r["gate"] else ""
        out.append(f"  {r['case']}: {r['accepted']}/{r['proposed']} = {rate}{gate}")
    for counts in dict.fromkeys(r["counts"] for r in rows if r["counts"]):
        out.append(f"  counts: {counts}")
    for counts in dict.fromkeys(r["gate"]["counts"] for r in rows if r["gate"] and r["gate"].get("counts")):
        out.append(f"  gate counts: {counts}")
    return out


def gate_text(g: dict[str, Any]) -> str:
    """One case's acceptance gate (``harness.runs.spec_acceptance.judge``'s record) in words:
    ``first drafts C/S, reference head NAME R/S: VERDICT (drop D, at most M)`` or the reason it is
    UNMEASURED."""
    if "candidate_accepted" not in g:
        return f"gate UNMEASURED ({g.get('reason', '')})"
    head = f"first drafts {g['candidate_accepted']}/{g['steps']}, reference head {g['reference']} {g['reference_accepted']}/{g['steps']}"
    if g.get("verdict") == "UNMEASURED":
        return f"{head}: gate UNMEASURED (fewer than {g['min_reference_accepted']} reference hits)"
    return f"{head}: {g['verdict']} (drop {g['drop']:.2f}, at most {g['max_drop']:g})"


def compare(label: str, base: np.ndarray, other: np.ndarray, tol: ProbeTolerance) -> Comparison:
    """Compare two float32 ``[T, V]`` logit arrays under ``tol`` (see ``ProbeTolerance``)."""
    if base.shape != other.shape:
        return Comparison(label, int(base.shape[0]), False, None, None, None, 0)
    n = base.shape[0]
    if tol.exact:
        diff = np.flatnonzero(~np.all((base == other) | (np.isnan(base) & np.isnan(other)), axis=1))
        pm = metrics.position_metrics(base, other)
        max_abs = float(np.nanmax(np.abs(base.astype(np.float64) - other))) if n else 0.0
        return Comparison(label, n, diff.size == 0, _min(pm["cosine"]), _max(pm["kld"]), max_abs, int(diff[0]) if diff.size else None)
    pm = metrics.position_metrics(base, other)
    return _judged(label, pm, _max_abs(base, other), tol)


def _max_abs(base: np.ndarray, other: np.ndarray) -> float:
    return float(np.nanmax(np.abs(base.astype(np.float64) - other))) if base.size else 0.0


def _judged(label: str, pm: dict[str, np.ndarray], max_abs: float, tol: ProbeTolerance) -> Comparison:
    """The ``Comparison`` of toleranced per-position metrics ``pm`` (``compare``'s rule)."""
    bad = outside(pm, tol)
    idx = np.flatnonzero(bad)
    ok = idx.size == 0 or (idx.size <= tol.excursions and bool(pm["finite"].all()) and not bad[-1])
    return Comparison(label, int(bad.size), ok, _min(pm["cosine"]), _max(pm["kld"]), max_abs, None if ok else int(idx[0]),
                      excursions=int(idx.size) if ok else 0)


def aligned(a: Iterator[np.ndarray], b: Iterator[np.ndarray]) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Pairs of equal-length row blocks from two streams of ``[B, V]`` blocks that cover the same
    positions in other block sizes (at most one block of each held at a time)."""
    ba = bb = None
    while True:
        if ba is None or not len(ba):
            ba = next(a, None)
        if bb is None or not len(bb):
            bb = next(b, None)
        if ba is None or bb is None:
            return
        n = min(len(ba), len(bb))
        yield ba[:n], bb[:n]
        ba, bb = ba[n:], bb[n:]


def compare_streams(label: str, base: Iterator[np.ndarray], other: Iterator[np.ndarray], tol: ProbeTolerance) -> Comparison:
    """``compare`` (toleranced, not exact) on two streams of float32 ``[B, V]`` blocks covering the
    same positions (``checked_blocks``), holding one block of each at a time and ``[T]`` metrics,
    never ``[T, V]``. Raises ``EngineError`` when the streams differ in width or in length (after
    draining both, so each stream's own count check runs first)."""
    rows = [0, 0]

    def counted(it: Iterator[np.ndarray], i: int) -> Iterator[np.ndarray]:
        for x in it:
            rows[i] += len(x)
            yield x

    parts, max_abs = [], 0.0
    a_it, b_it = counted(base, 0), counted(other, 1)
    for a, b in aligned(a_it, b_it):
        if a.shape[1] != b.shape[1]:
            raise EngineError(f"{label}: logit widths differ ({a.shape[1]} vs {b.shape[1]})")
        parts.append(metrics.position_metrics(a, b))
        max_abs = max(max_abs, _max_abs(a, b))
    for it in (a_it, b_it):  # drain: each stream's own count check runs, and neither may run on
        for _ in it:
            pass
    if rows[0] != rows[1]:
        raise EngineError(f"{label}: the streams cover {rows[0]} and {rows[1]} positions")
    return _judged(label, metrics.concat_metrics(parts), max_abs, tol)


def outside(pm: dict[str, np.ndarray], tol: ProbeTolerance) -> np.ndarray:
    """Which positions of ``metrics.position_metrics``'s result leave ``tol``'s bounds (bool
    ``[T]``; a non-finite position always does)."""
    with np.errstate(invalid="ignore"):
        return ~(pm["finite"] & (pm["cosine"] >= tol.min_cosine) & (pm["kld"] <= tol.max_kld))


def _min(a: np.ndarray) -> float | None:
    a = np.asarray(a, np.float64)
    return float(np.nanmin(a)) if a.size and np.isfinite(a).any() else None


def _max(a: np.ndarray) -> float | None:
    a = np.asarray(a, np.float64)
    return float(np.nanmax(a)) if a.size and np.isfinite(a).any() else None
