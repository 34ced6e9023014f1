"""The oracle as a serving engine: slots, continuous batching, a prefix cache with recurrent-state
checkpoints on a block grid, abort and multi-turn continuation (capability ``serve``).

The correct baseline of the serving probe (``harness.runs.serving``). Its scheduler does what a
server does, and its numbers stay the oracle's:

- **slots**: ``n_slots`` state slots; an admitted request takes the lowest free one and frees it
  when it finishes or is aborted, so a later request reuses it (llama-server ``-np``).
- **continuous batching**: every step decodes one token of each running request and feeds a
  prefill chunk of each arriving one (at most ``prefill_chunk`` tokens, cut at the block grid),
  so a request that arrives while others decode shares their steps (vLLM's chunked prefill).
- **prefix cache**: after a chunk that ends on the grid (every ``cache_block`` tokens of the
  history) the request's whole state (KV, conv and recurrent state of every layer) is kept under
  the tokens it follows, and so is the state a finished request ends with; an arriving request
  restores the longest one whose tokens begin its prompt (leaving at least one prompt token to
  feed) and feeds only the rest. A recurrent state cannot be cut back like a KV cache, so only
  states kept at those positions can be restored (llama.cpp's checkpoints of recurrent models,
  SGLang's mamba radix cache).
- **abort**: a request with ``abort_after`` is cancelled once it has emitted that many tokens;
  its slot is freed and its state is not kept.
- **continuation**: a request that continues another runs that request's history (prompt and
  generated tokens) and its new turn; the history comes from the cache like any prefix.

Each request's state is an ``OracleSession``; requests share a step in the schedule, while their
arithmetic is the oracle's alone per sequence, which is why a served request must equal its solo
run. A serving mutant (``harness.engines.mutants``, ``SERVING_MUTANTS``) changes one rule of the
state handling through ``faults``; nothing else.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

import numpy as np

from harness.engines.serving import (
    RowSpill,
    ServedRequest,
    ServeRequest,
    ServeResult,
    ServeScenario,
    Step,
    StepEntry,
    common_prefix,
)
from harness.errors import EngineError

N_SLOTS = 8
"""State slots of the serving oracle (more than any shipped scenario keeps in flight)."""
PREFILL_CHUNK = 64
"""Most prompt tokens one request feeds in one step."""
CACHE_BLOCK = 64
"""The prefix cache's block grid: states are kept at multiples of this many history tokens."""
CACHE_ENTRIES = 256
"""States the prefix cache keeps; the oldest is dropped first."""
HEADER_TOKENS = 48
"""The header length a serving mutant keys its prefix cache on (``header_key`` fault)."""


@dataclass
class _Run:
    """A request in a slot: its history so far, its session, tokens emitted, rows spilled."""

    req: ServeRequest
    slot: int
    prompt: list[int]
    session: Any
    cached: int
    pos: int
    spill: RowSpill
    tokens: list[int] = field(default_factory=list)
    prefilled: Any = None
    """The session as it was when the prompt was fed (before any decode): the ``turn_dropped`` fault."""

    @property
    def done(self) -> bool:
        return len(self.tokens) >= self.req.emits


def _copy_recurrent(src: Any, dst: Any, keys: tuple[str, ...]) -> None:
    """Copy the recurrent layers' ``keys`` (``conv``, ``ssm``) from session ``src`` into ``dst``."""
    for il, st in enumerate(src.states):
        if "ssm" in st:
            dst.states[il] = {**dst.states[il], **{k: np.array(st[k], copy=True) for k in keys}}


