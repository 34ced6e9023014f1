"""Serving: one scenario of requests run through an engine's own scheduler (capability ``serve``).

An engine that serves traffic decides itself which requests share a step, which slot (state
slot, KV cell range, sequence id) each gets, what its prefix cache restores and when a slot is
reused. The bugs that live there (a GDN state that survives a reused slot, llama.cpp #29092; a
prefix hit keyed on a chat header, kekzl/imp PR #1463; a sequence joining a running batch that
gets another's state, mlx-lm PR #1169) never show in a request served alone. ``Engine.serve``
takes a whole scenario (``ServeScenario``: requests with their arrivals) and answers per request
its tokens, its logits rows and, for every step, which requests it ran with how many tokens fed,
in which slot (``ServeResult``); ``check_serve_result`` refuses a reply that does not say what
happened (docs/engine-protocol.md, "Op serve").

Positions: a request's *history* is its prompt (for a continuation: the history it continues,
that request's generated tokens and the new turn) followed by its generated tokens. Row ``p`` of
its logits is the next-token distribution after ``history[:p+1]``; an engine gives the rows from
``logits_start`` (at most the prompt's last position, so every row that chose a token is there)
up to the last token it fed (the last generated token is never fed).
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from harness.errors import EngineError


@dataclass(frozen=True)
class Arrival:
    """When a request reaches the engine: not before the engine's step ``step``, and, with
    ``after``, only once request ``after`` has emitted ``tokens`` tokens (it may join at the next
    step at the earliest)."""

    step: int = 0
    after: str | None = None
    tokens: int = 0

    def to_json(self) -> dict[str, Any]:
        return {"step": self.step, "after": self.after, "tokens": self.tokens}


@dataclass
class ServeRequest:
    """One request of a scenario. ``tokens``: the prompt's ids (for a continuation, the new turn
    only: the engine puts the history of request ``continues`` in front of it itself, from its own
    cache or by feeding it); ``n_tokens``: greedy tokens to generate; ``abort_after``: the client
    cancels the request once it has emitted that many; ``force``: teacher forcing, the engine
    feeds these ids as its generated tokens (and still reports the logits it computed), which is
    how a comparison goes on past a near-tie on the solo path's tokens."""

    id: str
    tokens: list[int]
    n_tokens: int
    arrival: Arrival = field(default_factory=Arrival)
    abort_after: int | None = None
    continues: str | None = None
    force: list[int] | None = None
    draft_max: int | None = None
    """Speculative decoding (capability ``speculative``): the engine drafts up to this many tokens
    per step with its MTP head and verifies them in one batch; None: plain decoding."""

    def to_json(self) -> dict[str, Any]:
        return {"id": self.id, "tokens": list(self.tokens), "n_tokens": self.n_tokens, "arrival": self.arrival.to_json(),
                "abort_after": self.abort_after, "continues": self.continues, "force": self.force,
                **({"draft_max": self.draft_max} if self.draft_max is not None else {})}

    @property
    def emits(self) -> int:
        """Tokens the request emits: ``abort_after`` when it is aborted, else ``n_tokens``."""
        return self.n_tokens if self.abort_after is None else min(self.abort_after, self.n_tokens)


@dataclass
class ServeScenario:
    """A scenario resolved to token ids (``harness.measure.scenarios``): its ``name`` and its
    ``requests`` in the order the client sends them."""

    name: str
    requests: list[ServeRequest]

    def request(self, rid: str) -> ServeRequest:
        return next(r for r in self.requests if r.id == rid)

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "requests": [r.to_json() for r in self.requests]}


