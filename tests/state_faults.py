"""Test-side engines with state faults between calls: the seeded family of issue 14's acceptance.

``SlotEngine`` is the float64 oracle run the way a server runs a model: every sequence lives in a
state slot (an ``harness.engines.oracle.session.OracleSession``: conv, recurrent and KV state kept
between calls), several sequences decode side by side in steps of ``STEP`` tokens, prompt-cache
checkpoints are copies of a slot. Without a fault it is the oracle (bit for bit where the pieces
match). Each fault is one option:

- ``round_state=("bf16" | "f16", k)``: every k-th call into a slot rounds each recurrent layer's
  DeltaNet state S (llama.cpp's recurrent memory ``s``; with ``round_conv`` the conv state ``r``
  too) to that format: an engine keeping its recurrent memory in bf16 or f16 between decode calls;
- ``swap_slots``: after the first step of a batch, sequences 0 and 1 read and write each other's
  slot (the state slot index swapped between sequences decoded together);
- ``stale_slots``: ``logits_multi`` takes its slots from a pool and clears only their KV cache
  when it reuses one, not the conv and recurrent state (a slot's state not cleared when reused);
- ``late_checkpoint``: a checkpoint asked for after token k holds the state at the end of the
  request instead (prompt-cache restore from the wrong position).

They are test engines, not ``mutant:`` entries: the mutant table drives the committed gates and
contract matrices.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from harness.engines.base import EngineInfo, iter_blocks, validate_chunks
from harness.engines.oracle.lowp import FORMATS, round_to
from harness.engines.oracle.session import OracleSession, greedy_continue

STEP = 16
"""Tokens per sequence per side-by-side step in ``logits_multi``."""


class _Slot(OracleSession):
    """A session whose calls go through ``SlotEngine._after_call`` (the rounding fault)."""

    engine: "SlotEngine"
    calls = 0

    def feed(self, tokens: Sequence[int]) -> np.ndarray:
        out = super().feed(tokens)
        self.calls += 1
        self.engine._after_call(self)
        return out

    def fork(self) -> "_Slot":
        other = super().fork()
        other.__class__ = _Slot
        other.engine, other.calls = self.engine, self.calls
        return other


class SlotEngine:
    """The oracle behind state slots, with at most one fault (module docstring). Capabilities:
    chunks, multi_seq, prefix_reuse, generate. ``oracle``: a ``Qwen35Oracle``."""

    def __init__(self, oracle: Any, *, round_state: tuple[str, int] | None = None, round_conv: bool = False, swap_slots: bool = False,
                 stale_slots: bool = False, late_checkpoint: bool = False):
        self.oracle, self.round_conv = oracle, round_conv
        self.round_state, self.swap_slots, self.stale_slots, self.late_checkpoint = round_state, swap_slots, stale_slots, late_checkpoint
        self._weights = OracleSession(oracle).weights
        self._pool: list[_Slot] = []
        self._sessions: dict[str, dict[int, _Slot]] = {}

    @property
    def fault(self) -> str:
        if self.round_state:
            return f"{'conv+' if self.round_conv else ''}state-{self.round_state[0]}-every-{self.round_state[1]}"
        return "swap-slots" if self.swap_slots else "stale-slots" if self.stale_slots else "late-checkpoint" if self.late_checkpoint else "none"

    @property
    def info(self) -> EngineInfo:
        return EngineInfo(f"test:slots[{self.fault}]", "test", capabilities=["chunks", "multi_seq", "prefix_reuse", "generate"],
                          compute_class="f64")

    @property
    def n_vocab(self) -> int:
        return self.oracle.n_vocab

    def _slot(self) -> _Slot:
        s = _Slot(self.oracle, self._weights)
        s.engine = self
        return s

    def _after_call(self, slot: _Slot) -> None:
        if self.round_state and slot.calls % self.round_state[1] == 0:
            fmt = FORMATS[self.round_state[0]]
            for il, st in enumerate(slot.states):
                if self.oracle.hp.is_recurrent(il):
                    st["ssm"] = round_to(st["ssm"], fmt).astype(np.float64)
                    if self.round_conv:
                        st["conv"] = round_to(st["conv"], fmt).astype(np.float64)

    def logits(self, tokens: Sequence[int], chunks: Sequence[int] | None = None):
        tokens = [int(t) for t in tokens]
        slot, rows, start = self._slot(), [], 0
        for c in validate_chunks(len(tokens), chunks):
            rows.append(slot.feed(tokens[start:start + c]))
            start += c
        yield from iter_blocks(np.concatenate(rows))

    def _slots_for(self, n: int) -> list[_Slot]:
        if not self.stale_slots:
            return [self._slot() for _ in range(n)]
        while len(self._pool) < n:
            self._pool.append(self._slot())
        for s in self._pool[:n]:  # reused: the KV cache is cleared, the conv and recurrent state are not
            for il, st in enumerate(s.states):
                if not self.oracle.hp.is_recurrent(il):
                    st["k"], st["v"], st["pos"] = [], [], []
            s.n_past = 0
        return self._pool[:n]

    def logits_multi(self, sequences: Sequence[Sequence[int]]):
        seqs = [[int(t) for t in q] for q in sequences]
        slots = self._slots_for(len(seqs))
        out = [[] for _ in seqs]
        for step, start in enumerate(range(0, max(map(len, seqs)), STEP)):
            for i, q in enumerate(seqs):
                if start >= len(q):
                    continue
                j = {0: 1, 1: 0}.get(i, i) if self.swap_slots and step > 0 and len(seqs) > 1 else i
                out[i].append(slots[j].feed(q[start:start + STEP]))
        yield from iter_blocks(np.concatenate([np.concatenate(o) for o in out]))

    def session_logits(self, tokens: Sequence[int], *, session: str, parent: str | None = None, after: int = 0,
                       checkpoints: Sequence[int] = ()):
        tokens = [int(t) for t in tokens]
        slot = self._slot() if parent is None else self._sessions[parent][after].fork()
        kept = dict(self._sessions.get(session, {})) if parent == session else {}
        cuts = sorted({k - after for k in checkpoints if after < k < after + len(tokens)} | {len(tokens)})
        rows, done, late = [], 0, []
        for cut in cuts:
            rows.append(slot.feed(tokens[done:cut]))
            if self.late_checkpoint and cut < len(tokens):
                late.append(after + cut)
            else:
                kept[after + cut] = slot.fork()
            done = cut
        for k in late:
            kept[k] = slot.fork()
        self._sessions[session] = kept
        yield from iter_blocks(np.concatenate(rows))

    def drop_sessions(self) -> None:
        self._sessions.clear()

    def generate(self, tokens: Sequence[int], n_tokens: int) -> list[int]:
        return greedy_continue(self._slot(), tokens, n_tokens)
