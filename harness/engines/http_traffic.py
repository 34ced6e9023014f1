"""Real traffic to a llama-server: a serving scenario's requests sent by concurrent clients
(``httpx.AsyncClient``), each streamed, so arrivals are timed on what the server has streamed:
B is sent once A has streamed k tokens (docs/engine-protocol.md, "Traffic from concurrent
clients").

Each request is one ``POST /completion`` (llama.cpp ``tools/server`` README) with the token ids as
``prompt``, ``n_predict``, ``n_probs`` k, ``stream``, ``return_tokens``, ``cache_prompt``,
``temperature`` 0 and the neutral penalties (``http_engine.GREEDY_PARAMS``), and ``id_slot`` where
the caller pins a slot. Every streamed event (``data: {...}``) carries the generated token
(``tokens``) and its ``completion_probabilities[0].top_logprobs`` (``{id, logprob}``: the
distribution after the history before that token); the final one (``stop`` true) carries
``id_slot`` and ``timings.cache_n`` (prompt tokens reused from the slot's cache). A continuation
(``continues``) is sent as the continued request's whole history followed by its new turn: the
server's cache is what should make it cheap. ``abort_after`` k: the client closes the stream after
k tokens (llama-server cancels the task on disconnect).

Bounds: at most ``MAX_REQUESTS`` requests a scenario, ``timeout_s`` for the whole scenario,
loopback URLs only; memory holds the requests in flight (k entries per generated token).

Faults, each ``EngineError`` (exit 3), one line naming the request: the connection refused or
broken (a server that dies mid-scenario), an HTTP error status, a stream that ends before its final
event (a 200 with a truncated body), an event that is not JSON, a logprob that is NaN, null or > 0,
a token outside the vocabulary, more tokens than asked, fewer tokens streamed than the server says it
decoded (``tokens_predicted``: a token it withheld as a cut UTF-8 character, never streamed).
"""

from __future__ import annotations

import asyncio
import json
import math
import re
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping
from urllib.parse import urlsplit

import numpy as np

from harness.display import plain
from harness.engines.base import TopK
from harness.engines.serving import ServeRequest, ServeScenario
from harness.errors import EngineError, InvalidInput

MAX_REQUESTS = 64
"""Requests one scenario may send (the shipped ones send at most 10)."""
LOOPBACK = ("127.0.0.1", "localhost", "::1")


@dataclass
class Reply:
    """One request as the server answered it. ``prompt``: the ids sent (a continuation's whole
    history); ``tokens``: generated ids; ``top``: per generated token, ``(ids [k], logprobs [k])``
    of the distribution that chose it; ``slot``: ``id_slot`` (-1 unknown); ``cached``:
    ``timings.cache_n``; times in seconds of ``time.monotonic``: sent, first token, end. A text
    server's reply (``TextRun``) also has ``text`` (the prompt text sent), ``out_text`` (the text
    it generated), ``log_mark`` (the server log's size when its first token arrived) and
    ``chosen_lp`` (each generated token's own logprob, ``token_logprobs``)."""

    id: str
    prompt: list[int]
    tokens: list[int] = field(default_factory=list)
    top: list[tuple[list[int], list[float]]] = field(default_factory=list)
    slot: int = -1
    cached: int = 0
    aborted: bool = False
    t_sent: float = 0.0
    t_first: float | None = None
    t_end: float = 0.0
    pinned: int | None = None
    text: str | None = None
    out_text: str = ""
    log_mark: int | None = None
    chosen_lp: list[float] = field(default_factory=list)

    def topk(self, k: int) -> TopK:
        """The rows as a ``TopK`` ``[len(tokens), k]`` (row i: the distribution that chose token i)."""
        ids = np.full((len(self.top), k), -1, np.int64)
        lps = np.full((len(self.top), k), np.nan)
        for i, (a, b) in enumerate(self.top):
            ids[i, : len(a[:k])], lps[i, : len(b[:k])] = a[:k], b[:k]
        return TopK(ids, lps)

    @property
    def slot_seen(self) -> int:
        """The slot it ran in: the server's ``id_slot``, else the slot it was pinned to (an aborted
        stream ends before the event that reports it), else -1."""
        return self.slot if self.slot >= 0 else (self.pinned if self.pinned is not None else -1)

    def margins(self) -> np.ndarray:
        """Top-1 minus top-2 logprob of each row (= the logit margin), NaN where fewer than 2."""
        return np.array([(b[0] - b[1]) if len(b) > 1 else math.nan for _, b in self.top])