@dataclass(frozen=True)
class StepEntry:
    """What one request did in one step of the engine: its ``slot``, the tokens it ``fed`` (a
    prefill chunk, 1 for a decode, 1 + ``drafts`` for a verification batch) and the tokens it
    ``emitted`` (0 or 1 without speculation; ``accepted`` + 1 after a verification batch).
    ``drafts``: the drafts verified in this step; ``accepted``: how many of them were accepted (the
    ``drafts - accepted`` rejected ones are rolled back, so they are fed but not kept)."""

    request: str
    slot: int
    fed: int
    emitted: int
    drafts: int = 0
    accepted: int = 0

    @property
    def kept(self) -> int:
        """History positions this step added: ``fed`` less the rejected drafts."""
        return self.fed - (self.drafts - self.accepted)


@dataclass
class Step:
    """One step of the engine's scheduler (one batch evaluation): its ``index`` and ``entries``."""

    index: int
    entries: list[StepEntry]


RowReader = Callable[[int, int], np.ndarray]
"""``rows(start, stop)``: float32 ``[stop - start, V]``, rows ``start..stop-1`` counted from the
request's ``logits_start``."""


@dataclass
class ServedRequest:
    """One request as the engine served it: the ``prompt`` it ran (a continuation's whole
    history), the ``tokens`` it generated, its ``slot``, the prefix tokens it reused from a cache
    (``cached``), whether it was ``aborted``, and its logits rows from position ``logits_start``
    (None: the engine returned no logits) read through ``rows``."""

    id: str
    prompt: list[int]
    tokens: list[int]
    slot: int
    cached: int
    aborted: bool = False
    logits_start: int | None = None
    rows: RowReader | None = None

    @property
    def fed_end(self) -> int:
        """Positions fed in all: the prompt and every generated token but the last."""
        return len(self.prompt) + max(len(self.tokens) - 1, 0)

    def n_rows(self) -> int:
        return 0 if self.logits_start is None else self.fed_end - self.logits_start


@dataclass
class ServeResult:
    """An engine's answer to ``serve``: ``requests`` by id and the ``steps`` it ran, in order."""

    requests: dict[str, ServedRequest]
    steps: list[Step]

    def entries_of(self, rid: str) -> list[tuple[int, StepEntry]]:
        """``(step index, entry)`` of every step request ``rid`` took part in, in order."""
        return [(s.index, e) for s in self.steps for e in s.entries if e.request == rid]

    def emission_step(self, rid: str, k: int) -> int | None:
        """The step at which request ``rid`` emitted its ``k``-th token (1-based); None if never."""
        done = 0
        for idx, e in self.entries_of(rid):
            done += e.emitted
            if done >= k:
                return idx
        return None

    def step_of_position(self, rid: str, position: int) -> int | None:
        """The step in which request ``rid`` fed history position ``position`` (None: it was
        restored from a cache, or never fed)."""
        served = self.requests[rid]
        at = served.cached
        for idx, e in self.entries_of(rid):
            if at <= position < at + e.kept:
                return idx
            at += e.kept
        return None

    def in_flight(self, index: int, besides: str | None = None) -> list[StepEntry]:
        """The entries of step ``index`` other than request ``besides``'s."""
        step = next((s for s in self.steps if s.index == index), None)
        return [] if step is None else [e for e in step.entries if e.request != besides]


class RowSpill:
    """Logit rows of one request written to an anonymous temporary file as they are computed and
    read back by range, so a served request's ``[T, V]`` is never held in memory (at Qwen3.5's
    vocabulary a row is about 1 MB). ``append(rows)`` takes float32 ``[B, V]``; ``read(start,
    stop)`` is a ``RowReader``. Raises ``EngineError`` for a width that changes or a range past
    the rows written."""

    def __init__(self, directory: str | os.PathLike | None = None):
        self._file = tempfile.TemporaryFile(dir=directory)
        self.width: int | None = None
        self.count = 0

    def append(self, rows: np.ndarray) -> None:
        rows = np.ascontiguousarray(rows, dtype=np.float32)
        if rows.ndim != 2 or (self.width is not None and rows.shape[1] != self.width):
            raise EngineError(f"serving: logit rows of shape {rows.shape} after rows of width {self.width}")
        self.width = int(rows.shape[1])
        self._file.seek(0, os.SEEK_END)
        self._file.write(rows.tobytes())
        self.count += int(rows.shape[0])

    def read(self, start: int, stop: int) -> np.ndarray:
        if not 0 <= start <= stop <= self.count or self.width is None:
            raise EngineError(f"serving: rows {start}..{stop} asked of {self.count} rows written")
        self._file.seek(start * self.width * 4)
        data = np.fromfile(self._file, dtype=np.float32, count=(stop - start) * self.width)
        return data.reshape(stop - start, self.width)


