"""Free-running greedy generation compared step by step (report-only, like greedy agreement).

Teacher-forced parity feeds both engines the same tokens; what users notice first is generated
text ("right for 30 tokens, then it drifts"). Here each engine continues each prompt greedily on
its own (``Engine.generate``, capability ``generate``: built-in engines, command v2 ``generate``,
an http engine with ``temperature: 0``) and the two continuations are compared:

- ``compare_generation`` (pure, engine-agnostic): the steps identical, and at the first
  divergence the step, both tokens and the reference's top-1/top-2 margin there, a near-tie when
  the margin is below ``near_tie_margin`` (``harness.measure.metrics.NEAR_TIE_MARGIN``), else
  hard. The comparison covers ``n_tokens`` steps or stops at the first end-of-generation token
  on the reference's side (``stop``: ``"n_tokens"`` or ``"eos"``, per prompt).
- ``free_running``: both engines over a prompt set; the reference's margin at a divergence comes
  from its own logits over the prompt and its continuation (the distribution it chose from).

Nothing here is gated: the result goes into the parity receipt's ``report_only.free_running``, the
report's table and the ledger row's ``free_running`` column.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Collection, Sequence

import numpy as np

from harness.engines.base import Engine, last_row
from harness.errors import EngineError
from harness.measure import metrics

DEFAULT_TOKENS = 64
"""Steps generated per prompt unless told otherwise (``--greedy-tokens``)."""


@dataclass
class GreedyPrompt:
    """One prompt's two continuations compared.

    ``steps``: how many steps were compared (``n_tokens``, or up to and including the
    reference's first EOS: ``stop`` says which); ``identical``: leading steps where both chose
    the same token; ``diverged_at`` the first differing step (None: identical throughout) with
    ``reference_token``/``candidate_token`` (the candidate's None when it stopped early) and the
    reference's margin there (logits, top-1 minus top-2) and ``near_tie`` (margin below the
    threshold; None when no margin is known)."""

    prompt: str
    steps: int
    identical: int
    stop: str
    diverged_at: int | None = None
    reference_token: int | None = None
    candidate_token: int | None = None
    margin: float | None = None
    near_tie: bool | None = None

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def compare_generation(prompt: str, reference: Sequence[int], candidate: Sequence[int], n_tokens: int,
                       eos_ids: Collection[int] = (), margin_at: Callable[[int], float | None] | None = None,
                       near_tie_margin: float = metrics.NEAR_TIE_MARGIN) -> GreedyPrompt:
    """Compare two greedy continuations of ``prompt`` (token id lists, the reference's at least
    as long as the compared steps) over ``n_tokens`` steps, stopping after the reference's first
    token in ``eos_ids``. ``margin_at(step)`` gives the reference's top-1/top-2 logit margin at a
    step (called only at a divergence). Pure: no engine is run."""
    ref = [int(t) for t in reference[:n_tokens]]
    cand = [int(t) for t in candidate]
    stop = "n_tokens"
    for i, t in enumerate(ref):
        if t in eos_ids:
            ref, stop = ref[: i + 1], "eos"
            break
    for i, t in enumerate(ref):
        c = cand[i] if i < len(cand) else None
        if c != t:
            m = margin_at(i) if margin_at is not None else None
            near = None if m is None or not np.isfinite(m) else bool(m < near_tie_margin)
            return GreedyPrompt(prompt, len(ref), i, stop, i, t, c, None if m is None else float(m), near)
    return GreedyPrompt(prompt, len(ref), len(ref), stop)


def summarize(rows: Sequence[GreedyPrompt], n_tokens: int, near_tie_margin: float) -> dict[str, Any]:
    """The receipt's ``free_running`` object: the settings, per-prompt rows and the counts of
    prompts identical throughout, diverged at a near-tie, diverged hard."""
    diverged = [r for r in rows if r.diverged_at is not None]
    return {
        "n_tokens": int(n_tokens),
        "near_tie_margin": float(near_tie_margin),
        "prompts": [r.to_dict() for r in rows],
        "identical": len(rows) - len(diverged),
        "diverged": len(diverged),
        "near_tie": sum(1 for r in diverged if r.near_tie),
        "hard": sum(1 for r in diverged if r.near_tie is False),
        "first_divergence": min((r.diverged_at for r in diverged), default=None),
    }


def eos_token_ids(model: Any) -> set[int]:
    """End-of-generation ids from GGUF metadata (``tokenizer.ggml.eos_token_id``,
    ``tokenizer.ggml.eot_token_id``; llama.cpp ``llama_vocab_is_eog``); empty when none."""
    out = set()
    for key in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id"):
        v = model.metadata(key)
        if isinstance(v, (int, np.integer)) and not isinstance(v, bool):
            out.add(int(v))
    return out


def has_generate(engine: Engine) -> bool:
    return "generate" in engine.info.capabilities and callable(getattr(engine, "generate", None))


def _generated(engine: Engine, tokens: Sequence[int], n_tokens: int, n_vocab: int, side: str) -> list[int]:
    out = engine.generate(tokens, n_tokens)  # type: ignore[attr-defined]
    if not isinstance(out, list) or len(out) > n_tokens or not all(isinstance(t, (int, np.integer)) and 0 <= t < n_vocab for t in out):
        raise EngineError(f"{side} {engine.info.name} generated {str(out)[:80]!r}: expected at most {n_tokens} token ids in [0, {n_vocab})")
    return [int(t) for t in out]


def free_running(reference: Engine, candidate: Engine, prompts: Sequence[Any], n_tokens: int = DEFAULT_TOKENS,
                 eos_ids: Collection[int] = (), near_tie_margin: float = metrics.NEAR_TIE_MARGIN) -> dict[str, Any]:
    """Both engines continue each prompt (``PromptTokens``: ``id``, ``tokens``) greedily for
    ``n_tokens`` steps; returns ``summarize``'s object, or ``{"unmeasured": reason}`` when an
    engine lacks ``generate``. Raises ``EngineError`` for a malformed continuation."""
    for side, e in (("reference", reference), ("candidate", candidate)):
        if not has_generate(e):
            return {"n_tokens": int(n_tokens), "unmeasured": f"{side} {e.info.name} cannot generate (no 'generate' capability)"}
    n_vocab = int(reference.n_vocab)
    rows = []
    for p in prompts:
        toks = list(p.tokens)
        ref = _generated(reference, toks, n_tokens, n_vocab, "reference")
        cand = _generated(candidate, toks, n_tokens, n_vocab, "candidate")

        def margin_at(step: int, toks=toks, ref=ref) -> float | None:
            seq = toks + ref[:step]
            row = last_row(reference.logits(seq), len(seq))
            return float(metrics.reference_margin(row)[0])

        if len(ref) < n_tokens and not any(t in eos_ids for t in ref):
            raise EngineError(f"reference {reference.info.name} generated {len(ref)} of {n_tokens} tokens without an end-of-generation token")
        rows.append(compare_generation(p.id, ref, cand, n_tokens, eos_ids, margin_at, near_tie_margin))
    return summarize(rows, n_tokens, near_tie_margin)