@dataclass
class Traffic:
    """A scenario as served: ``replies`` by request id, ``wall_s`` its wall time, ``client_cpu_s``
    the harness process's CPU time over it (its share of the cost)."""

    replies: dict[str, Reply]
    wall_s: float
    client_cpu_s: float

    def overlap(self, a: str, b: str) -> bool:
        """B streamed its first token before A streamed its last: B's prefill ran while A decoded."""
        ra, rb = self.replies[a], self.replies[b]
        return rb.t_first is not None and rb.t_first < ra.t_end and rb.t_sent < ra.t_end

    def most_in_flight(self) -> int:
        """The most requests streaming together: overlapping ``[t_first, t_end]`` intervals."""
        ev = sorted([(r.t_first, 1) for r in self.replies.values() if r.t_first is not None]
                    + [(r.t_end, -1) for r in self.replies.values() if r.t_first is not None])
        most = cur = 0
        for _, d in ev:
            cur += d
            most = max(most, cur)
        return most


def check_loopback(url: str) -> None:
    """``InvalidInput`` unless ``url`` is http:// on a loopback host (traffic never leaves it)."""
    u = urlsplit(url)
    if u.scheme != "http" or u.hostname not in LOOPBACK:
        raise InvalidInput(f"traffic goes to loopback servers only, not {plain(url)[:80]!r}")


def _lp(x: Any, who: str) -> float:
    if isinstance(x, bool) or not isinstance(x, (int, float)) or math.isnan(x) or x > 1e-6:
        raise EngineError(f"{who}: logprob {plain(str(x))[:40]} is not a log probability (NaN, null or > 0)")
    return float(x)


def _parse_event(line: str, who: str) -> dict[str, Any] | None:
    """One SSE line → its JSON object (None: not a data line). ``EngineError`` for a data line that
    is not a JSON object."""
    if not line.startswith("data:"):
        return None
    payload = line[5:].strip()
    if payload == "[DONE]":
        return None
    try:
        obj = json.loads(payload, parse_constant=lambda c: math.nan)
    except (ValueError, RecursionError):
        raise EngineError(f"{who} streamed an event that is not JSON: {plain(payload[:60])!r}") from None
    if not isinstance(obj, dict):
        raise EngineError(f"{who} streamed an event that is not a JSON object")
    if "error" in obj:
        raise EngineError(f"{who} streamed an error: {plain(str(obj['error']))[:160]}")
    return obj