def _is_int(x: Any) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


def expected_prompt(scenario: ServeScenario, result: ServeResult, req: ServeRequest) -> list[int]:
    """The history request ``req`` must run: its tokens, after (for a continuation) the served
    history of the request it continues (prompt and every generated token)."""
    if req.continues is None:
        return list(req.tokens)
    prev = result.requests[req.continues]
    return list(prev.prompt) + list(prev.tokens) + list(req.tokens)


def _check_request(req: ServeRequest, got: ServedRequest, want_prompt: list[int], n_vocab: int, who: str) -> None:
    """One served request against what was asked (see ``check_serve_result``)."""
    where = f"{who}: serve request {req.id!r}"
    if not all(_is_int(t) and 0 <= t < n_vocab for t in got.tokens):
        raise EngineError(f"{where} generated tokens outside the vocabulary [0, {n_vocab})")
    if len(got.tokens) > req.n_tokens or (req.abort_after is not None and len(got.tokens) != req.emits):
        raise EngineError(f"{where} generated {len(got.tokens)} tokens; it asked for {req.n_tokens}"
                          + (f" and was aborted after {req.abort_after}" if req.abort_after is not None else ""))
    if req.force is not None and list(got.tokens) != list(req.force[: len(got.tokens)]):
        raise EngineError(f"{where} was teacher-forced but generated other tokens than it was given")
    if list(got.prompt) != want_prompt:
        raise EngineError(f"{where} ran a prompt of {len(got.prompt)} tokens that is not the one asked "
                          f"({len(want_prompt)} tokens{', its history included' if req.continues else ''})")
    if not _is_int(got.slot) or got.slot < 0:
        raise EngineError(f"{where} has slot {str(got.slot)[:40]!r}, not a non-negative integer")
    if not _is_int(got.cached) or not 0 <= got.cached <= max(len(got.prompt) - 1, 0):
        raise EngineError(f"{where} reused {str(got.cached)[:40]!r} cached prefix tokens, not an integer in "
                          f"[0, {max(len(got.prompt) - 1, 0)}] (at least one prompt token must be fed)")
    if got.logits_start is not None and (not _is_int(got.logits_start) or not 0 <= got.logits_start <= len(got.prompt) - 1):
        raise EngineError(f"{where}: logits_start {str(got.logits_start)[:40]!r} must be an integer in [0, {len(got.prompt) - 1}] "
                          "(the rows that chose its tokens must be there)")


def _check_verify(scenario: ServeScenario, index: int, e: StepEntry, who: str) -> None:
    """A verification entry: drafts only for a request asked to speculate and at most its
    ``draft_max``, accepted at most drafts, fed 1 + drafts and emitted accepted + 1."""
    if not e.drafts and not e.accepted:
        return
    want = next((r.draft_max for r in scenario.requests if r.id == e.request), None)
    where = f"{who}: serve step {index}, request {e.request!r}"
    if want is None or e.drafts > want:
        raise EngineError(f"{where} verified {e.drafts} drafts; the request asked for " + ("no speculation" if want is None else f"at most {want}"))
    if e.accepted > e.drafts or e.fed != 1 + e.drafts or e.emitted != e.accepted + 1:
        raise EngineError(f"{where}: a verification batch of {e.drafts} drafts feeds 1 + drafts and emits accepted + 1 "
                          f"(fed {e.fed}, emitted {e.emitted}, accepted {e.accepted})")


