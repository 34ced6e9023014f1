"""Token id sequences side by side: the candidate's own tokenization of a text against llama.cpp's.

Pure: two lists of token ids in, where they part out (``compare_ids``); a chat rendering against
the reference's in the same way, by character (``compare_text``). Token texts for a message come
from the reference vocabulary (``harness.model.vocab.Vocab``, the same ids on both sides: an
engine of the same GGUF has the same vocabulary), escaped later by whoever prints them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

CONTEXT = 3
"""Tokens shown on each side of the first difference in a failure message."""


@dataclass(frozen=True)
class IdsComparison:
    """One prompt's two tokenizations compared.

    ``reference`` and ``candidate`` are the id lists (int); ``first_diff`` the first position where
    they differ (a position one list lacks counts: the shorter one ends there), None when equal;
    ``excused`` says why a difference is not a fault (the candidate's ids are the reference's for
    the text's Unicode NFC form: a normalization llama.cpp does not apply), None otherwise.
    """

    prompt: str
    reference: tuple[int, ...]
    candidate: tuple[int, ...]
    first_diff: int | None
    excused: str | None = None

    @property
    def ok(self) -> bool:
        return self.first_diff is None or self.excused is not None

    def window(self, side: str, width: int = CONTEXT) -> list[int]:
        """``side``'s ids from ``first_diff`` on, at most ``width`` of them (``side``:
        ``reference`` or ``candidate``); empty when equal or when that side ended there."""
        if self.first_diff is None:
            return []
        ids = self.reference if side == "reference" else self.candidate
        return list(ids[self.first_diff : self.first_diff + width])

    def to_dict(self, text_of: Callable[[int], str | None] | None = None) -> dict[str, Any]:
        """JSON-ready summary: counts, ``first_diff`` and, when they differ, each side's ids from
        there (``window``) with their texts (``text_of(id)``, the reference vocabulary's; None
        outside it)."""
        d: dict[str, Any] = {"prompt": self.prompt, "ok": self.ok, "n_reference": len(self.reference),
                             "n_candidate": len(self.candidate), "first_diff": self.first_diff}
        if self.excused:
            d["excused"] = self.excused
        if self.first_diff is not None:
            for side in ("reference", "candidate"):
                ids = self.window(side)
                d[side] = [{"id": int(t), "text": text_of(int(t)) if text_of else None} for t in ids]
        return d


def first_difference(a: Sequence[Any], b: Sequence[Any]) -> int | None:
    """The first index where ``a`` and ``b`` differ (``min(len)`` when one is a proper prefix of
    the other), None when they are equal. Works on id lists and on strings alike."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def compare_ids(prompt: str, reference: Sequence[int], candidate: Sequence[int]) -> IdsComparison:
    """``IdsComparison`` of ``candidate``'s ids for a prompt against ``reference``'s (llama.cpp's)."""
    ref, cand = tuple(int(t) for t in reference), tuple(int(t) for t in candidate)
    return IdsComparison(prompt, ref, cand, first_difference(ref, cand))


@dataclass(frozen=True)
class TextComparison:
    """One conversation's rendering compared character by character: ``first_diff`` (None when
    equal) and each side's text around it (``CONTEXT_CHARS`` characters from 20 before)."""

    conversation: str
    first_diff: int | None
    reference_excerpt: str
    candidate_excerpt: str
    n_reference: int
    n_candidate: int

    @property
    def ok(self) -> bool:
        return self.first_diff is None

    def to_dict(self) -> dict[str, Any]:
        return {"conversation": self.conversation, "ok": self.ok, "first_diff": self.first_diff,
                "reference": self.reference_excerpt, "candidate": self.candidate_excerpt,
                "n_reference": self.n_reference, "n_candidate": self.n_candidate}


CONTEXT_CHARS = 40


def compare_text(conversation: str, reference: str, candidate: str) -> TextComparison:
    """``TextComparison`` of ``candidate``'s rendering of a conversation against ``reference``'s:
    the first differing character (by code point) and 40 characters of each from 20 before it."""
    i = first_difference(reference, candidate)
    if i is None:
        return TextComparison(conversation, None, "", "", len(reference), len(candidate))
    lo = max(0, i - 20)
    return TextComparison(conversation, i, reference[lo : lo + CONTEXT_CHARS], candidate[lo : lo + CONTEXT_CHARS],
                          len(reference), len(candidate))