class _Run:
    """One scenario's clients (module docstring): llama-server's ``/completion`` with token ids."""

    PATH = "/completion"
    SERVER = "llama-server"

    def __init__(self, url: str, scenario: ServeScenario, n_vocab: int, k: int, pin: Mapping[str, int], extra: Mapping[str, Any]):
        self.url, self.scenario, self.n_vocab, self.k = url.rstrip("/"), scenario, n_vocab, k
        self.pin, self.extra = dict(pin), dict(extra)
        self.replies: dict[str, Reply] = {}
        self.progress: dict[str, asyncio.Condition] = {r.id: asyncio.Condition() for r in scenario.requests}
        self.done: dict[str, asyncio.Event] = {r.id: asyncio.Event() for r in scenario.requests}

    async def _wait_arrival(self, req: ServeRequest) -> None:
        after = req.arrival.after
        if after is not None:
            emits = next(r for r in self.scenario.requests if r.id == after)
            total = min(emits.n_tokens, emits.abort_after or emits.n_tokens)
            if req.arrival.tokens >= total:
                await self.done[after].wait()
            else:
                cond = self.progress[after]
                async with cond:
                    await cond.wait_for(lambda: self.done[after].is_set()
                                        or len(self.replies.get(after, Reply(after, [])).tokens) >= req.arrival.tokens)
        if req.continues is not None:
            await self.done[req.continues].wait()

    def _body(self, req: ServeRequest, rep: Reply) -> dict[str, Any]:
        from harness.engines.http_engine import GREEDY_PARAMS

        prompt, slot = rep.prompt, rep.pinned
        body = {"prompt": prompt, "n_predict": req.n_tokens, "n_probs": self.k, "stream": True, "return_tokens": True,
                "cache_prompt": True, "temperature": 0, "post_sampling_probs": False, **GREEDY_PARAMS["llama-server"], **self.extra}
        if slot is not None:
            body["id_slot"] = slot
        return body

    def _reply(self, req: ServeRequest) -> Reply:
        """The reply a request starts as: its whole prompt (a continuation's history in front)."""
        prompt = list(req.tokens)
        if req.continues is not None:
            prev = self.replies[req.continues]
            prompt = prev.prompt + prev.tokens + prompt
        return Reply(req.id, prompt, t_sent=time.monotonic(), pinned=self.pin.get(req.id))

    async def one(self, client: Any, req: ServeRequest) -> None:
        await self._wait_arrival(req)
        rep = self._reply(req)
        who = f"{self.SERVER} at {self.url}, scenario {self.scenario.name!r}, request {req.id!r}"
        self.replies[req.id] = rep
        final = False
        try:
            async with client.stream("POST", self.url + self.PATH, json=self._body(req, rep)) as resp:
                if resp.status_code >= 400:
                    head = (await resp.aread())[:200].decode("utf-8", "replace")
                    raise EngineError(f"{who} answered HTTP {resp.status_code}: {plain(head)}")
                async for line in resp.aiter_lines():
                    ev = _parse_event(line, who)
                    if ev is None:
                        continue
                    final = await self._event(rep, ev, req, who)
                    if final or (req.abort_after is not None and len(rep.tokens) >= req.abort_after):
                        break
        except EngineError:
            raise
        except Exception as e:  # httpx transport errors: refused, reset, cut short
            raise EngineError(f"{who}: the connection failed ({type(e).__name__}: {plain(str(e))[:120]}); the server "
                              "died mid-scenario or cut the body short") from None
        rep.t_end = rep.t_end or time.monotonic()  # a text run takes it at its final event
        if req.abort_after is not None and len(rep.tokens) >= req.abort_after and not final:
            rep.aborted = True
        elif not final:
            raise EngineError(f"{who}: the stream ended after {len(rep.tokens)} tokens without its final event "
                              "(a truncated body, or the server died)")
        self.done[req.id].set()
        async with self.progress[req.id]:
            self.progress[req.id].notify_all()

    async def _event(self, rep: Reply, ev: dict[str, Any], req: ServeRequest, who: str) -> bool:
        toks = ev.get("tokens") or []
        probs = ev.get("completion_probabilities") or []
        if not isinstance(toks, list) or not isinstance(probs, list):
            raise EngineError(f"{who} streamed an event without a token list")
        if toks and len(probs) != len(toks):
            raise EngineError(f"{who} streamed {len(toks)} tokens with {len(probs)} completion_probabilities (missing logprobs)")
        for t, p in zip(toks, probs):
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < self.n_vocab:
                raise EngineError(f"{who} streamed token {plain(str(t))[:20]} outside the vocabulary (0..{self.n_vocab - 1})")
            tops = p.get("top_logprobs") if isinstance(p, dict) else None
            if not isinstance(tops, list) or not tops:
                raise EngineError(f"{who} streamed a token without top_logprobs (missing logprobs)")
            ids = [int(e.get("id", -1)) if isinstance(e, dict) else -1 for e in tops]
            lps = [_lp(e.get("logprob") if isinstance(e, dict) else None, who) for e in tops]
            rep.tokens.append(t)
            rep.top.append((ids, lps))
            if rep.t_first is None:
                rep.t_first = time.monotonic()
        if len(rep.tokens) > req.n_tokens:
            raise EngineError(f"{who} streamed {len(rep.tokens)} tokens, more than the {req.n_tokens} asked")
        decoded = ev.get("tokens_predicted")
        if toks and isinstance(decoded, int) and not isinstance(decoded, bool) and decoded > len(rep.tokens):
            raise EngineError(f"{who} decoded {decoded} tokens but streamed {len(rep.tokens)}: it withholds a generated token whose "
                              "text ends in a cut UTF-8 character and never streams it (server-context.cpp process_token), so the "
                              f"reply misses the token after its generated position {len(rep.tokens) - 1} and its row")
        if toks:
            async with self.progress[req.id]:
                self.progress[req.id].notify_all()
        if ev.get("stop"):
            slot = ev.get("id_slot")
            rep.slot = int(slot) if isinstance(slot, int) and not isinstance(slot, bool) else -1
            cache_n = (ev.get("timings") or {}).get("cache_n", 0) if isinstance(ev.get("timings"), dict) else 0
            rep.cached = int(cache_n) if isinstance(cache_n, int) and not isinstance(cache_n, bool) and cache_n > 0 else 0
            return True
        return False


