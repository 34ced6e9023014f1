"""Token text of a GGUF vocabulary: token id → the text it stands for (escaping for display is
the renderer's: ``harness.evidence.fmt.quoted``).

``tokenizer.ggml.model`` says how ``tokenizer.ggml.tokens`` are spelled: ``gpt2`` (Qwen's
byte-level BPE) writes each byte as one printable character (GPT-2's ``bytes_to_unicode``,
openai/gpt-2 ``encoder.py``; llama.cpp ``llm_tokenizer_bpe``), ``llama`` (SentencePiece) writes a
space as ``▁`` and raw bytes as ``<0xNN>``. Special tokens (``<|im_end|>``) are stored as text.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Sequence


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte → printable unicode character table (openai/gpt-2 encoder.py)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, (chr(c) for c in cs)))


@lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    return {u: b for b, u in bytes_to_unicode().items()}


class Vocab:
    """Token id → text of one GGUF vocabulary (``tokenizer.ggml.tokens``, spelled as
    ``tokenizer.ggml.model`` says)."""

    def __init__(self, tokens: Sequence[str], model: str | None):
        # A sequence is kept as given (``GGUFModel.token_texts`` decodes a token when read).
        self.tokens = tokens if hasattr(tokens, "__getitem__") and hasattr(tokens, "__len__") else list(tokens)
        self.model = model or ""

    def raw(self, token_id: int) -> str | None:
        """The decoded text of ``token_id`` (undecodable bytes as surrogate escapes), or None
        outside the vocabulary."""
        if not 0 <= token_id < len(self.tokens):
            return None
        t = self.tokens[token_id]
        if self.model == "gpt2":
            dec = _byte_decoder()
            if all(ch in dec for ch in t):
                return bytes(dec[ch] for ch in t).decode("utf-8", errors="surrogateescape")
            return t
        if self.model == "llama":
            if len(t) == 6 and t.startswith("<0x") and t.endswith(">"):
                try:
                    return bytes([int(t[3:5], 16)]).decode("utf-8", errors="surrogateescape")
                except ValueError:
                    return t
            return t.replace("\u2581", " ")
        return t
