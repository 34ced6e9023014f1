"""The serving probe: a request's answer must not depend on the other traffic the engine serves.

Engines break while serving, in code a request served alone never reaches: a GDN state that
survives a reused slot (llama.cpp #29092, warpfront/hipfire #462, Luce-Org/lucebox PR #210), a
prefix cache hit on a shared chat header (kekzl/imp PR #1463), states packed on one block grid and
looked up on another (sglang PR #33515), a cache hit that skips the recurrent layers' state
(LMCache PR #2863), a sequence that joins a running batch and gets another's state (mlx-lm PR
#1169), mixed prefill and decode steps (sglang PR #23075), padded batch rows that alias slot 0
(vLLM PR #34077, sglang PR #27202), long chats through the prompt cache (llama.cpp #21681).

For every scenario of the set (``harness.measure.scenarios``; the shipped set by default) the
engine serves the whole scenario through its own scheduler (``Engine.serve``, capability
``serve``), and then, on the engine started afresh, every request is run alone with the plain
ops: ``generate`` for its tokens and ``logits`` of its prompt and those tokens for its rows.

- **The step log proves the scenario happened.** A scenario whose ``expect`` did not happen (B
  never shared a step with A's decode, no slot was reused, no request reported a cache hit, fewer
  requests in flight than asked) is UNMEASURED, naming what did not happen: an engine that serves
  one request after another passes nothing it did not do.
- **Tokens**, step by step, against the solo run's; a divergence is excused only at a near-tie of
  the solo path's own margin (``SERVE_NEAR_TIE``), and then the comparison goes on: the scenario
  is served again with that request teacher forced on the solo path's tokens, and its rows and its
  own choices along that path are judged to the end (``harness.measure.continuation``).
- **Logits** of the prompt (from the first position the engine computed) and of the generated
  tokens, by the ``probe:`` row of the candidate's class (the split and decode probes'
  tolerances), compared block by block as they are read, never held as ``[T, V]``.
- **A cache hit larger than anything fed before** (a request reporting more reused prefix tokens
  than its prompt shares with any earlier request's history) is a FAIL on its own.
- **Each solo run is judged against the reference** by the release gate (per-position cosine),
  so a scenario cannot pass on an engine that is wrong alone.

A FAIL names the scenario, the request, the step, both tokens, the slot and what else was in
flight at that step.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterator, Sequence

import numpy as np

from harness.engines.base import Engine, checked_blocks
from harness.engines.serving import (
    ServeRequest,
    ServeResult,
    ServeScenario,
    ServedRequest,
    check_serve_result,
    common_prefix,
    result_to_json,
)
from harness.errors import EngineError, Verdict
from harness.measure import metrics
from harness.measure.continuation import Divergence, judge_greedy
from harness.measure.prompts import PromptTokens
from harness.measure.scenarios import Scenario
from harness.runs.probe_types import Comparison, ProbeResult, ProbeTolerance, aligned, outside  # noqa: F401 (aligned re-exported)

SERVE_NEAR_TIE = {
    "value": 1e-3,
    "basis": {"kind": "declared", "who": "harness maintainers (a served request vs the same request alone; harness/runs/serving.py)",
              "why": "A served request may be computed in batches of another composition than its solo run (other kernels, "
                     "other summation orders), which moves a float32 logit by about 1e-5 relative, as a speculative "
                     "verification batch does; only a near-exact tie of the solo path's top-1/top-2 logits can flip a "
                     "token, while a state fault moves logits by whole units. The same value as the speculative probe's "
                     "near-tie, far below the report-only greedy near_tie_margin (0.25), so a fault cannot hide behind it.",
              "date": "2026-12-03"},
}
"""The serving probe's declared near-tie δ (logits) and its basis (recorded in the probe's details)."""


TOLERANCE_SPAN = 640
"""History positions within which served rows are held to the class's probe tolerance; beyond it,
to the release floor's cosine alone, tokens still compared step by step. The probe rows of
thresholds.yaml were measured over the decode probe's 640 positions (``probes.DECODE_TOKENS``),
and a correct engine's own drift between batch compositions grows with the history: llama.cpp
serving the dense ``fixture:trained-qwen35`` multi-turn scenario reaches 1 − cosine 6.9e-5 at
position 3,036 of its third turn, as llama.cpp at n_ubatch 7 alone does against it (1 − 6.8e-5),
5× the f32 tolerance (1.3e-5). Until a calibration measures the probe rows over serving histories,
a tolerance is not applied where it has no basis; a state fault (every serving mutant: cosine 0.49
to 0.77) stays far below the floor."""


def has_serve(engine: Engine) -> bool:
    return "serve" in engine.info.capabilities and callable(getattr(engine, "serve", None))


@dataclass
class _Metrics:
    """Per-position metrics of one comparison, gathered block by block (``[T]`` arrays only)."""

    parts: list[dict[str, np.ndarray]] = field(default_factory=list)

    def add(self, base: np.ndarray, other: np.ndarray) -> None:
        if len(base):
            self.parts.append(metrics.position_metrics(base, other))

    def joined(self) -> dict[str, np.ndarray]:
        return metrics.concat_metrics(self.parts)


def _comparison(label: str, pm: dict[str, np.ndarray], offset: int, tol: ProbeTolerance, floor: float = 0.98,
                span: int | None = None) -> Comparison:
    """A ``Comparison`` of gathered per-position metrics under ``tol`` (as ``probes.compare``);
    ``offset``: the history position of the first row, so ``first_bad_position`` is a position
    of the request's history. Rows at history positions ≥ ``span`` (default ``TOLERANCE_SPAN``)
    are held to the release floor's cosine ``floor`` alone: the class's probe tolerance was measured
    over shorter histories, and a correct engine's own drift grows past it (``TOLERANCE_SPAN``)."""
    n = int(len(pm["cosine"]))
    if n == 0:
        return Comparison(label, 0, True, None, None, None, None)
    span = TOLERANCE_SPAN if span is None else span
    bad = outside(pm, tol)
    far = np.arange(offset, offset + n) >= span
    if far.any():
        with np.errstate(invalid="ignore"):
            bad = np.where(far, ~(pm["finite"] & (pm["cosine"] >= floor)), bad)
    idx = np.flatnonzero(bad)
    ok = idx.size == 0 or (idx.size <= tol.excursions and bool(pm["finite"].all()) and not bad[-1])
    with np.errstate(invalid="ignore"):
        cos = float(np.nanmin(pm["cosine"])) if np.isfinite(pm["cosine"]).any() else None
        kld = float(np.nanmax(pm["kld"])) if np.isfinite(pm["kld"]).any() else None
    comp = Comparison(label, n, ok, cos, kld, None, None if ok else int(idx[0]) + offset, excursions=int(idx.size) if ok else 0)
    if not ok:  # the tokens the two rows choose there, for the failure line
        comp.tokens = (int(pm["ref_argmax"][idx[0]]), int(pm["cand_argmax"][idx[0]]))  # type: ignore[attr-defined]
    return comp


