"""The serving probe for a real llama-server under concurrent clients: each scenario served by
streamed requests in flight together (``harness.engines.http_traffic``), each request judged
against the same request sent alone to a freshly started server of the same build, and each solo
reply against the reference (docs/engine-protocol.md, "Traffic from concurrent clients").

Per scenario:

- a fresh server (``start(parallel)``) serves it, every request told where the scenario's prompts
  part as user message starts (``llama_server.message_delimiters``: where a hybrid model's slot can
  be checkpointed and restored, as a chat client's messages would mark it); the scenarios of ``expect.slot_reuse`` pin both
  requests to slot 0 (``id_slot``: llama-server picks slots by prompt similarity and LRU, so B
  would otherwise not land in A's slot). What ``expect`` asks must be seen in the replies, else
  UNMEASURED naming it: ``overlap`` B's first token before A's last; ``in_flight`` N requests
  streaming together, N capped at the server's slots; with one slot the overlap scenarios are
  UNMEASURED "serialized: one slot"; ``cache_hit`` a reply's ``timings.cache_n`` > 0;
  ``slot_reuse`` B's reported slot is A's, B sent after A ended.
- each request alone: a fresh server, the request's prompt (a continuation's whole history) with
  ``cache_prompt`` false.
- tokens compared step by step (``judge_greedy``); a divergence is excused only at a near-tie of the
  solo path (top-1 minus top-2 logprob < δ, ``SERVE_NEAR_TIE``), and then the rest is judged by
  sending the prompt plus the solo path's tokens as a new request to the serving server
  (``forced_by_restarts``); the request's row says so (``continued``).
- top-k rows of the same history (served vs alone, and each continuation's rows vs the solo rows they
  follow) by ``pair_kld``, held to the class's probe KLD within ``TOLERANCE_SPAN`` history positions.
- each solo reply against the reference's logits on the solo path: top-1 agreement outside
  near-ties per request, and the top-k tier's gates (the mean and p99 top-k KLD of ``topk_gate``)
  over every solo reply's positions pooled, as a top-k parity cell pools its prompts (a mean over
  one request's 8 positions is no measurement of the row's mean). Both at history positions below
  ``TOLERANCE_SPAN`` only: past it a correct server's drift from the reference grows with the
  history (the multi-turn scenario's third turn: top-1 differs from the reference at position 3,064,
  as the serving probe found for logits); those positions are reported (``positions_past_span``)
  and their tokens still judged against the solo run.
- a cache hit larger than the prompt shares with any request sent before it is a FAIL.

A fault (a server that dies, a truncated body, a non-JSON event, NaN logprobs) is ENGINE-ERROR,
one line; the scenarios judged before it keep their rows in ``details``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np

from harness.engines.base import Engine, checked_blocks
from harness.engines.http_traffic import Reply, Traffic, drive_scenario
from harness.engines.serving import ServeRequest, ServeScenario, common_prefix
from harness.errors import EngineError, NotComparable, Verdict
from harness.measure.continuation import forced_by_restarts, judge_greedy
from harness.measure.prompts import PromptTokens
from harness.measure.scenarios import Scenario
from harness.measure.topk import topk_position_metrics
from harness.measure.topk_pair import pair_kld
from harness.runs.probe_types import Comparison, ProbeResult, ProbeTolerance
from harness.runs.serving import SERVE_NEAR_TIE, TOLERANCE_SPAN

K = 20
"""``n_probs`` asked per token: the k of the top-k rows of thresholds.yaml."""
SERIALIZED = "serialized: one slot"
INTENT_TRIES = 3
"""A scenario whose ``expect`` did not show is served again on a fresh server, at most this many
times in all: with a tiny model a request of 8 tokens streams in milliseconds, and whether three
clients' streams overlap is then a race of the client's own scheduling."""


@dataclass(frozen=True)
class TopkGate:
    """The top-k tier's gates for the solo-vs-reference comparison: ``mean`` and ``p99`` top-k KLD
    (nats; thresholds.yaml ``topk`` row of the class, ``max_topk_kld_mean`` / ``_p99``)."""

    mean: float
    p99: float
    source: str = "thresholds.yaml topk"


def intent_missing_http(scenario: Scenario, traffic: Traffic, parallel: int, serialized: str = SERIALIZED,
                        cache_source: str = "timings.cache_n") -> str | None:
    """What of ``scenario.expect`` the replies do not show (module docstring; None: all of it).
    ``serialized``: the reason given when it needs requests side by side and the server has one
    slot (``parallel`` < 2); ``cache_source``: where the server says what it reused, named when no
    request reused anything."""
    ex, r = scenario.expect, traffic.replies
    needs_overlap = "overlap" in ex or int(ex.get("in_flight", 0)) > 1
    if needs_overlap and parallel < 2:
        return serialized
    if "overlap" in ex:
        a, b = ex["overlap"]
        if not traffic.overlap(a, b):
            return f"request {b!r}'s first token came after request {a!r}'s last: its prefill never ran beside {a!r}'s decode"
    if "slot_reuse" in ex:
        a, b = ex["slot_reuse"]
        if r[a].slot_seen < 0 or r[a].slot_seen != r[b].slot or r[b].t_sent < r[a].t_end:
            return f"request {b!r} (slot {r[b].slot}) did not reuse the slot request {a!r} (slot {r[a].slot_seen}) ended in"
    if "cache_hit" in ex and not any(r[q].cached for q in ex["cache_hit"]):
        return f"none of requests {', '.join(ex['cache_hit'])} reported prefix tokens reused from a cache ({cache_source})"
    if "in_flight" in ex:
        need = min(int(ex["in_flight"]), parallel)
        if traffic.most_in_flight() < need:
            return f"at most {traffic.most_in_flight()} requests streamed together; the scenario needs {need} (of {ex['in_flight']}, {parallel} slots)"
    return None


def _solo_request(req: Reply, n: int) -> ServeScenario:
    return ServeScenario("solo", [ServeRequest(req.id, list(req.prompt), n)])


class _HttpJudge:
    """Judges one served scenario (module docstring)."""

    def __init__(self, name: str, traffic: Traffic, srv: Any, start: Callable[[int], Any], parallel: int, n_vocab: int,
                 tol: ProbeTolerance, reference: Engine | None, gate: TopkGate | None, delta: float, timeout_s: float):
        self.name, self.traffic, self.srv, self.start, self.parallel = name, traffic, srv, start, parallel
        self.n_vocab, self.tol, self.reference, self.gate, self.delta, self.timeout_s = n_vocab, tol, reference, gate, delta, timeout_s
        self.comparisons: list[Comparison] = []
        self.failures: list[str] = []
        self.rows: list[dict[str, Any]] = []
        self.ref_klds: list[float] = []

    def solo(self, rep: Reply) -> Reply:
        """The request alone on a freshly started server (llama-server: ``cache_prompt`` false)."""
        with self.start(self.parallel) as srv:
            tr = srv.drive(_solo_request(rep, len(rep.tokens)), self.n_vocab, K, self.timeout_s, extra=dict(srv.SOLO_EXTRA))
        return tr.replies[rep.id]

    def _rows_kld(self, label: str, a: Reply, b: Reply, upto: int, a0: int, b0: int, pos0: int) -> float:
        """Pair KLD of rows ``a.top[a0 + i]`` vs ``b.top[b0 + i]`` for i < upto; FAILs past the
        class's KLD within ``TOLERANCE_SPAN``; returns the largest."""
        worst, first_bad = 0.0, None
        for i in range(upto):
            if a0 + i >= len(a.top) or b0 + i >= len(b.top):
                break
            kld = pair_kld(*a.top[a0 + i], *b.top[b0 + i])
            if kld != kld:  # no shared id: as far apart as top-k rows can be
                kld = float("inf")
            worst = max(worst, kld)
            if first_bad is None and pos0 + i < TOLERANCE_SPAN and kld > self.tol.max_kld:
                first_bad = i
        ok = first_bad is None
        self.comparisons.append(Comparison(label, upto, ok, None, worst, None, None if ok else pos0 + first_bad))
        if not ok:
            self.failures.append(f"scenario {self.name!r}, request {a.id!r}: top-{K} row at history position {pos0 + first_bad} leaves the "
                                 f"solo run (top-k KLD {worst:.3g} > probe KLD {self.tol.max_kld:g}); slot {a.slot_seen}, cached "
                                 f"prefix {a.cached}; in flight beside it: {self._beside(a)}")
        return worst

    def _beside(self, a: Reply) -> str:
        others = [r.id for r in self.traffic.replies.values() if r.id != a.id and r.t_sent < a.t_end and r.t_end > a.t_sent]
        return ", ".join(repr(o) for o in others) or "nothing else"

    def _reference(self, solo: Reply) -> dict[str, Any] | None:
        """Solo reply vs the reference's logits on the solo path (top-k tier gates)."""
        if self.reference is None or not solo.tokens or min(solo.tokens) < 0:
            return None  # a token known by its text only (several ids share it) cannot be fed to the reference
        path = list(solo.prompt) + solo.tokens[:-1]
        lo = len(solo.prompt) - 1
        top = solo.topk(K)
        kl, agree_bad, within, pos = [], [], [], 0
        for block in checked_blocks(self.reference.logits(path), len(path)):
            a, b = max(lo, pos), pos + len(block)
            if b > a:
                pm = topk_position_metrics(block[a - pos:], type(top)(top.ids[a - lo:b - lo], top.logprobs[a - lo:b - lo]))
                kl.extend(float(x) for x in pm["kld"])
                near = np.arange(a, b) < TOLERANCE_SPAN  # past it a correct server's own drift grows (TOLERANCE_SPAN)
                agree_bad.extend(int(a + j) for j in np.flatnonzero(~pm["argmax_agree"] & (pm["ref_margin"] >= self.delta) & near))
                within.extend(bool(x) for x in near)
            pos += len(block)
        arr = np.asarray(kl)
        self.ref_klds.extend(x for x, w in zip(kl, within) if w)
        ok = not agree_bad and bool(np.isfinite(arr).all())
        label = f"{self.name}/{solo.id}: solo reply vs reference (top-1 outside near-ties, finite top-{K} KLD)"
        self.comparisons.append(Comparison(label, len(arr), ok, None, float(np.nanmax(arr)), None, None if ok else (agree_bad or [lo])[0]))
        if not ok:
            self.failures.append(f"scenario {self.name!r}, request {solo.id!r}: the solo reply leaves the reference (top-1 differs at "
                                 f"history positions {agree_bad[:3]} with a reference margin >= {self.delta}, or a non-finite "
                                 "top-k KLD): the server is wrong alone; see harness parity")
        return {"kld_mean": float(np.nanmean(arr)), "kld_max": float(np.nanmax(arr)), "positions": len(arr),
                "positions_past_span": int(len(arr) - sum(within))}

    def request(self, rep: Reply) -> None:
        solo = self.solo(rep)
        n = len(solo.tokens)
        margins = solo.margins()
        continued: list[int] = []
        extra: list[float] = []
        base = len(rep.prompt) - 1

        def restart(i: int) -> list[int]:
            continued.append(i)
            cont = Reply(rep.id, list(rep.prompt) + solo.tokens[:i])
            tr = self.srv.drive(_solo_request(cont, n - i), self.n_vocab, K, self.timeout_s)
            got = tr.replies[rep.id]
            upto = next((j for j in range(len(got.tokens)) if i + j >= n or got.tokens[j] != solo.tokens[i + j]), len(got.tokens))
            extra.append(self._rows_kld(f"{self.name}/{rep.id}: rows continued at token {i} on the solo path", got, solo,
                                        min(upto + 1, len(got.tokens)), 0, i, base + i))
            return got.tokens

        judged = judge_greedy(solo.tokens, rep.tokens, lambda i: margins[i] if i < len(margins) else np.nan, self.delta,
                              lambda: forced_by_restarts(solo.tokens, rep.tokens, restart))
        parted = next((i for i in range(min(n, len(rep.tokens))) if rep.tokens[i] != solo.tokens[i]), min(n, len(rep.tokens)) - 1)
        worst = self._rows_kld(f"{self.name}/{rep.id}: top-{K} rows vs alone", rep, solo, parted + 1, 0, 0, base)
        if judged.hard is not None:
            d = judged.hard
            self.comparisons.append(Comparison(f"{self.name}/{rep.id}: tokens (token {d.index}: served {d.chosen}, solo {d.solo})",
                                               d.index + 1, False, None, None, None, d.index))
            self.failures.append(f"scenario {self.name!r}, request {rep.id!r}: token {d.index} served {d.chosen}, alone {d.solo} (solo "
                                 f"margin {d.margin:.4g} >= near-tie {self.delta}); slot {rep.slot_seen}, cached prefix {rep.cached}; "
                                 f"in flight beside it: {self._beside(rep)}")
        ref = self._reference(solo)
        self._cache_claim(rep)
        self.rows.append({"request": rep.id, "slot": rep.slot_seen, "slot_reported": rep.slot, "pinned": rep.pinned,
                          "cached": rep.cached, "aborted": rep.aborted, "tokens": len(rep.tokens), "solo_tokens": n,
                          "max_topk_kld_vs_alone": max([worst, *extra]), "near_ties": [d.to_dict() for d in judged.near_ties],
                          "continued": [f"prompt + solo tokens[:{i}] sent as a new request" for i in continued],
                          "solo_vs_reference": ref})

    def _cache_claim(self, rep: Reply) -> None:
        earlier = [q for q in self.traffic.replies.values() if q.id != rep.id and q.t_sent < rep.t_sent]
        shared = max((common_prefix(rep.prompt, q.prompt + q.tokens[:-1]) for q in earlier), default=0)
        if rep.cached > shared:
            self.comparisons.append(Comparison(f"{self.name}/{rep.id}: cache hit of {rep.cached} tokens, {shared} shared",
                                               rep.cached, False, None, None, None, shared))
            self.failures.append(f"scenario {self.name!r}, request {rep.id!r}: reused {rep.cached} cached prefix tokens, but its prompt "
                                 f"shares at most {shared} with any request sent before it")


