"""The speculative probe's given-draft cases: the harness proposes the drafts, so the accept path
runs at every depth and the counts become a check (``harness.runs.probes.probe_speculative``).

The MTP fixtures' heads draft little right (the tiny one nothing), so a probe that lets the engine
draft never sees 4 or more accepted in a row (xLLM #2247: accepting 4 or more drafts committed the
wrong Gated DeltaNet state) and its histories stay short of a KV block (ROCmFPX PR #54: a
verification batch crossing a 256-cell block flipped greedy tokens). Here the drafts are the
engine's own plain greedy continuation with wrong tokens planted at chosen depths
(``plant``), through ``{"draft": "given", "draft_max": 8, "tokens": [...]}``
(docs/engine-protocol.md "Given drafts"):

- ``runs 0..8``: steps that accept 0, 1, …, 8 drafts in a row, each of 0 … 7 followed by the
  rejection of the next (a rejection at every depth 1 … 8), on the 160-token prompt;
- ``boundary B`` for B in ``GIVEN_BOUNDARIES`` (256, 512, 1,024): a prompt of B − 4 tokens of the
  cycled history, so the first verification batch (positions B − 4 … B + 4, all 8 drafts right)
  straddles cell B, then a rejection at depth 1 and a last partial step; histories to 1,036.

Each case is judged three ways: the tokens equal plain greedy (``judge_case``: a near-tie is
excused and the comparison goes on by teacher forcing the plain path's token,
``harness.measure.continuation``); the accepted and rejected counts per step equal what the plain
path implies (``implied_counts``), exactly, for every step before the first near-tie; and the
logits of the verification rows that chose each token equal the plain path's rows for the same
tokens under the class's ``probe:`` tolerance (``verify_rows``): a position gap, a state one step
off or a stride error shows even when no token flips.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np

from harness.engines.base import SPEC_GIVEN_MAX, gather
from harness.errors import EngineError
from harness.measure import metrics
from harness.measure.continuation import forced_by_restarts, judge_greedy
from harness.runs.probe_types import Comparison, ProbeTolerance, compare

GIVEN_RUNS = tuple(range(SPEC_GIVEN_MAX + 1))
"""Accepted drafts per step of the ``runs`` case (draft_max ``SPEC_GIVEN_MAX``): 0 … 7 each end at a
rejection at depth a + 1; 8 is a step with every draft accepted."""
GIVEN_BOUNDARIES = (256, 512, 1024)
"""KV cells the boundary cases' first verification batch straddles."""
GIVEN_LEAD = 4
"""The boundary case's prompt ends this many tokens before its boundary."""
BOUNDARY_TOKENS = 16
"""Tokens each boundary case generates: steps of 8 accepted, 0 (rejected at depth 1), 4."""


@dataclass(frozen=True)
class GivenCase:
    """One given-draft case: ``prompt`` ids, ``n_tokens`` generated, ``wrong`` the generated
    indices whose given draft is planted wrong (the plain token + 1, mod the vocabulary)."""

    label: str
    prompt: list[int]
    n_tokens: int
    wrong: tuple[int, ...]
    draft_max: int = SPEC_GIVEN_MAX
    source: str = ""
    """The prompt ``prompt`` was cut from (an id, or ``every prompt, cycled``): the reproducer's."""


def runs_wrong(runs: Sequence[int], k: int = SPEC_GIVEN_MAX) -> tuple[tuple[int, ...], int]:
    """The planted indices and token count that make steps accept ``runs`` drafts in a row with
    draft_max ``k``: step after j tokens accepts a < k when index j + a is wrong. Returns (wrong
    indices, n_tokens = 1 + Σ(a + 1))."""
    wrong, j = [], 1
    for a in runs:
        if a < k:
            wrong.append(j + a)
        j += a + 1
    return tuple(wrong), j


def given_cases(long: Sequence[int], history: Sequence[int], long_id: str = "") -> tuple[list[GivenCase], list[int]]:
    """The shipped given-draft cases on ``long`` (the 160-token prompt, cut from prompt
    ``long_id``) and ``history`` (every prompt cycled): ``runs 0..8``, then one per boundary of
    ``GIVEN_BOUNDARIES`` that ``history`` is long enough for. Returns (cases, boundaries left out
    for want of history)."""
    wrong, n = runs_wrong(GIVEN_RUNS)
    cases = [GivenCase(f"given drafts, runs {GIVEN_RUNS[0]}..{GIVEN_RUNS[-1]} accepted ({len(long)}-token prompt), draft_max "
                       f"{SPEC_GIVEN_MAX}", [int(t) for t in long], n, wrong, source=long_id)]
    short = []
    for b in GIVEN_BOUNDARIES:
        if len(history) < b - GIVEN_LEAD:
            short.append(b)
            continue
        cases.append(GivenCase(f"given drafts across cell {b} ({b - GIVEN_LEAD}-token prompt), draft_max {SPEC_GIVEN_MAX}",
                               [int(t) for t in history[: b - GIVEN_LEAD]], BOUNDARY_TOKENS, (SPEC_GIVEN_MAX + 2,),
                               source="every prompt, cycled"))
    return cases, short