class ServingScheduler:
    """Run a ``ServeScenario`` through the oracle ``oracle`` (see the module docstring).

    ``faults``: the serving mutants' deviations, each off by default: ``slot_reset`` False keeps
    the recurrent (conv and DeltaNet) state a reused slot's previous request left (llama.cpp
    #29092); ``abort_reset`` False does so only after an aborted request (warpfront/hipfire #462);
    ``header_key`` N matches a cached state on its first N tokens alone (kekzl/imp PR #1463);
    ``read_grid`` G looks a hit up on a G-token grid but restores the state kept at index hit/G of
    the ``cache_block`` grid (sglang PR #33515); ``join_conv`` True gives a request admitted while
    others run the first running request's conv state (mlx-lm PR #1169); ``pad_alias`` True pads
    a step of 3, 5, 6 or 7 requests to the next power of two with rows that write a pad token into
    slot 0's recurrent state (vLLM PR #34077, sglang PR #27202); ``turn_dropped`` True keeps, at a
    request's end, its recurrent state as the prompt left it, without the generated tokens' updates
    (a continued conversation loses the last turn's state update). ``max_running`` limits the requests in flight (1: an engine that serves one request
    after another). Raises ``EngineError`` for a scenario whose arrivals can never be met."""

    def __init__(self, oracle: Any, faults: Mapping[str, Any] | None = None, *, n_slots: int = N_SLOTS,
                 prefill_chunk: int = PREFILL_CHUNK, cache_block: int = CACHE_BLOCK, max_running: int | None = None):
        self.oracle, self.faults = oracle, dict(faults or {})
        self.n_slots, self.prefill_chunk, self.cache_block = n_slots, prefill_chunk, cache_block
        self.max_running = max_running or n_slots
        self.cache: dict[tuple[int, ...], Any] = {}
        self.left_in_slot: dict[int, Any] = {}
        self._base: Any = None

    # -- state ------------------------------------------------------------------------------
    def _fresh(self) -> Any:
        if self._base is None:
            self._base = self.oracle.session()
        return self._base.fork()

    def _keep(self, key: list[int], session: Any) -> None:
        self.cache.pop(tuple(key), None)
        self.cache[tuple(key)] = session.fork()
        while len(self.cache) > CACHE_ENTRIES:
            self.cache.pop(next(iter(self.cache)))

    def _lookup(self, prompt: list[int]) -> tuple[int, Any] | None:
        """The longest kept state whose tokens begin ``prompt`` (at most ``len(prompt) - 1``)."""
        grid = self.faults.get("read_grid")
        if grid:  # hits on the G grid, states read at the block grid's index hit // G
            for n in range((len(prompt) - 1) // grid * grid, 0, -grid):
                at = (n // grid) * self.cache_block
                if tuple(prompt[:n]) in self.cache and tuple(prompt[:at]) in self.cache:
                    return n, self.cache[tuple(prompt[:at])]
            return None
        header = self.faults.get("header_key")
        best: tuple[int, Any] | None = None
        for key, session in self.cache.items():
            n = len(key)
            if n > len(prompt) - 1 or (best is not None and n <= best[0]):
                continue
            want = min(n, int(header)) if header else n
            if common_prefix(key[:want], prompt[:want]) == want:
                best = (n, session)
        return best

    def _admit(self, req: ServeRequest, slot: int, prompt: list[int], directory: Any, running: list[_Run]) -> _Run:
        hit = self._lookup(prompt)
        if hit is not None:
            session, cached = hit[1].fork(), hit[0]
        else:
            session, cached = self._fresh(), 0
            left = self.left_in_slot.get(slot)
            if left is not None and (self.faults.get("slot_reset") is False or (self.faults.get("abort_reset") is False and left[1])):
                _copy_recurrent(left[0], session, ("conv", "ssm"))  # the KV cache is cleared, the recurrent state survives
            if self.faults.get("join_conv") and running:
                _copy_recurrent(running[0].session, session, ("conv",))
        return _Run(req, slot, prompt, session, cached, cached, RowSpill(directory))

    # -- one step ---------------------------------------------------------------------------
    def _feed(self, run: _Run) -> tuple[int, int]:
        """Feed ``run``'s next chunk (prefill) or its last token (decode); returns (fed, emitted)."""
        if run.pos < len(run.prompt):
            room = self.cache_block - run.pos % self.cache_block
            n = min(len(run.prompt) - run.pos, self.prefill_chunk, room)
            piece = run.prompt[run.pos : run.pos + n]
        else:
            n, piece = 1, [run.tokens[-1]]
        rows = run.session.feed(piece)
        run.spill.append(rows)
        run.pos += n
        if run.pos == len(run.prompt) and self.faults.get("turn_dropped"):
            run.prefilled = run.session.fork()
        if run.pos <= len(run.prompt) and run.pos % self.cache_block == 0:
            self._keep(run.prompt[: run.pos], run.session)
        if run.pos < len(run.prompt):
            return n, 0
        forced = run.req.force
        run.tokens.append(int(forced[len(run.tokens)]) if forced is not None else int(np.argmax(rows[-1])))
        return n, 1

    def _finish(self, run: _Run, aborted: bool) -> ServedRequest:
        self.left_in_slot[run.slot] = (run.session, aborted)
        if not aborted:
            kept = run.session
            if run.prefilled is not None:  # the KV of the whole turn, the recurrent state of its prompt alone
                kept = run.session.fork()
                _copy_recurrent(run.prefilled, kept, ("conv", "ssm"))
            self._keep(run.prompt + run.tokens[:-1], kept)
        return ServedRequest(run.req.id, run.prompt, list(run.tokens), run.slot, run.cached, aborted,
                             run.cached, run.spill.read)

    def _pad_into_slot0(self, running: list[_Run]) -> None:
        """The ``pad_alias`` fault: the padded rows of the step write a pad token (id 0) into the
        recurrent state of the request in slot 0, as if they were its rows."""
        victim = next((r for r in running if r.slot == 0), None)
        if victim is not None:
            scratch = victim.session.fork()
            scratch.feed([0])
            _copy_recurrent(scratch, victim.session, ("conv", "ssm"))

    # -- the scenario -----------------------------------------------------------------------
    def _due(self, req: ServeRequest, step: int, steps: list[Step], done: dict[str, ServedRequest]) -> bool:
        if step < req.arrival.step or (req.continues is not None and req.continues not in done):
            return False
        if req.arrival.after is None:
            return True
        emitted = sum(e.emitted for s in steps for e in s.entries if e.request == req.arrival.after)
        return emitted >= req.arrival.tokens

    def run(self, scenario: ServeScenario, directory: Any = None) -> ServeResult:
        """Serve ``scenario``; returns the ``ServeResult`` (rows spilled to temporary files in
        ``directory``). Raises ``EngineError`` when requests wait for arrivals that never come."""
        pending = list(scenario.requests)
        running: list[_Run] = []
        done: dict[str, ServedRequest] = {}
        steps: list[Step] = []
        step = 0
        while pending or running:
            for req in [r for r in pending if self._due(r, step, steps, done)]:
                free = sorted(set(range(self.n_slots)) - {r.slot for r in running})
                if not free or len(running) >= self.max_running:
                    break
                prompt = list(req.tokens) if req.continues is None else done[req.continues].prompt + done[req.continues].tokens + list(req.tokens)
                running.append(self._admit(req, free[0], prompt, directory, running))
                pending.remove(req)
            if not running:
                later = [r.arrival.step for r in pending if r.arrival.step > step]
                if not later:
                    raise EngineError(f"oracle serving: scenario {scenario.name!r}: requests {[r.id for r in pending]} wait for "
                                      "arrivals that never come")
                step = min(later)
                continue
            entries = []
            for run in list(running):
                fed, emitted = self._feed(run)
                entries.append(StepEntry(run.req.id, run.slot, fed, emitted))
                if run.done:
                    done[run.req.id] = self._finish(run, aborted=run.req.emits < run.req.n_tokens)
                    running.remove(run)
            if self.faults.get("pad_alias") and len(entries) in (3, 5, 6, 7):
                self._pad_into_slot0(running)
            steps.append(Step(step, entries))
            step += 1
        return ServeResult({r.id: done[r.id] for r in scenario.requests}, steps)
