"""Greedy paths compared token by token, past near-ties (the serving probe; the speculative probe's
cases are the same question).

Two greedy runs of one engine that must agree (a request served beside other traffic and the same
request alone; speculative and plain decoding) may still part where the solo path's own top-1 and
top-2 logits are nearly tied: other kernels, other summation orders. Such a divergence is excused,
but a comparison must not end there, or a fault that shows only later hides behind the first
near-tie. So the comparison goes on by teacher forcing: the other run is fed the solo path's
tokens from there on, and each of its own choices along that path (the argmax of its row) is
compared with the solo token at that position, again excused only at a near-tie.

``first_divergence`` judges a free-running path (after the first divergence the two paths see
other histories, so nothing later is comparable); ``forced_divergences`` judges choices along the
solo path (every position is comparable); ``judge_greedy`` runs the two in that order, asking for
the forced choices only when the free path parted at a near-tie. ``forced_by_restarts`` gets those
choices from a run that can only be restarted on a prefix (the speculative probe's decoder).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np


@dataclass(frozen=True)
class Divergence:
    """Generated index ``index`` where the other run chose ``chosen`` and the solo path ``solo``;
    ``margin``: the solo row's top-1 minus top-2 logit there; ``near_tie``: margin < delta."""

    index: int
    solo: int
    chosen: int | None
    margin: float
    near_tie: bool

    def to_dict(self) -> dict[str, object]:
        return {"index": self.index, "solo": self.solo, "chosen": self.chosen,
                "margin": self.margin if np.isfinite(self.margin) else None, "near_tie": self.near_tie}


def _divergence(i: int, solo: Sequence[int], chosen: Sequence[int], margin_at: Callable[[int], float], delta: float) -> Divergence:
    m = float(margin_at(i))
    return Divergence(i, int(solo[i]), int(chosen[i]) if i < len(chosen) else None, m, bool(np.isfinite(m) and m < delta))


def first_divergence(solo: Sequence[int], chosen: Sequence[int], margin_at: Callable[[int], float], delta: float) -> Divergence | None:
    """The first index where a free-running path ``chosen`` leaves ``solo`` (a missing token
    counts as leaving), with the solo path's margin there (``margin_at(i)``: logits, top-1 minus
    top-2 of the row that chose ``solo[i]``); None when they agree over ``len(solo)``."""
    for i in range(len(solo)):
        if i >= len(chosen) or int(chosen[i]) != int(solo[i]):
            return _divergence(i, solo, chosen, margin_at, delta)
    return None


def forced_divergences(solo: Sequence[int], chosen: Sequence[int], margin_at: Callable[[int], float], delta: float) -> list[Divergence]:
    """Every index where ``chosen`` (the other run's argmax along the solo path, teacher forced:
    ``chosen[i]`` follows ``solo[:i]``) differs from ``solo``, each with its margin and whether it
    is a near-tie."""
    return [_divergence(i, solo, chosen, margin_at, delta) for i in range(min(len(solo), len(chosen))) if int(chosen[i]) != int(solo[i])]


@dataclass
class GreedyJudgement:
    """``hard``: the first divergence that is not a near-tie (None: none, the paths agree up to
    near-ties); ``near_ties``: the excused ones, in order; ``forced``: whether the comparison went
    on by teacher forcing."""

    hard: Divergence | None
    near_ties: list[Divergence]
    forced: bool


def judge_greedy(solo: Sequence[int], free: Sequence[int], margin_at: Callable[[int], float], delta: float,
                 forced_choices: Callable[[], Sequence[int]] | None) -> GreedyJudgement:
    """Judge the free-running ``free`` against ``solo``: no divergence, or a hard one (FAIL at its
    index), ends it; a near-tie is excused and, with ``forced_choices`` (the other run's argmax at
    every index along the solo path), the comparison goes on over every index by
    ``forced_divergences``. Without ``forced_choices`` the near-tie is recorded and nothing after it
    is judged (``forced`` False: the caller must say so, never PASS what it did not see)."""
    first = first_divergence(solo, free, margin_at, delta)
    if first is None or not first.near_tie:
        return GreedyJudgement(first, [], False)
    if forced_choices is None:
        return GreedyJudgement(None, [first], False)
    divs = forced_divergences(solo, list(forced_choices()), margin_at, delta)
    hard = next((d for d in divs if not d.near_tie), None)
    return GreedyJudgement(hard, [first] + [d for d in divs if d.near_tie and d.index != first.index], True)


def forced_by_restarts(solo: Sequence[int], free: Sequence[int], restart: Callable[[int], Sequence[int]]) -> list[int]:
    """The other run's choices along the solo path (what ``forced_divergences`` judges) for a run
    that cannot be fed a path row by row (a speculative decoder): from each index i where it left
    ``solo``, it is restarted on the solo path's prefix (``restart(i)``: its tokens for indices
    i, i + 1, … when the solo tokens before i are given as its history, teacher forcing the solo
    token), and its choices are read until it leaves again. ``free``: its free-running tokens
    (the first restart's). A missing token counts as -1 (a divergence)."""
    n, out, i, run = len(solo), [], 0, list(free)
    while i < n:
        j = next((x for x in range(n - i) if x >= len(run) or int(run[x]) != int(solo[i + x])), None)
        if j is None:
            out += [int(t) for t in run[: n - i]]
            break
        out += [int(t) for t in run[:j]] + [int(run[j]) if j < len(run) else -1]
        i += j + 1
        if i < n:
            run = list(restart(i))
    return out