def _spec_checked(out: Any, n_tokens: int, draft_max: int, n_vocab: int, who: str) -> Any:
    """``out`` (a ``Speculation``) checked: at most n_tokens ids in the vocab, counts per step
    non-negative with accepted + rejected ≤ draft_max. Raises ``EngineError``."""
    toks = list(getattr(out, "tokens", None) or [])
    acc, rej = list(getattr(out, "accepted", []) or []), list(getattr(out, "rejected", []) or [])
    if len(toks) > n_tokens or not all(isinstance(t, (int, np.integer)) and 0 <= t < n_vocab for t in toks):
        raise EngineError(f"{who} generated {str(toks)[:80]!r} speculatively: expected at most {n_tokens} token ids in [0, {n_vocab})")
    if len(acc) != len(rej) or any(not isinstance(x, (int, np.integer)) or x < 0 for x in acc + rej) or any(a + r > draft_max for a, r in zip(acc, rej)):
        raise EngineError(f"{who}: speculative.json counts are not per-step non-negative accepted/rejected pairs within draft_max {draft_max}")
    return out


def plant(plain: Sequence[int], wrong: Sequence[int], n_vocab: int) -> list[int]:
    """The given drafts: ``plain`` with the ids at ``wrong`` replaced by (id + 1) mod ``n_vocab``."""
    out = [int(t) for t in plain]
    for i in wrong:
        if i < len(out):
            out[i] = (out[i] + 1) % n_vocab
    return out


def implied_counts(plain: Sequence[int], given: Sequence[int], draft_max: int, n_tokens: int) -> tuple[list[int], list[int]]:
    """The accepted and rejected drafts per step an engine whose choices are ``plain`` must report
    for ``given`` (docs/engine-protocol.md "Given drafts"): the step after j tokens proposes
    k' = min(draft_max, n_tokens − j − 1, len(given) − j) drafts given[j …] and accepts them while
    they equal plain[j …]."""
    acc, rej, j = [], [], 1
    while j < n_tokens:
        k = max(0, min(draft_max, n_tokens - j - 1, len(given) - j))
        a = 0
        while a < k and int(given[j + a]) == int(plain[j + a]):
            a += 1
        acc.append(a)
        rej.append(k - a)
        j += a + 1
    return acc, rej


def straddles(batches: Sequence[tuple[int, int]], cell: int) -> bool:
    """Whether some verification batch (first, last position) holds positions on both sides of
    ``cell``: first < cell ≤ last (the batch writes cells cell − 1 and cell)."""
    return any(a < cell <= b for a, b in batches)


def step_text(spec: Any, index: int) -> str:
    """Where generated token ``index`` came from, for a message: ``step S`` (its verification
    step, ``Speculation.step_of``) or ``the prefill`` (token 0: the prompt's prefill chose it, no
    step did)."""
    s = spec.step_of(index)
    return "the prefill" if s is None else f"step {s}"


def judge_case(label: str, plain: Sequence[int], spec: Any, margin_at: Callable[[int], float], delta: float,
               rerun: Callable[[int], Sequence[int]] | None) -> tuple[Comparison, dict[str, Any]]:
    """``spec`` (a ``Speculation``) against ``plain`` by ``continuation.judge_greedy``: a
    divergence at a plain-path margin below ``delta`` is excused and, with ``rerun`` (``rerun(i)``:
    the engine's speculative tokens continuing prompt + plain[:i]), the comparison goes on by
    teacher forcing the plain token (``forced_by_restarts``); without it nothing after the
    near-tie is judged (the row says ``forced: false``). Returns the ``Comparison`` (FAIL naming
    step, token, plain and speculative ids and the margin) and the case's row."""
    toks = [int(t) for t in spec.tokens]
    row: dict[str, Any] = {"case": label, "tokens": len(plain), "accepted": int(sum(spec.accepted)), "proposed": int(spec.proposed),
                           "acceptance": spec.acceptance(), "steps": len(spec.accepted)}
    forced = None if rerun is None else (lambda: forced_by_restarts(plain, toks, rerun))
    j = judge_greedy([int(t) for t in plain], toks, margin_at, delta, forced)
    first = j.near_ties[0] if j.near_ties else j.hard
    if first is not None:
        row.update(first_differing_token=first.index, plain_token=first.solo, speculative_token=first.chosen,
                   step="prefill" if spec.step_of(first.index) is None else spec.step_of(first.index), margin=first.margin,
                   near_tie=first.near_tie)
    if j.near_ties:
        row.update(near_ties=[d.to_dict() for d in j.near_ties], forced=j.forced)
    if j.hard is not None:
        d = j.hard
        where = "teacher-forced " if j.forced else ""
        return Comparison(label + f" ({where}{step_text(spec, d.index) if not j.forced else 'step after a near-tie'}, token {d.index}: "
                          f"plain {d.solo}, speculative {d.chosen}, margin {d.margin:.4g})", d.index, False, None, None, None, d.index), row
    return Comparison(label, len(plain), True, None, None, None, None), row