@dataclass
class _Solo:
    """A request run alone: its tokens and the margins of the rows that chose them."""

    tokens: list[int]
    margins: np.ndarray


class _Judge:
    """Judges one served scenario (see the module docstring)."""

    def __init__(self, engine: Engine, scenario: ServeScenario, result: ServeResult, tol: ProbeTolerance,
                 reference: Callable[[], Engine] | None, min_cosine: float, delta: float):
        self.engine, self.scenario, self.result, self.tol = engine, scenario, result, tol
        self.reference, self.min_cosine, self.delta = reference, min_cosine, delta
        self.comparisons: list[Comparison] = []
        self.rows: list[dict[str, Any]] = []
        self.failures: list[str] = []

    # -- solo runs ------------------------------------------------------------------------------
    def solo(self, served: ServedRequest) -> tuple[_Solo, Comparison | None]:
        """The request alone: greedy tokens by ``generate``, then one pass over its rows by
        ``logits`` (prompt and those tokens) that judges them against the reference (release gate),
        takes the margins of the rows that chose each token, and compares the served rows with them
        up to the row that chose the first token where the two paths part (the rows after it
        follow another history). Returns the solo run and that comparison (None: no served rows)."""
        n = len(served.tokens)
        toks = [int(t) for t in self.engine.generate(list(served.prompt), n)] if n else []  # type: ignore[attr-defined]
        path = list(served.prompt) + toks[:-1]
        start = len(served.prompt) - 1
        parted = next((i for i in range(len(toks)) if i >= len(served.tokens) or served.tokens[i] != toks[i]), None)
        upto = min(served.fed_end, len(path)) if parted is None else len(served.prompt) + parted
        margins = np.full(len(toks), np.nan)
        ref_pm, mine_pm = _Metrics(), _Metrics()
        lo = served.logits_start if served.rows is not None else None
        blocks = checked_blocks(self.engine.logits(path), len(path))
        pairs = (aligned(checked_blocks(self.reference().logits(path), len(path)), blocks) if self.reference is not None
                 else ((None, c) for c in blocks))
        pos = 0
        for ref, block in pairs:
            g0, hi = max(start, pos), pos + len(block)
            if hi > g0:
                margins[g0 - start : hi - start] = metrics.reference_margin(block[g0 - pos :])
            if ref is not None:
                ref_pm.add(ref, block)
            if lo is not None and min(upto, hi) > max(lo, pos):
                a, b = max(lo, pos), min(upto, hi)
                mine_pm.add(block[a - pos : b - pos], served.rows(a - lo, b - lo))  # type: ignore[misc]
            pos += len(block)
        if self.reference is not None:
            self._reference_verdict(served, ref_pm.joined(), len(path))
        comp = None if lo is None else _comparison(f"{self.scenario.name}/{served.id}: rows", mine_pm.joined(), lo, self.tol,
                                                   self.min_cosine)
        return _Solo(toks, margins), comp

    def _reference_verdict(self, served: ServedRequest, pm: dict[str, np.ndarray], n: int) -> None:
        bad = metrics.cosine_failures(pm, self.min_cosine)
        worst = float(np.nanmin(pm["cosine"])) if len(pm["cosine"]) and np.isfinite(pm["cosine"]).any() else None
        ok = bad.size == 0 and len(pm["cosine"]) == n
        at = int(bad[0]) if bad.size else 0
        self.comparisons.append(Comparison(f"{self.scenario.name}/{served.id}: solo run vs reference (release gate cosine >= "
                                           f"{self.min_cosine})", n, ok, worst, None, None, None if ok else at))
        if not ok:
            self.failures.append(f"scenario {self.scenario.name!r}, request {served.id!r}: the solo run leaves the reference at position "
                                 f"{at} (cosine {worst}, release gate {self.min_cosine}): the engine is wrong alone; see harness parity")

    # -- rows -----------------------------------------------------------------------------------
    def compare_rows(self, label: str, served: ServedRequest, path_tokens: list[int], upto: int) -> tuple[Comparison, np.ndarray] | None:
        """Served rows against the solo engine's rows on ``served.prompt + path_tokens[:-1]``, over
        the served positions ``[logits_start, upto)``; returns the comparison and the served rows'
        argmax at every position compared. None when the engine gave no rows."""
        if served.logits_start is None or served.rows is None:
            return None
        path = list(served.prompt) + list(path_tokens)[:-1]
        lo, upto = served.logits_start, min(upto, served.fed_end, len(path))
        pm, pos, chosen = _Metrics(), 0, []
        for block in checked_blocks(self.engine.logits(path), len(path)):
            a, b = max(lo, pos), min(upto, pos + len(block))
            if b > a:
                mine = served.rows(a - lo, b - lo)
                pm.add(block[a - pos : b - pos], mine)
                chosen.extend(int(np.argmax(r)) for r in mine)
            pos += len(block)
        return _comparison(label, pm.joined(), lo, self.tol, self.min_cosine), np.asarray(chosen, dtype=np.int64)

    # -- one request ----------------------------------------------------------------------------
    def _where(self, rid: str, step: int | None) -> str:
        served = self.result.requests[rid]
        others = self.result.in_flight(step, besides=rid) if step is not None else []
        beside = ", ".join(f"{e.request!r} (slot {e.slot}, fed {e.fed}" + (f", verifying {e.drafts} drafts, {e.accepted} accepted" if e.drafts else "")
                           + ")" for e in others) or "nothing else"
        return f"step {step}, slot {served.slot}, cached prefix {served.cached}; in flight beside it: {beside}"

    def _forced(self, req: ServeRequest, solo: _Solo) -> Callable[[], Sequence[int]] | None:
        """The request's choices along the solo path: the scenario served again with it teacher
        forced on the solo tokens; its rows there are compared too. None without rows."""
        served = self.result.requests[req.id]
        if served.logits_start is None:
            return None

        def choices() -> list[int]:
            forced = ServeScenario(self.scenario.name, [replace(r, force=list(solo.tokens)) if r.id == req.id else r
                                                        for r in self.scenario.requests])
            again = check_serve_result(forced, self.engine.serve(forced), int(self.engine.n_vocab), self.engine.info.name)  # type: ignore[attr-defined]
            got = again.requests[req.id]
            out = self.compare_rows(f"{self.scenario.name}/{req.id}: rows, teacher forced on the solo path", got, solo.tokens, got.fed_end)
            if out is None:
                return []
            comp, argmax = out
            self.comparisons.append(comp)
            start = len(got.prompt) - 1 - got.logits_start  # type: ignore[operator]
            return [int(t) for t in argmax[start : start + len(solo.tokens)]]

        return choices

    def request(self, req: ServeRequest) -> None:
        served = self.result.requests[req.id]
        solo, comp = self.solo(served)
        judged = judge_greedy(solo.tokens, served.tokens, lambda i: solo.margins[i] if i < len(solo.margins) else np.nan,
                              self.delta, self._forced(req, solo))
        row = {"request": req.id, "slot": served.slot, "cached": served.cached, "aborted": served.aborted, "tokens": len(served.tokens),
               "near_ties": [d.to_dict() for d in judged.near_ties], "forced": judged.forced}
        if req.draft_max is not None:  # report-only, as in the speculative probe
            entries = [e for _, e in self.result.entries_of(req.id)]
            row |= {"draft_max": req.draft_max, "proposed": sum(e.drafts for e in entries), "accepted": sum(e.accepted for e in entries)}
        if comp is not None:
            self.comparisons.append(comp)
            if not comp.ok:
                p = comp.first_bad_position
                step = self.result.step_of_position(req.id, p) if p is not None else None
                alone, mine = getattr(comp, "tokens", (None, None))
                self.failures.append(f"scenario {self.scenario.name!r}, request {req.id!r}: logits row {p} leaves the solo run "
                                     f"(min cosine {comp.min_cosine:.8f}, max KLD {comp.max_kld:.3g}; top token served {mine}, alone "
                                     f"{alone}) at {self._where(req.id, step)}")
            label = f"{self.scenario.name}/{req.id}: rows, teacher"
            forced_bad = next((c for c in self.comparisons if c.label.startswith(label) and not c.ok), None)
            if forced_bad is not None:
                self.failures.append(f"scenario {self.scenario.name!r}, request {req.id!r}: teacher forced past a near-tie, logits row "
                                     f"{forced_bad.first_bad_position} leaves the solo run (min cosine {forced_bad.min_cosine})")
        elif judged.near_ties and not judged.forced:
            row["unmeasured"] = (f"near-tie at token {judged.near_ties[0].index}; the engine returns no logits, so nothing after it "
                                 "can be judged")
        if judged.hard is not None:
            self._token_failure(req, judged.hard)
        self._cache_claim(req)
        self.rows.append(row)

    def _token_failure(self, req: ServeRequest, d: Divergence) -> None:
        step = self.result.emission_step(req.id, d.index + 1)
        self.comparisons.append(Comparison(f"{self.scenario.name}/{req.id}: tokens (token {d.index}: served {d.chosen}, solo {d.solo}, "
                                           f"margin {d.margin:.4g})", d.index + 1, False, None, None, None, d.index))
        self.failures.append(f"scenario {self.scenario.name!r}, request {req.id!r}: token {d.index} served {d.chosen}, alone {d.solo} "
                             f"(solo margin {d.margin:.4g} >= near-tie {self.delta}) at {self._where(req.id, step)}")

    def _cache_claim(self, req: ServeRequest) -> None:
        """FAIL a reported cache hit longer than the prompt shares with anything fed before it."""
        served = self.result.requests[req.id]
        if not served.cached:
            return
        first = self.result.entries_of(req.id)[0][0] if self.result.entries_of(req.id) else None
        earlier = [q for q in self.result.requests.values() if q.id != req.id and self.result.entries_of(q.id)
                   and first is not None and self.result.entries_of(q.id)[0][0] < first]
        shared = max((common_prefix(served.prompt, list(q.prompt) + list(q.tokens)[:-1]) for q in earlier), default=0)
        if served.cached > shared:
            self.comparisons.append(Comparison(f"{self.scenario.name}/{req.id}: cache hit of {served.cached} tokens, {shared} shared with "
                                               "earlier requests", served.cached, False, None, None, None, shared))
            self.failures.append(f"scenario {self.scenario.name!r}, request {req.id!r}: reused {served.cached} cached prefix tokens, but "
                                 f"its prompt shares at most {shared} with any request before it ({self._where(req.id, first)})")