class TextRun(_Run):
    """One scenario's clients of llama-cpp-python's server (``python -m llama_cpp.server``): its
    OpenAI ``POST /v1/completions``, which takes text, not ids (``prompt: str``,
    ``llama_cpp/server/types.py``), so each request sends ``to_text(ids)`` (a continuation: the
    history's text, the text the server generated, the new turn's text), streamed with
    ``logprobs`` k, ``max_tokens``, ``temperature`` 0 and the neutral penalties. Each event carries
    one token as text (``logprobs.tokens``) and its ``top_logprobs`` keyed by text
    (``llama_cpp/llama.py`` ``_create_completion``); ``key_id`` maps a text to its id (None: a text
    several ids share; such entries leave the row, their mass in the tail, and a generated token
    that is one is -1). The last event has a ``finish_reason``. The server has one model context
    and no slots: every reply's slot is 0. ``mark()``: the server log's size, taken at each first
    token (``Reply.log_mark``; ``drive_text_scenario`` reads the prefix reuse from it)."""

    PATH = "/v1/completions"
    SERVER = "llama-cpp-python's server"

    def __init__(self, url: str, scenario: ServeScenario, n_vocab: int, k: int, model: str, to_text: Callable[[list[int]], str],
                 key_id: Callable[[Any], int | None], mark: Callable[[], int], extra: Mapping[str, Any]):
        super().__init__(url, scenario, n_vocab, k, {}, extra)
        self.model, self.to_text, self.key_id, self.mark = model, to_text, key_id, mark

    def _reply(self, req: ServeRequest) -> Reply:
        from harness.errors import NotComparable

        try:
            text = self.to_text(list(req.tokens))
        except NotComparable as e:
            raise NotComparable(f"scenario {self.scenario.name!r}, request {req.id!r}: {e}") from None
        if req.continues is not None:
            prev = self.replies[req.continues]
            text = (prev.text or "") + prev.out_text + text
        return Reply(req.id, [], slot=0, t_sent=time.monotonic(), text=text)

    def _body(self, req: ServeRequest, rep: Reply) -> dict[str, Any]:
        from harness.engines.http_engine import GREEDY_PARAMS

        return {"model": self.model, "prompt": rep.text, "max_tokens": req.n_tokens, "logprobs": self.k, "stream": True,
                "temperature": 0, **GREEDY_PARAMS["llama-cpp-python"], **self.extra}

    def _row(self, top: Any, who: str) -> tuple[list[int], list[float]]:
        if not isinstance(top, dict) or not top:
            raise EngineError(f"{who} streamed a token without top_logprobs (missing logprobs)")
        pairs = sorted(((_lp(v, who), i) for t, v in top.items() if (i := self.key_id(t)) is not None), key=lambda p: (-p[0], p[1]))
        return [i for _, i in pairs[: self.k]], [lp for lp, _ in pairs[: self.k]]

    async def _event(self, rep: Reply, ev: dict[str, Any], req: ServeRequest, who: str) -> bool:
        choices = ev.get("choices")
        if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
            raise EngineError(f"{who} streamed an event without choices")
        c = choices[0]
        lp = c.get("logprobs")
        if lp is None and c.get("text") and c.get("finish_reason") is None:
            raise EngineError(f"{who} streamed a token without logprobs (missing logprobs)")
        toks, tops = (lp.get("tokens"), lp.get("top_logprobs")) if isinstance(lp, dict) else ([], [])
        if not isinstance(toks, list) or not isinstance(tops, list) or len(toks) != len(tops):
            raise EngineError(f"{who} streamed an event whose logprobs.tokens and top_logprobs do not line up")
        chosen = lp.get("token_logprobs") if isinstance(lp, dict) else []
        if not isinstance(chosen, list) or len(chosen) != len(toks):
            raise EngineError(f"{who} streamed an event whose logprobs.token_logprobs do not line up with its tokens")
        for t, top, c_lp in zip(toks, tops, chosen):
            tid = self.key_id(t)
            rep.tokens.append(-1 if tid is None else int(tid))
            rep.top.append(self._row(top, who))
            rep.chosen_lp.append(_lp(c_lp, who))
            if rep.t_first is None:
                rep.t_first, rep.log_mark = time.monotonic(), self.mark()
        rep.out_text += c.get("text") if isinstance(c.get("text"), str) else ""
        if len(rep.tokens) > req.n_tokens:
            raise EngineError(f"{who} streamed {len(rep.tokens)} tokens, more than the {req.n_tokens} asked")
        if toks:
            async with self.progress[req.id]:
                self.progress[req.id].notify_all()
        if c.get("finish_reason") is not None:
            rep.t_end = time.monotonic()  # served: the stream's closing handshake is no part of it
            return True
        return False