def _traffic_row(traffic: Traffic) -> dict[str, Any]:
    return {"wall_s": round(traffic.wall_s, 4), "client_cpu_s": round(traffic.client_cpu_s, 4),
            "most_in_flight": traffic.most_in_flight(),
            "replies": [{"request": r.id, "slot": r.slot, "pinned": r.pinned, "cached": r.cached, "tokens": len(r.tokens),
                         "aborted": r.aborted, "t_sent": round(r.t_sent - traffic_t0(traffic), 4),
                         "t_first": None if r.t_first is None else round(r.t_first - traffic_t0(traffic), 4),
                         "t_end": round(r.t_end - traffic_t0(traffic), 4)} for r in traffic.replies.values()]}


def traffic_t0(traffic: Traffic) -> float:
    """The first request's send time (times in a receipt are relative to it)."""
    return min((r.t_sent for r in traffic.replies.values()), default=0.0)


def _serve_and_judge(sc: Scenario, resolved: ServeScenario, start: Callable[[int], Any], parallel: int, n_vocab: int,
                     tol: ProbeTolerance, reference: Engine | None, gate: TopkGate | None, delta: float, timeout_s: float,
                     details: dict[str, Any]) -> tuple[dict[str, Any] | None, _HttpJudge | None, Traffic]:
    """One scenario on a fresh server (``INTENT_TRIES`` tries while its intent did not show): the
    UNMEASURED row (judge None), or the judge of every request. Raises ``EngineError``."""
    pin = {rid: 0 for rid in sc.expect.get("slot_reuse", [])}
    for attempt in range(INTENT_TRIES):  # arrivals timed by real clients: a race may miss the overlap once
        with start(parallel) as srv:
            details.setdefault("features", srv.features())
            extra = srv.prepare([r.tokens for r in resolved.requests if r.continues is None])
            details.setdefault("message_delimiters", {})[sc.name] = len(extra.get("message_delimiters", []))
            traffic = srv.drive(resolved, n_vocab, K, timeout_s, pin=pin, extra=extra)
            serialized = srv.serialized(traffic)
            missing = intent_missing_http(sc, traffic, parallel, serialized, srv.cache_source())
            if missing is not None:
                if missing != serialized and attempt + 1 < INTENT_TRIES:
                    continue
                return ({"scenario": sc.name, "verdict": "UNMEASURED", "reason": missing, "tries": attempt + 1,
                         "traffic": _traffic_row(traffic)}, None, traffic)
            judge = _HttpJudge(sc.name, traffic, srv, start, parallel, n_vocab, tol, reference, gate, delta, timeout_s)
            for req in resolved.requests:
                judge.request(traffic.replies[req.id])
            if not srv.alive():
                raise EngineError(f"{srv.NAME} died during scenario {sc.name!r}: {srv.stderr_tail()}")
            return None, judge, traffic
    raise AssertionError("unreachable")