def _check_steps(scenario: ServeScenario, result: ServeResult, who: str) -> None:
    """The step log: in order, known requests, integer slots and counts, one slot per request and
    no slot shared within a step, tokens fed and emitted adding up, arrivals honoured."""
    last = -1
    for s in result.steps:
        if not _is_int(s.index) or s.index <= last:
            raise EngineError(f"{who}: serve step log out of order (step {str(s.index)[:20]!r} after step {last})")
        last = int(s.index)
        slots: dict[int, str] = {}
        for e in s.entries:
            if e.request not in result.requests:
                raise EngineError(f"{who}: serve step {s.index} names request {str(e.request)[:40]!r}, which is not in the scenario")
            if not all(_is_int(x) and x >= 0 for x in (e.slot, e.fed, e.emitted, e.drafts, e.accepted)):
                raise EngineError(f"{who}: serve step {s.index}, request {e.request!r}: slot, fed, emitted, drafts and accepted must be "
                                  "non-negative integers")
            _check_verify(scenario, s.index, e, who)
            if e.slot != result.requests[e.request].slot:
                raise EngineError(f"{who}: serve step {s.index} runs request {e.request!r} in slot {e.slot}, "
                                  f"but the request reports slot {result.requests[e.request].slot}")
            if e.slot in slots:
                raise EngineError(f"{who}: serve step {s.index} runs requests {slots[e.slot]!r} and {e.request!r} in the same slot {e.slot}")
            slots[e.slot] = e.request
    for req in scenario.requests:
        got = result.requests[req.id]
        entries = result.entries_of(req.id)
        fed, emitted = sum(e.kept for _, e in entries), sum(e.emitted for _, e in entries)
        want_fed = len(got.prompt) - got.cached + max(len(got.tokens) - 1, 0)
        if fed != want_fed or emitted != len(got.tokens):
            raise EngineError(f"{who}: serve request {req.id!r}: its steps feed {fed} tokens and emit {emitted}; its prompt, cache "
                              f"hit and tokens say {want_fed} and {len(got.tokens)}")
        first = entries[0][0] if entries else None
        if first is not None and first < req.arrival.step:
            raise EngineError(f"{who}: serve request {req.id!r} ran at step {first}, before its arrival at step {req.arrival.step}")
        if first is not None and req.arrival.after is not None:
            at = result.emission_step(req.arrival.after, req.arrival.tokens)
            if at is None or first <= at:
                raise EngineError(f"{who}: serve request {req.id!r} ran at step {first}, before request {req.arrival.after!r} had "
                                  f"emitted {req.arrival.tokens} tokens" + (f" (step {at})" if at is not None else " (it never did)"))


def check_serve_result(scenario: ServeScenario, result: ServeResult, n_vocab: int, who: str) -> ServeResult:
    """``result`` checked against ``scenario``; returns it. Raises ``EngineError`` (one line
    naming ``who``) for a request missing or unknown, tokens outside ``[0, n_vocab)``, more tokens
    than asked (or another count for an aborted request), a forced request that generated others,
    a prompt that is not the one asked (a continuation's: the continued request's served history
    and the new turn), a slot or count that is not a non-negative integer, steps out of order, a
    slot shared by two requests in one step, tokens fed or emitted that do not add up, an arrival
    not honoured, or a logits block of the wrong size."""
    names = [r.id for r in scenario.requests]
    missing = [n for n in names if n not in result.requests]
    if missing:
        raise EngineError(f"{who}: serve reply has no request {missing[0]!r} (scenario {scenario.name!r})")
    extra = [n for n in result.requests if n not in names]
    if extra:
        raise EngineError(f"{who}: serve reply has request {str(extra[0])[:40]!r}, which is not in scenario {scenario.name!r}")
    for req in scenario.requests:
        _check_request(req, result.requests[req.id], expected_prompt(scenario, result, req), n_vocab, who)
    _check_steps(scenario, result, who)
    return result