def intent_missing(scenario: Scenario, result: ServeResult) -> str | None:
    """What of ``scenario.expect`` did not happen in ``result``'s step log (None: all of it)."""
    ex = scenario.expect
    if "overlap" in ex:
        a, b = ex["overlap"]
        pa, pb = len(result.requests[a].prompt), len(result.requests[b].prompt)
        at_a, at_b = result.requests[a].cached, result.requests[b].cached
        decode_a, prefill_b = set(), set()
        for idx, e in result.entries_of(a):
            if at_a >= pa:
                decode_a.add(idx)
            at_a += e.kept
        for idx, e in result.entries_of(b):
            if at_b < pb and e.fed:
                prefill_b.add(idx)
            at_b += e.kept
        if not decode_a & prefill_b:
            return f"request {b!r}'s prefill never shared a step with request {a!r}'s decode"
    if "slot_reuse" in ex:
        a, b = ex["slot_reuse"]
        ea, eb = result.entries_of(a), result.entries_of(b)
        if result.requests[a].slot != result.requests[b].slot or not ea or not eb or eb[0][0] <= ea[-1][0]:
            return (f"request {b!r} (slot {result.requests[b].slot}) did not reuse the slot request {a!r} (slot "
                    f"{result.requests[a].slot}) ended in")
    if "cache_hit" in ex and not any(result.requests[r].cached for r in ex["cache_hit"]):
        return f"none of requests {', '.join(ex['cache_hit'])} reported prefix tokens reused from a cache"
    for rid in ex.get("speculated", []):
        if not any(e.drafts for _, e in result.entries_of(rid)):
            return f"request {rid!r} asked to speculate (draft_max) but verified no drafts in any step"
    if "verify_together" in ex:
        together = set(ex["verify_together"])
        if not any(together <= {e.request for e in s.entries if e.drafts} for s in result.steps):
            return f"requests {', '.join(ex['verify_together'])} never verified drafts in the same step"
    if "in_flight" in ex:
        most = max((len(s.entries) for s in result.steps), default=0)
        if most < int(ex["in_flight"]):
            return f"at most {most} request{'s' if most != 1 else ''} shared a step; the scenario needs {ex['in_flight']} in flight"
    return None