PREFIX_HIT = re.compile(r"Llama\.generate: (\d+) prefix-match hit")
"""The line ``llama_cpp/llama.py`` ``Llama.generate`` prints (verbose) when it keeps that many
tokens of its context for the next prompt; a hybrid model's partial prefix prints "prefix-match
found but partial kv removal not supported, re-evaluating full prompt" instead."""


def drive_text_scenario(url: str, scenario: ServeScenario, n_vocab: int, k: int, model: str, to_text: Callable[[list[int]], str],
                        key_id: Callable[[Any], int | None], tokenize: Callable[[str], list[int]], log: Callable[[], str],
                        timeout_s: float = 300.0) -> Traffic:
    """Serve ``scenario`` by concurrent streamed requests to llama-cpp-python's server at ``url``
    (``TextRun``); afterwards each reply's ``prompt`` is the server's own tokenization of the text
    it was sent (``tokenize``, asked once the traffic is over: the server answers one request at a
    time) and ``cached`` the prefix its ``Llama.generate`` kept for it (``PREFIX_HIT`` in ``log()``
    between the first token before it and its own; requests are served one at a time). A generated
    token known only by a text several ids share (-1) takes its id from the server's tokenization
    of the prompt and generated text, where that lines up with every token known, and goes back
    into its row with its own logprob (the row lost it with its text). Raises as
    ``drive_scenario``."""
    check_loopback(url)
    if len(scenario.requests) > MAX_REQUESTS:
        raise InvalidInput(f"scenario {scenario.name!r} has {len(scenario.requests)} requests, more than {MAX_REQUESTS}")
    start = len(log().encode("utf-8", "surrogateescape"))
    run = TextRun(url, scenario, n_vocab, k, model, to_text, key_id, lambda: len(log().encode("utf-8", "surrogateescape")), {})
    t0, c0 = time.monotonic(), time.process_time()
    asyncio.run(_drive(run, timeout_s))
    traffic = Traffic(run.replies, time.monotonic() - t0, time.process_time() - c0)
    text = log().encode("utf-8", "surrogateescape")
    prev = start
    for rep in sorted((r for r in run.replies.values() if r.log_mark is not None), key=lambda r: r.t_first or 0.0):
        hits = PREFIX_HIT.findall(text[prev:rep.log_mark].decode("utf-8", "replace"))
        rep.cached, prev = (int(hits[-1]) if hits else 0), rep.log_mark or prev
    for rep in run.replies.values():
        rep.prompt = tokenize(rep.text or "")
        if min(rep.tokens, default=0) < 0:  # a text several ids share: the ids of the generated text, if they line up
            full = tokenize((rep.text or "") + rep.out_text)
            ids = full[len(rep.prompt):]
            if full[:len(rep.prompt)] == rep.prompt and len(ids) == len(rep.tokens) and all(a in (b, -1) for a, b in zip(rep.tokens, ids)):
                for i, (a, b) in enumerate(zip(rep.tokens, ids)):
                    if a < 0 and b not in rep.top[i][0]:  # its row lost it with its text: put it back with its own logprob
                        pairs = sorted([*zip(rep.top[i][1], rep.top[i][0]), (rep.chosen_lp[i], b)], key=lambda p: (-p[0], p[1]))[:k]
                        rep.top[i] = ([p[1] for p in pairs], [p[0] for p in pairs])
                rep.tokens = ids
    return traffic


