"""A text file cut into windows of ``n_ctx`` tokens, as llama.cpp's ``llama-perplexity`` cuts it.

``harness parity --text FILE --ctx N`` follows ``tools/perplexity/perplexity.cpp``
(``perplexity`` and ``kl_divergence``): the whole file is tokenized once by the model's own
tokenizer with ``add_special`` on (``common_tokenize(ctx, text, true)``: a BOS in front when the
vocabulary's ``tokenizer.ggml.add_bos_token`` asks for one), the tokens are cut into consecutive,
non-overlapping windows of ``n_ctx`` (``n_chunk = n_tokens / n_ctx``; the tokens after the last
whole window are not used), each window's first token is replaced by BOS when the vocabulary adds
one, and each window is evaluated as one sequence from an empty context. Perplexity (and Δp) are
scored over the window's second half only: the logits at positions ``first = n_ctx / 2`` ..
``n_ctx - 2``, each predicting the token after it (``n_ctx - 1 - first`` positions a window), the
first half serving as context.

Each window becomes a prompt of the parity cell (``PromptTokens`` with id ``text:WINDOW-i`` and
``score_from = n_ctx / 2``); the gate judges every position of it as it judges any prompt. With
``--score-second-half`` (``judge_from = n_ctx / 2`` too) only the positions ``llama-perplexity``
asks llama.cpp logits for are compared and judged, ``n_ctx / 2`` .. ``n_ctx - 1`` of each window
(``batch.logits`` set for ``pos >= first``), and the engines are asked for those rows alone where
they can (``harness.engines.base.logits_each``, capability ``first_row``).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from harness.errors import InvalidInput
from harness.fschecks import read_utf8
from harness.measure.prompts import PromptTokens

WINDOW_PREFIX = "text:WINDOW-"
"""Prompt ids of a text's windows: ``text:WINDOW-0``, ``text:WINDOW-1``, ..."""

DEFAULT_CTX = 512
"""``--ctx`` when not given: ``llama-perplexity``'s default ``n_ctx``."""


@dataclass(frozen=True)
class TextFile:
    """A text file read for ``--text``: its absolute path, the sha256 of its bytes, its text."""

    path: Path
    sha256: str
    text: str


def load_text(path: str | Path) -> TextFile:
    """Read ``path`` as UTF-8 text (``harness.fschecks.read_utf8``: never silently altered).

    Raises ``InvalidInput`` (exit 2): a missing or unreadable file, bytes that are not UTF-8
    (naming the line and byte), a file that holds no text but white space.
    """
    p = Path(path).absolute()
    raw, text = read_utf8(p, "text file", "; --text reads a UTF-8 text file")
    if not text.strip():
        raise InvalidInput(f"text file {p} is empty; --text needs a text of at least one window of --ctx tokens")
    return TextFile(p, hashlib.sha256(raw).hexdigest(), text)


def check_ctx(n_ctx: int, context_length: int) -> None:
    """Refuse an ``n_ctx`` no window can have: below 2 (no position would have a next token), or
    above the model's ``context_length`` (``{arch}.context_length``; 0: unknown, not checked).
    Raises ``InvalidInput``."""
    if n_ctx < 2:
        raise InvalidInput(f"--ctx {n_ctx}: a window needs at least 2 tokens")
    if context_length and n_ctx > context_length:
        raise InvalidInput(f"--ctx {n_ctx} is larger than the model's context_length {context_length}")


def tokenize_text(text: str, tokenizer: Any) -> list[int]:
    """Token ids of the whole ``text`` by the reference's tokenizer with ``add_special`` on, as
    ``llama-perplexity`` tokenizes its file (``tokenize_many(..., add_special=True)`` where the
    tokenizer has it, else ``tokenize``, which adds nothing)."""
    many = getattr(tokenizer, "tokenize_many", None)
    if many is not None:
        try:
            return list(many([text], add_special=True)[0])
        except TypeError:  # a tokenize_many without add_special (an engine's own)
            pass
    return list(tokenizer.tokenize(text))


def text_windows(tokens: Sequence[int], n_ctx: int, bos_id: int | None = None, path: str | Path = "text",
                 second_half: bool = False) -> list[PromptTokens]:
    """The consecutive non-overlapping windows of ``n_ctx`` tokens of ``tokens`` (module
    docstring), each a ``PromptTokens`` (id ``text:WINDOW-i``, source ``text``, ``score_from =
    n_ctx // 2``); ``bos_id`` (the vocabulary adds a BOS): each window's first token becomes it;
    ``second_half``: ``judge_from = n_ctx // 2`` too (only those positions compared and judged).

    Raises ``InvalidInput`` when ``tokens`` hold less than one window (naming ``path``, the
    token count and ``n_ctx``) or ``n_ctx < 2``.
    """
    if n_ctx < 2:
        raise InvalidInput(f"--ctx {n_ctx}: a window needs at least 2 tokens")
    n_windows = len(tokens) // n_ctx
    if n_windows < 1:
        raise InvalidInput(f"text file {path} tokenizes to {len(tokens)} tokens, fewer than one window of --ctx {n_ctx}")
    out = []
    for i in range(n_windows):
        w = [int(t) for t in tokens[i * n_ctx:(i + 1) * n_ctx]]
        if bos_id is not None:
            w[0] = int(bos_id)
        out.append(PromptTokens(f"{WINDOW_PREFIX}{i}", w, "text", n_ctx // 2, n_ctx // 2 if second_half else 0))
    return out


SECOND_HALF_WHY = ("--score-second-half: only each window's positions from n_ctx/2 on, the rows llama-perplexity asks llama.cpp "
                   "logits for (batch.logits set for pos >= first = n_ctx/2), are computed where an engine can and compared")
"""The receipt's ``prompts.text.judged.why`` and the console's reason for the positions judged."""


def judged_record(windows: Sequence[PromptTokens]) -> dict[str, Any]:
    """The receipt's ``prompts.text.judged`` of ``--score-second-half``: the first position
    judged in each window, the positions judged in all and why."""
    first = windows[0].judge_from if windows else 0
    return {"from": int(first), "positions": int(sum(len(w.tokens) - w.judge_from for w in windows)), "why": SECOND_HALF_WHY}


def text_record(text: TextFile, n_ctx: int, n_tokens: int, windows: Sequence[PromptTokens], bos_id: int | None) -> dict[str, Any]:
    """The receipt's ``prompts.text``: the file, ``n_ctx``, the token count, the windows, the
    tokens left after the last whole window, the first scored position of each window and the BOS
    rule applied (the schema in ``harness/schemas/receipt.schema.json``)."""
    return {"path": str(text.path), "sha256": text.sha256, "n_ctx": int(n_ctx), "n_tokens": int(n_tokens), "windows": len(windows),
            "unused_tokens": int(n_tokens - len(windows) * n_ctx), "score_from": int(n_ctx // 2), "add_bos": bos_id is not None,
            "bos_id": None if bos_id is None else int(bos_id)}