def serve_scenario(engine: Engine, scenario: ServeScenario) -> ServeResult:
    """``engine.serve(scenario)`` checked (``check_serve_result``). Raises ``EngineError``."""
    return check_serve_result(scenario, engine.serve(scenario), int(engine.n_vocab), engine.info.name)  # type: ignore[attr-defined]


def probe_serving(engine: Engine, prompts: Sequence[PromptTokens], tol: ProbeTolerance, scenarios: Sequence[Scenario],
                  reference: Callable[[], Engine] | None = None, min_cosine: float = 0.98, context_length: int | None = None,
                  delta: float | None = None, progress: Callable[[str], None] | None = None) -> ProbeResult:
    """Every scenario of ``scenarios`` served by ``engine`` and judged against each request run
    alone (module docstring), on ``prompts`` (the run's, tokenized by the reference). ``tol``: the
    probe tolerances of the candidate's class; ``reference()``: the engine each solo run is judged
    against with the release gate ``min_cosine`` (None: not judged); ``context_length``: the
    model's, a scenario needing more is UNMEASURED. PASS only when every scenario PASSes; FAIL
    when one fails; otherwise UNMEASURED naming each scenario not measured and why. UNMEASURED
    without capability ``serve``. Raises ``EngineError`` for a malformed reply."""
    if not has_serve(engine):
        return ProbeResult("serving", Verdict.UNMEASURED, reason=f"{engine.info.name} does not declare serving (capability 'serve')")
    if "generate" not in engine.info.capabilities:
        return ProbeResult("serving", Verdict.UNMEASURED, reason=f"{engine.info.name} serves but cannot generate alone (capability "
                           "'generate'), so no request has a solo run to be compared with")
    delta = SERVE_NEAR_TIE["value"] if delta is None else float(delta)
    comps: list[Comparison] = []
    rows: list[dict[str, Any]] = []
    failures: list[str] = []
    restart = getattr(engine, "restart", None)
    for sc in scenarios:
        if progress:
            progress(f"serving: {sc.name}")
        need = sc.history_tokens()
        if context_length and need > context_length:
            rows.append({"scenario": sc.name, "verdict": "UNMEASURED", "reason": f"needs {need} positions; the model declares "
                         f"context_length {context_length}"})
            continue
        resolved = sc.resolve(prompts)
        result = serve_scenario(engine, resolved)
        missing = intent_missing(sc, result)
        if missing is not None:
            rows.append({"scenario": sc.name, "verdict": "UNMEASURED", "reason": missing, "log": result_to_json(result)})
            continue
        if callable(restart):
            restart()  # solo runs on a freshly started engine
        judge = _Judge(engine, resolved, result, tol, reference, min_cosine, delta)
        for req in resolved.requests:
            judge.request(req)
        comps += judge.comparisons
        failures += judge.failures
        unjudged = [r for r in judge.rows if "unmeasured" in r]
        verdict = "FAIL" if judge.failures else ("UNMEASURED" if unjudged else "PASS")
        rows.append({"scenario": sc.name, "verdict": verdict, "requests": judge.rows, "log": result_to_json(result),
                     **({"reason": unjudged[0]["unmeasured"]} if verdict == "UNMEASURED" else {}),
                     **({"failure": judge.failures[0]} if judge.failures else {})})
    details = {"near_tie": SERVE_NEAR_TIE | {"value": delta}, "scenarios": rows}
    bounds = f"cosine >= {tol.min_cosine}, KLD <= {tol.max_kld} against each request alone; solo runs cosine >= {min_cosine} against the reference"
    if failures:
        return ProbeResult("serving", Verdict.FAIL, comps, reason=failures[0], bounds=bounds, details=details)
    unmeasured = [r for r in rows if r["verdict"] == "UNMEASURED"]
    if unmeasured:
        why = "; ".join(f"{r['scenario']}: {r['reason']}" for r in unmeasured)
        return ProbeResult("serving", Verdict.UNMEASURED, comps, reason=f"{len(unmeasured)} of {len(rows)} scenarios not measured ({why})",
                           bounds=bounds, details=details)
    return ProbeResult("serving", Verdict.PASS, comps, bounds=bounds, details=details)