def _reference_tier(klds: list[float], gate: TopkGate | None, comps: list[Comparison], details: dict[str, Any]) -> list[str]:
    """The top-k tier over every solo reply's positions pooled (as a top-k parity cell pools its
    prompts): top-k KLD mean and p99 against ``gate``; the failure lines (none without a gate or
    positions)."""
    if gate is None or not klds:
        return []
    arr = np.asarray(klds)
    mean, p99 = float(np.nanmean(arr)), float(np.nanpercentile(arr, 99))
    ok = mean <= gate.mean and p99 <= gate.p99
    details["solo_vs_reference"] = {"positions": len(arr), "kld_mean": mean, "kld_p99": p99, "kld_max": float(np.nanmax(arr)),
                                    "gate_mean": gate.mean, "gate_p99": gate.p99, "source": gate.source}
    comps.append(Comparison(f"solo replies vs reference: top-{K} KLD mean {mean:.3g} <= {gate.mean:g}, p99 {p99:.3g} <= {gate.p99:g} "
                            f"({gate.source})", len(arr), ok, None, float(np.nanmax(arr)), None, None))
    return [] if ok else [f"the solo replies leave the reference by the top-k tier: top-{K} KLD mean {mean:.3g} (gate {gate.mean:g}), "
                          f"p99 {p99:.3g} (gate {gate.p99:g}) over {len(arr)} positions ({gate.source}): the server is wrong alone"]