def counts_check(label: str, spec: Any, acc: Sequence[int], rej: Sequence[int], upto: int) -> Comparison:
    """The reported accepted/rejected counts against the implied ``acc``/``rej``, over the steps
    whose tokens all come before generated index ``upto`` (the first near-tie; len(tokens): all)."""
    done = 1
    for s, (a, r) in enumerate(zip(acc, rej)):
        if done + a + 1 > upto:
            break
        got = (spec.accepted[s], spec.rejected[s]) if s < len(spec.accepted) else None
        if got != (a, r):
            return Comparison(label + f" counts (step {s}, token {done}: the plain path implies {a} accepted and {r} rejected, "
                              f"the engine reported {got})", s, False, None, None, None, done)
        done += a + 1
    return Comparison(label + " counts", len(acc), True, None, None, None, None)


def verify_rows(label: str, plain_rows: np.ndarray, spec: Any, upto: int, tol: ProbeTolerance) -> Comparison:
    """The verification rows that chose tokens 0 … upto − 1 (``spec.logits`` float32 [n, V])
    against the plain path's rows for the same tokens (``plain_rows``) under ``tol``; a failure
    names the step and token of the first row outside it."""
    m = min(upto, len(plain_rows), len(spec.logits))
    c = compare(label + " verify logits", np.asarray(plain_rows[:m], np.float32), np.asarray(spec.logits[:m], np.float32), tol)
    if not c.ok and c.first_bad_position is not None:
        i = c.first_bad_position
        pm = metrics.position_metrics(np.asarray(plain_rows[i:i + 1], np.float32), np.asarray(spec.logits[i:i + 1], np.float32))
        c.label = (f"{label} verify logits ({step_text(spec, i)}, token {i}: 1 - cosine {1 - float(pm['cosine'][0]):.3g}, "
                   f"KLD {float(pm['kld'][0]):.3g} against the plain path's row)")
    return c


def run_given(engine: Any, cases: Sequence[GivenCase], plain: Callable[[Sequence[int], int], list[int]], delta: float,
              tol: ProbeTolerance | None, out: tuple[list[Comparison], list[dict[str, Any]]] | None = None
              ) -> tuple[list[Comparison], list[dict[str, Any]]]:
    """Every case through ``engine.speculative(..., given=...)``: tokens (``judge_case``), counts
    (``counts_check``) and, with ``tol`` and an engine that returns them, the verify rows
    (``verify_rows``). ``plain(prompt, n)``: the engine's plain greedy ids. A refusal or malformed
    reply is re-raised as ``EngineError`` naming the case. ``out``: the (comparisons, rows) lists
    to append to as each case is judged (so a later case's error keeps them), returned."""
    comps, rows = out if out is not None else ([], [])
    nv, who = int(engine.n_vocab), engine.info.name
    for case in cases:
        ref = plain(case.prompt, case.n_tokens)
        given = plant(ref, case.wrong, nv)
        prows = gather(engine.logits(case.prompt + ref), len(case.prompt) + len(ref))[len(case.prompt) - 1: len(case.prompt) - 1 + len(ref)]
        margins = metrics.reference_margin(prows)

        def spec_of(i: int, case: GivenCase = case, given: list[int] = given, ref: list[int] = ref) -> Any:
            try:
                out = engine.speculative(case.prompt + ref[:i], case.n_tokens - i, draft_max=case.draft_max, given=given[i:])
                return _spec_checked(out, case.n_tokens - i, case.draft_max, nv, who)
            except EngineError as e:
                raise EngineError(f"speculative case '{case.label}': {e}", getattr(e, "stderr_tail", "")) from None

        spec = spec_of(0)
        c, row = judge_case(case.label, ref, spec, lambda i: float(margins[i]), delta, lambda i: spec_of(i).tokens)
        acc, rej = implied_counts(ref, given, case.draft_max, case.n_tokens)
        upto = row["first_differing_token"] if row.get("first_differing_token") is not None else len(ref)
        row.update(draft_max=case.draft_max, given=True, implied_accepted=acc, implied_rejected=rej,
                   reported_accepted=list(spec.accepted), reported_rejected=list(spec.rejected),
                   batches=spec.batches(len(case.prompt)), history=len(case.prompt) + len(ref))
        fed = {"prompt": case.source, "n_tokens": len(case.prompt), "chunks": None, "generated": case.n_tokens}
        made = [c, counts_check(case.label, spec, acc, rej, upto)]
        if tol is not None and getattr(spec, "logits", None) is not None:
            made.append(verify_rows(case.label, prows, spec, upto, tol))
        else:
            row["verify_logits"] = "unmeasured: " + ("no probe tolerance" if tol is None else f"{who} returns no verify logits")
        for m in made:
            m.case = fed
        comps.extend(made)
        row["counts"] = (f"drafts accepted / drafts proposed while generating {case.n_tokens} tokens from the harness's given drafts "
                         f"(planted wrong at chosen depths), up to {case.draft_max} a step: set by the plan, not by the head")
        rows.append(row)
    return comps, rows