async def _drive(run: _Run, timeout_s: float) -> None:
    import httpx

    limits = httpx.Limits(max_connections=len(run.scenario.requests) + 1)
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout_s), limits=limits, trust_env=False) as client:
        tasks = [asyncio.create_task(run.one(client, r)) for r in run.scenario.requests]
        try:
            done, pending = await asyncio.wait(tasks, timeout=timeout_s, return_when=asyncio.FIRST_EXCEPTION)
            for t in done:
                if t.exception() is not None:
                    raise t.exception()  # type: ignore[misc]
            if pending:
                raise EngineError(f"{run.SERVER} at {run.url}, scenario {run.scenario.name!r}: not served within {timeout_s:g} s "
                                  f"({len(pending)} of {len(tasks)} requests unfinished)")
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)


def drive_scenario(url: str, scenario: ServeScenario, n_vocab: int, k: int = 10, timeout_s: float = 300.0,
                   pin: Mapping[str, int] | None = None, extra: Mapping[str, Any] | None = None) -> Traffic:
    """Serve ``scenario`` by concurrent streamed requests to the llama-server at ``url`` (module
    docstring). ``k``: ``n_probs``; ``pin``: request id → the slot it is sent to (``id_slot``); ``extra``: more body fields (e.g. ``cache_prompt`` false).
    Raises ``InvalidInput`` (not loopback, more than ``MAX_REQUESTS``) and ``EngineError``."""
    check_loopback(url)
    if len(scenario.requests) > MAX_REQUESTS:
        raise InvalidInput(f"scenario {scenario.name!r} has {len(scenario.requests)} requests, more than {MAX_REQUESTS}")
    run = _Run(url, scenario, n_vocab, k, pin or {}, extra or {})
    t0, c0 = time.monotonic(), time.process_time()
    asyncio.run(_drive(run, timeout_s))
    return Traffic(run.replies, time.monotonic() - t0, time.process_time() - c0)