def parse_serve_reply(doc: Any, scenario: ServeScenario, rows_of: Callable[[int, int], RowReader] | None, who: str) -> ServeResult:
    """A ``serve.json`` document (docs/engine-protocol.md, "Op serve") as a ``ServeResult``;
    ``rows_of(first_row, n_rows)`` gives the reader of a request's rows in ``serve_logits.npy``
    (None: no logits file). Only shapes are checked here; ``check_serve_result`` checks the
    content. Raises ``EngineError`` for a document of the wrong shape."""
    if not isinstance(doc, Mapping) or not isinstance(doc.get("requests"), list) or not isinstance(doc.get("steps"), list):
        raise EngineError(f"{who}: serve.json must be an object with lists 'requests' and 'steps'")
    out: dict[str, ServedRequest] = {}
    for r in doc["requests"]:
        if not isinstance(r, Mapping) or not isinstance(r.get("id"), str):
            raise EngineError(f"{who}: serve.json request entries must be objects with a string 'id'")
        prompt, toks = r.get("prompt"), r.get("tokens")
        if not isinstance(prompt, list) or not isinstance(toks, list) or not all(_is_int(t) for t in prompt + toks):
            raise EngineError(f"{who}: serve.json request {r['id'][:40]!r}: 'prompt' and 'tokens' must be lists of token ids")
        logits = r.get("logits")
        start, reader = None, None
        if logits is not None:
            if not isinstance(logits, Mapping) or not all(_is_int(logits.get(k)) for k in ("start", "row", "rows")) or rows_of is None:
                raise EngineError(f"{who}: serve.json request {r['id'][:40]!r}: 'logits' must be {{start, row, rows}} integers "
                                  "with serve_logits.npy written")
            start, reader = int(logits["start"]), rows_of(int(logits["row"]), int(logits["rows"]))
        out[r["id"]] = ServedRequest(r["id"], [int(t) for t in prompt], [int(t) for t in toks], r.get("slot"), r.get("cached", 0),
                                     bool(r.get("aborted", False)), start, reader)
        if logits is not None and int(logits["rows"]) != out[r["id"]].n_rows():
            raise EngineError(f"{who}: serve.json request {r['id'][:40]!r} has {logits['rows']} logit rows; from position {start} "
                              f"to its last fed token it needs {out[r['id']].n_rows()}")
    steps = []
    for s in doc["steps"]:
        if not isinstance(s, Mapping) or not isinstance(s.get("entries"), list) or not all(isinstance(e, Mapping) for e in s["entries"]):
            raise EngineError(f"{who}: serve.json steps must be objects with an 'index' and a list of 'entries'")
        steps.append(Step(s.get("index"), [StepEntry(e.get("request"), e.get("slot"), e.get("fed"), e.get("emitted", 0),
                                                     e.get("drafts", 0), e.get("accepted", 0)) for e in s["entries"]]))
    return ServeResult(out, steps)


def result_to_json(result: ServeResult) -> dict[str, Any]:
    """The step log and per-request summary of ``result`` (no logits) as JSON: what a probe
    receipt records of a served scenario. A step entry is ``[request, slot, fed, emitted]``, and
    for a verification batch also ``drafts, accepted``."""
    return {
        "requests": [{"id": r.id, "slot": r.slot, "cached": r.cached, "aborted": r.aborted, "prompt_tokens": len(r.prompt),
                      "tokens": list(r.tokens), "logits_start": r.logits_start} for r in result.requests.values()],
        "steps": [{"index": s.index, "entries": [[e.request, e.slot, e.fed, e.emitted] + ([e.drafts, e.accepted] if e.drafts else [])
                                                 for e in s.entries]} for s in result.steps],
    }


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two token id sequences."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i