def probe_llama_server(start: Callable[[int], Any], prompts: Sequence[PromptTokens], tol: ProbeTolerance,
                       scenarios: Sequence[Scenario], n_vocab: int, parallel: int = 4, reference: Engine | None = None,
                       topk_gate: TopkGate | None = None, context_length: int | None = None, delta: float | None = None,
                       timeout_s: float = 300.0, progress: Callable[[str], None] | None = None) -> ProbeResult:
    """Every scenario served by a real llama-server under concurrent clients and judged (module
    docstring). ``start(parallel)``: a context manager giving a started server with ``url`` and
    ``features()`` (``harness.engines.llama_server.LlamaServer``), fresh at each call; ``tol``: the
    class's probe tolerances (``max_kld`` bounds served vs alone); ``reference``: the engine
    whose logits judge each solo reply; ``topk_gate``: its gates. PASS only when every scenario
    PASSes; FAIL when one fails; ENGINE-ERROR (one line) on a fault, earlier scenarios' rows kept
    in ``details``; otherwise UNMEASURED naming each scenario not measured and why."""
    delta = SERVE_NEAR_TIE["value"] if delta is None else float(delta)
    comps: list[Comparison] = []
    rows: list[dict[str, Any]] = []
    failures: list[str] = []
    ref_klds: list[float] = []
    details: dict[str, Any] = {"near_tie": SERVE_NEAR_TIE | {"value": delta}, "parallel": parallel, "k": K, "scenarios": rows}
    bounds = f"top-{K} KLD <= {tol.max_kld:g} against each request alone; solo replies by the top-k tier against the reference"
    for sc in scenarios:
        if progress:
            progress(f"llama-server serving: {sc.name}")
        need = sc.history_tokens()
        if context_length and need > context_length:
            rows.append({"scenario": sc.name, "verdict": "UNMEASURED", "reason": f"needs {need} positions; context_length {context_length}"})
            continue
        resolved = sc.resolve(prompts)
        try:
            unmeasured, judge, traffic = _serve_and_judge(sc, resolved, start, parallel, n_vocab, tol, reference, topk_gate,
                                                          delta, timeout_s, details)
            if unmeasured is not None:
                rows.append(unmeasured)
        except NotComparable as e:  # a text server: the scenario's prompts are not text it can be sent
            rows.append({"scenario": sc.name, "verdict": "UNMEASURED", "reason": str(e).splitlines()[0]})
            continue
        except EngineError as e:
            line = str(e).splitlines()[0] if str(e) else "llama-server failed"
            rows.append({"scenario": sc.name, "verdict": "ENGINE-ERROR", "reason": line})
            return ProbeResult("serving", Verdict.ENGINE_ERROR, comps, reason=line, bounds=bounds, details=details)
        if judge is None:
            continue
        comps += judge.comparisons
        failures += judge.failures
        ref_klds += judge.ref_klds
        rows.append({"scenario": sc.name, "verdict": "FAIL" if judge.failures else "PASS", "requests": judge.rows,
                     "traffic": _traffic_row(traffic), **({"failure": judge.failures[0]} if judge.failures else {})})
    failures += _reference_tier(ref_klds, topk_gate, comps, details)
    if failures:
        return ProbeResult("serving", Verdict.FAIL, comps, reason=failures[0], bounds=bounds, details=details)
    unmeasured = [r for r in rows if r["verdict"] == "UNMEASURED"]
    if unmeasured:
        why = "; ".join(f"{r['scenario']}: {r['reason']}" for r in unmeasured)
        return ProbeResult("serving", Verdict.UNMEASURED, comps, reason=f"{len(unmeasured)} of {len(rows)} scenarios not measured ({why})",
                           bounds=bounds, details=details)
    return ProbeResult("serving", Verdict.PASS, comps, bounds=bounds, details=details)


