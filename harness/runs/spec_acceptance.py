"""The speculative probe's acceptance gate: the candidate's head against the reference head.

A head that drafts badly changes no generated token (the trunk verifies every draft), so the
speculative probe's token-for-token check passes it; only acceptance shows it (xLLM PR #1887:
acceptance down to about 40 %; vllm-mlx #471: 4-bit MTP weights, 0 %; MTPLX #176: an unshifted
sidecar norm, every draft garbage; ``mutant:spec-drafts-crossed``). Acceptance alone cannot be
judged: it depends on the head, the text and draft_max. So each head-drafted case is judged
*paired*, at the candidate's own verification steps:

- the candidate's **first drafts**: at every step that proposed drafts, whether its first draft
  was accepted (accepted ≥ 1); a first draft always comes from the trunk's hidden state and the
  chosen token, so it is the same question at every depth of draft_max;
- the **reference head's first drafts at the same steps**: its teacher-forced draft row
  (``Engine.draft`` on the case's prompt and the plain continuation; row t predicts token t + 2)
  for the token that step's first draft predicts, right or not.

The same steps, the same targets: a correct engine with the same head hits where the reference
hits, up to argmax near-ties. The gate (thresholds.yaml ``probes.spec_max_acceptance_drop``,
measured by ``harness calibrate --speculative``) FAILs a case whose drop
1 − candidate hits / reference hits exceeds the row's value; a case where the reference hits
fewer than ``probes.spec_min_reference_accepted`` first drafts is UNMEASURED (too few to tell a
drop from chance). The chained drafts (depth 2 and on) are counted in the case's acceptance, not
judged here: the reference's ``draft`` op is teacher-forced and gives depth 1 only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from harness.engines.base import Engine
from harness.errors import EngineError
from harness.runs.probe_types import Comparison

GATE_ROW = "spec_max_acceptance_drop"
"""thresholds.yaml ``probes`` row: the largest drop of first-draft acceptance a case may show."""
MIN_ROW = "spec_min_reference_accepted"
"""thresholds.yaml ``probes`` row: the fewest reference first-draft hits a case needs to be judged."""
COUNTS = ("first drafts accepted / verification steps that proposed drafts (the candidate's own steps); "
          "the reference head: its teacher-forced first draft right at those same steps")
"""What the gate's numbers count (each gated case's ``acceptance_gate.counts``)."""
OBLIGATION = "QMTP-ACCEPT-011"
"""The contract obligation the gate judges (contracts/qwen35-mtp-v1.yaml): a failing case's
``Comparison.obligation``, so its likely cause is a head drafting badly, not a state rollback."""


@dataclass(frozen=True)
class AcceptanceGate:
    """The gate's two numbers from thresholds.yaml: ``max_drop`` (a fraction in [0, 1]) and
    ``min_reference`` (reference first-draft hits); ``rows`` the sources named in messages."""

    max_drop: float
    min_reference: int
    rows: str = f"probes.{GATE_ROW}, probes.{MIN_ROW}"


def gate_from(probes: dict[str, Any]) -> tuple[AcceptanceGate | None, str]:
    """The gate from a resolved thresholds file's ``probes`` (name → ``Gate`` with ``.value``), or
    (None, why) when either row is missing."""
    missing = [n for n in (GATE_ROW, MIN_ROW) if n not in probes]
    if missing:
        return None, f"thresholds.yaml has no {', '.join('probes.' + m for m in missing)} row (harness calibrate --speculative writes them)"
    return AcceptanceGate(float(probes[GATE_ROW].value), int(probes[MIN_ROW].value)), ""


def first_draft_steps(accepted: Sequence[int], rejected: Sequence[int]) -> list[tuple[int, int, bool]]:
    """The verification steps that proposed drafts, as (step, j, hit): j the generated index the
    step's first draft predicts (generated tokens before the step), hit whether it was accepted.
    Step i starts after 1 + Σ_{s<i}(a_s + 1) tokens (the prefill chose token 0); a draft-less
    step (0 accepted, 0 rejected) proposes nothing and is left out."""
    out, done = [], 1
    for i, (a, r) in enumerate(zip(accepted, rejected)):
        if a + r > 0:
            out.append((i, done, a >= 1))
        done += int(a) + 1
    return out


def reference_hits(reference: Engine, prompt: Sequence[int], plain: Sequence[int], js: Sequence[int]) -> list[bool]:
    """Whether the reference head's teacher-forced first draft predicts plain[j] for each j in
    ``js``: ``reference.draft(prompt + plain)`` (fed whole) row n + j − 2 (n = len(prompt); row t
    predicts token t + 2) argmax against plain[j]. Raises ``EngineError`` for a reply of the
    wrong shape."""
    seq = [int(t) for t in prompt] + [int(t) for t in plain]
    n = len(prompt)
    d = reference.draft(seq)  # type: ignore[attr-defined]
    rows = np.asarray(d.logits)
    if rows.ndim != 2 or rows.shape[0] != len(seq) - 1:
        raise EngineError(f"reference {reference.info.name}: draft logits of shape {rows.shape}, expected ({len(seq) - 1}, V)")
    pred = rows.argmax(axis=1)
    return [bool(int(pred[n + j - 2]) == int(seq[n + j])) for j in js]


def judge(label: str, steps: Sequence[tuple[int, int, bool]], ref: Sequence[bool], gate: AcceptanceGate,
          ref_name: str) -> tuple[dict[str, Any], Comparison | None]:
    """One case's acceptance against the reference head's at the same steps (``steps`` from
    ``first_draft_steps``, ``ref`` from ``reference_hits``). Returns the case's ``acceptance_gate``
    record (verdict PASS, FAIL or UNMEASURED; the counts; the drop; the first step lost) and, on a
    FAIL, the failing ``Comparison`` naming the case, the step and the token."""
    cand = sum(1 for _, _, hit in steps if hit)
    refn = sum(1 for h in ref if h)
    lost = [(s, j) for (s, j, hit), r in zip(steps, ref) if r and not hit]
    rec: dict[str, Any] = {"counts": COUNTS, "steps": len(steps), "candidate_accepted": cand, "reference_accepted": refn,
                           "reference": ref_name, "lost_steps": [s for s, _ in lost], "max_drop": gate.max_drop,
                           "min_reference_accepted": gate.min_reference}
    if refn < gate.min_reference:
        rec.update(verdict="UNMEASURED", reason=f"the reference head's first drafts are right at {refn} of {len(steps)} steps, "
                                               f"fewer than {gate.min_reference} (probes.{MIN_ROW})")
        return rec, None
    drop = 1.0 - cand / refn
    rec.update(drop=drop, verdict="FAIL" if drop > gate.max_drop else "PASS")
    if drop <= gate.max_drop:
        return rec, None
    s, j = lost[0]
    msg = (f"{label} acceptance (first drafts at the candidate's own steps): candidate {cand}/{len(steps)}, reference head "
           f"{ref_name} {refn}/{len(steps)}, drop {drop:.2f} > {gate.max_drop:g} (probes.{GATE_ROW}); first lost at step {s}, "
           f"token {j}; the output is lossless, the head drafts badly")
    return rec, Comparison(msg, len(steps), False, None, None, None, j, obligation=OBLIGATION)


def gate_case(label: str, prompt: Sequence[int], plain: Sequence[int], spec: Any, reference: Engine | None,
              acceptance: tuple[AcceptanceGate | None, str]) -> tuple[dict[str, Any], Comparison | None]:
    """One head-drafted case of the speculative probe (``spec``: its checked ``Speculation``, whose
    tokens equal ``plain``) judged by ``judge``: the fields its row gains (``acceptance_gate``, and
    ``reference_acceptance``: the reference head's first drafts at the candidate's steps) and the
    failing ``Comparison`` or None. ``acceptance``: (the gate, or None and why not); UNMEASURED
    with no gate or no reference with an MTP head (capability ``mtp``). Raises ``EngineError``
    when the reference's draft fails."""
    gate, why = acceptance
    if gate is None:
        return {"acceptance_gate": {"verdict": "UNMEASURED", "reason": why, "counts": COUNTS}}, None
    if reference is None or "mtp" not in reference.info.capabilities or not callable(getattr(reference, "draft", None)):
        return {"acceptance_gate": {"verdict": "UNMEASURED", "reason": "no reference with an MTP head (capability 'mtp')", "counts": COUNTS}}, None
    steps = first_draft_steps(spec.accepted, spec.rejected)
    hits = reference_hits(reference, prompt, plain, [j for _, j, _ in steps]) if steps else []
    rec, comp = judge(label, steps, hits, gate, reference.info.name)
    ref = {"engine": reference.info.name, "accepted": rec["reference_accepted"], "proposed": len(steps),
           "first_drafts_accepted": rec["candidate_accepted"], "counts": COUNTS}
    return {"acceptance_gate": rec, "reference_acceptance": ref}, comp
