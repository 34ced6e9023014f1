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
- **speculation** (a request with ``draft_max``, on a model with an MTP block): every request of
  the scenario is held by a ``SpecDecoder`` (``harness.engines.oracle.speculative``: the trunk's
  session, the MTP head's K/V, the last hidden state), so a cached state carries the head's too;
  a speculating request's decode step drafts up to ``draft_max`` tokens with the head and
  verifies them in one batch beside the other requests' steps, rolled back to the last accepted
  token (``SpecDecoder.step``); its rows are the verify rows that chose its tokens. A teacher
  forced request verifies the forced tokens as its drafts, so it still accepts and rolls back.

Each request's state is an ``OracleSession``; requests share a step in the schedule, while their
arithmetic is the oracle's alone per sequence, which is why a served request must equal its solo
run. A serving mutant (``harness.engines.mutants``, ``SERVING_MUTANTS``) changes one rule of the
state handling through ``faults``; nothing else.
"""

from __future__ import annotations

import copy
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
    dec: Any = None
    """The ``SpecDecoder`` holding ``session`` in a speculative scenario (None: a plain session)."""

    @property
    def done(self) -> bool:
        return len(self.tokens) >= self.req.emits


def _copy_recurrent(src: Any, dst: Any, keys: tuple[str, ...]) -> None:
    """Copy the recurrent layers' ``keys`` (``conv``, ``ssm``) from session ``src`` into ``dst``."""
    for il, st in enumerate(src.states):
        if "ssm" in st:
            dst.states[il] = {**dst.states[il], **{k: np.array(st[k], copy=True) for k in keys}}


@dataclass
class _States:
    """Bare per-layer states (``SpecDecoder.spoiled``) as ``_copy_recurrent`` reads them."""

    states: list[dict[str, Any]]


def _aliased_rollback(dec: Any) -> Any:
    """The ``spec_pad_scratch`` fault's rollback for one step: the snapshot taken before the verify
    batch (the scratch the rollback restores) has had a padded row's pad token (id 0) written into
    its conv and recurrent state."""
    cls_rollback = type(dec).rollback

    def rollback(before: list[dict[str, Any]], after: list[dict[str, Any]], n_past: int, keep: list[int]) -> None:
        scratch = dec.session.fork()
        scratch.states = copy.deepcopy(before)
        scratch.feed_hidden([0])
        aliased = copy.deepcopy(before)
        for il, st in enumerate(scratch.states):
            if "ssm" in st:
                aliased[il] = {**aliased[il], "conv": st["conv"], "ssm": st["ssm"]}
        cls_rollback(dec, aliased, after, n_past, keep)
    return rollback


def _commit_for(dec: Any, a: int) -> None:
    """The ``spec_accepted_row0`` fault: ``dec``'s conv and recurrent state replaced by the state
    after its last verify batch's first ``1 + a`` tokens (another request's accepted count)."""
    last = dec.last_step
    probe = dec.session.fork()
    probe.states = copy.deepcopy(last.before)
    probe.feed_hidden(last.batch[: 1 + a])
    _copy_recurrent(probe, dec.session, ("conv", "ssm"))


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
    (a continued conversation loses the last turn's state update); ``spec_pad_scratch`` True: in a
step of 3, 5 or 7 requests, the verification rollback of the request in slot 0 restores a
snapshot a padded row wrote a pad token into (sglang PR #27202); ``spec_accepted_row0`` True: in
a step where several requests verify drafts, each one's conv and recurrent state is committed for
the accepted count of the step's first verifying request (vLLM PR #30632); ``spec_cache_spoiled``
True: the prefix cache keeps a finished speculating request's recurrent state as its last batch
with rejected drafts left it, before the rollback (vllm-ascend #14339). ``max_running`` limits the requests in flight (1: an engine that serves one request
    after another). Raises ``EngineError`` for a scenario whose arrivals can never be met."""

    def __init__(self, oracle: Any, faults: Mapping[str, Any] | None = None, *, n_slots: int = N_SLOTS,
                 prefill_chunk: int = PREFILL_CHUNK, cache_block: int = CACHE_BLOCK, max_running: int | None = None):
        self.oracle, self.faults = oracle, dict(faults or {})
        self.n_slots, self.prefill_chunk, self.cache_block = n_slots, prefill_chunk, cache_block
        self.max_running = max_running or n_slots
        self.cache: dict[tuple[int, ...], Any] = {}
        self.left_in_slot: dict[int, Any] = {}
        self._base: Any = None
        self.spec = False
        """Whether the scenario being run speculates (every state is then a ``SpecDecoder``)."""

    # -- state ------------------------------------------------------------------------------
    def _fresh(self) -> Any:
        if self._base is None:
            if self.spec:
                from harness.engines.oracle.speculative import new_decoder

                self._base = new_decoder(self.oracle, self.oracle._spec_class())
            else:
                self._base = self.oracle.session()
        return self._fork(self._base)

    def _fork(self, state: Any) -> Any:
        """An independent copy of a kept state: a session, or a decoder with its head's state."""
        if self.spec:
            from harness.engines.oracle.speculative import fork_decoder

            return fork_decoder(state)
        return state.fork()

    def _keep(self, key: list[int], session: Any) -> None:
        self.cache.pop(tuple(key), None)
        self.cache[tuple(key)] = self._fork(session)
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
            state, cached = self._fork(hit[1]), hit[0]
        else:
            state, cached = self._fresh(), 0
        dec, session = (state, state.session) if self.spec else (None, state)
        if hit is None:
            left = self.left_in_slot.get(slot)
            if left is not None and (self.faults.get("slot_reset") is False or (self.faults.get("abort_reset") is False and left[1])):
                _copy_recurrent(left[0], session, ("conv", "ssm"))  # the KV cache is cleared, the recurrent state survives
            if self.faults.get("join_conv") and running:
                _copy_recurrent(running[0].session, session, ("conv",))
        return _Run(req, slot, prompt, session, cached, cached, RowSpill(directory), dec=dec)

    # -- one step ---------------------------------------------------------------------------
    def _feed(self, run: _Run, step: dict[str, Any]) -> StepEntry:
        """Feed ``run``'s next chunk (prefill), its last token (decode) or a verification batch
        (a speculating request's decode); returns its step entry. ``step``: what the step's earlier
        entries left for the faults (the first verifying request's accepted count, the batch size)."""
        if run.pos >= len(run.prompt) and run.req.draft_max is not None and run.dec is not None:
            return self._verify(run, step)
        if run.pos < len(run.prompt):
            room = self.cache_block - run.pos % self.cache_block
            n = min(len(run.prompt) - run.pos, self.prefill_chunk, room)
            piece = run.prompt[run.pos : run.pos + n]
        else:
            n, piece = 1, [run.tokens[-1]]
        rows = run.dec.feed(piece) if run.dec is not None else run.session.feed(piece)
        run.spill.append(rows)
        run.pos += n
        if run.pos == len(run.prompt) and self.faults.get("turn_dropped"):
            run.prefilled = run.session.fork()
        if run.pos <= len(run.prompt) and run.pos % self.cache_block == 0:
            self._keep(run.prompt[: run.pos], run.dec if run.dec is not None else run.session)
        if run.pos < len(run.prompt):
            return StepEntry(run.req.id, run.slot, n, 0)
        forced = run.req.force
        run.tokens.append(int(forced[len(run.tokens)]) if forced is not None else int(np.argmax(rows[-1])))
        return StepEntry(run.req.id, run.slot, n, 1)

    def _verify(self, run: _Run, step: dict[str, Any]) -> StepEntry:
        """One speculative decode step of ``run``: up to ``draft_max`` drafts (fewer near the end:
        tokens still wanted − 1), verified after its last token in one batch and rolled back to the
        last accepted one (``SpecDecoder.step``); a forced request verifies its forced tokens."""
        dec, j = run.dec, len(run.tokens)
        k = min(int(run.req.draft_max), run.req.emits - j - 1)
        forced = run.req.force
        dec.rows = []
        if k > 0 and self.faults.get("spec_pad_scratch") and run.slot == 0 and step["size"] in (3, 5, 7):
            dec.rollback = _aliased_rollback(dec)  # this step only: the padded rows write into slot 0's scratch
        try:
            new, a, _ = dec.step(run.tokens[-1], k, None if forced is None or k == 0 else forced[j : j + k])
        finally:
            dec.__dict__.pop("rollback", None)
        if k > 0:
            first = step.setdefault("accepted", a)
            if self.faults.get("spec_accepted_row0") and first != a:
                _commit_for(dec, min(first, k))
        run.spill.append(np.asarray(dec.rows, dtype=np.float32))
        run.tokens += [int(t) for t in (new if forced is None else forced[j : j + len(new)])]
        run.pos += 1 + a
        return StepEntry(run.req.id, run.slot, 1 + k, len(new), k, a if k > 0 else 0)

    def _finish(self, run: _Run, aborted: bool) -> ServedRequest:
        self.left_in_slot[run.slot] = (run.session, aborted)
        if not aborted:
            kept = run.dec if run.dec is not None else run.session
            spoiled = run.dec.spoiled if run.dec is not None and self.faults.get("spec_cache_spoiled") else None
            if run.prefilled is not None or spoiled is not None:
                kept = self._fork(kept)
                inner = kept.session if run.dec is not None else kept
                if run.prefilled is not None:  # the KV of the whole turn, the recurrent state of its prompt alone
                    _copy_recurrent(run.prefilled, inner, ("conv", "ssm"))
                if spoiled is not None:  # the state the last batch with rejected drafts left, not the rolled-back one
                    _copy_recurrent(_States(spoiled), inner, ("conv", "ssm"))
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
        self.spec = any(r.draft_max is not None for r in scenario.requests) and bool(getattr(self.oracle, "has_mtp", lambda: False)())
        self._base = None
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
            at_step: dict[str, Any] = {"size": len(running)}
            for run in list(running):
                entries.append(self._feed(run, at_step))
                if run.done:
                    done[run.req.id] = self._finish(run, aborted=run.req.emits < run.req.n_tokens)
                    running.remove(run)
            if self.faults.get("pad_alias") and len(entries) in (3, 5, 6, 7):
                self._pad_into_slot0(running)
            steps.append(Step(step, entries))
            step += 1
        return ServeResult({r.id: done[r.id] for r in scenario.requests}, steps)