def slot_history_check(start: Callable[[int], Any], request: ServeRequest, others: Sequence[ServeRequest], n_vocab: int,
                       timeout_s: float = 120.0) -> dict[str, Any]:
    """llama.cpp #29092 (a slot's recurrent state surviving into its next request): ``request``
    alone on slot 0 of a fresh server, then the ``others`` one after another on slot 0, then
    ``request`` again on slot 0. Returns the two replies' tokens, whether they agree, and the
    largest top-k KLD between their rows (``pair_kld``), with the slots the server reported."""
    with start(4) as srv:
        first = drive_scenario(srv.url, ServeScenario("alone", [request]), n_vocab, K, timeout_s, pin={request.id: 0}).replies[request.id]
        slots = []
        for o in others:
            slots.append(drive_scenario(srv.url, ServeScenario("other", [o]), n_vocab, K, timeout_s, pin={o.id: 0}).replies[o.id].slot)
        again = drive_scenario(srv.url, ServeScenario("again", [request]), n_vocab, K, timeout_s, pin={request.id: 0}).replies[request.id]
    klds = [pair_kld(*a, *b) for a, b in zip(first.top, again.top)]
    return {"tokens_alone": first.tokens, "tokens_after": again.tokens, "tokens_agree": first.tokens == again.tokens,
            "max_topk_kld": float(np.nanmax(klds)) if klds else None, "slots": [first.slot, *slots, again.slot],
            "cached_after": again.cached}
