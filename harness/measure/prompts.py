"""Prompt sets: the shipped default and user files.

Format: JSONL, one object per line, with ``id`` and either ``text`` (tokenized by the reference
engine, llama.cpp) or ``tokens`` (pre-tokenized ids, used as they are). Other fields are kept as
metadata. The set's sha256 is over the file's bytes.
"""

from __future__ import annotations

import hashlib
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from harness.errors import InvalidInput, NotComparable
from harness.fschecks import read_utf8
from harness.paths import DEFAULT_PROMPTS


@dataclass
class Prompt:
    """One prompt: ``text`` or ``tokens`` (list of int token ids), plus free-form ``meta``."""

    id: str
    text: str | None = None
    tokens: list[int] | None = None
    meta: dict[str, Any] = field(default_factory=dict)


@dataclass
class PromptSet:
    """Prompts loaded from one file; ``sha256`` identifies the file's bytes."""

    path: Path
    sha256: str
    prompts: list[Prompt]

    @property
    def id(self) -> str:
        return self.path.stem

    def __iter__(self):
        return iter(self.prompts)

    def __len__(self) -> int:
        return len(self.prompts)


MAX_TOKEN_ID = (1 << 31) - 1
"""Token ids are llama.cpp ``llama_token`` (``int32_t``); a larger id is no token of any vocab."""


def _parse_line(p: Path, lineno: int, line: str) -> Any:
    """One JSON line; ``InvalidInput`` for bad JSON, numbers Python refuses to convert (an
    integer of more than 4,300 digits), nesting deeper than the parser's recursion limit, and
    ``\\uD800``-style escapes of lone surrogates (no UTF-8 text holds them: no receipt could)."""
    try:
        obj = json.loads(line)
        json.dumps(obj, ensure_ascii=False).encode("utf-8")
        return obj
    except UnicodeEncodeError:
        raise InvalidInput(f"{p}:{lineno}: a string holds a lone surrogate escape (\\ud800-\\udfff), which is no text") from None
    except json.JSONDecodeError as e:
        raise InvalidInput(f"{p}:{lineno}: invalid JSON ({e.msg})") from None
    except RecursionError:
        raise InvalidInput(f"{p}:{lineno}: JSON nested too deeply (a prompt is an object of strings and ints)") from None
    except ValueError:  # int(...) of an integer literal past sys.get_int_max_str_digits()
        raise InvalidInput(f"{p}:{lineno}: invalid JSON (a number of more than {sys.get_int_max_str_digits():,} digits)") from None


def load_prompt_set(path: str | Path | None) -> PromptSet:
    """Load a JSONL prompt file (``None``: the shipped default set).

    Raises ``InvalidInput`` (exit 2) naming the file and line for unreadable files, bytes that
    are not UTF-8 (never silently replaced: the text would not be the one the user meant), bad
    JSON (including absurdly long numbers and deep nesting), a missing/duplicate ``id``, an
    entry with neither ``text`` nor a list of int ``tokens``, or a token id outside
    ``0..MAX_TOKEN_ID``.
    """
    p = Path(path) if path is not None else DEFAULT_PROMPTS
    raw, text = read_utf8(p, "prompt file", "; prompt files are UTF-8 JSON lines")
    prompts: list[Prompt] = []
    seen: set[str] = set()
    for lineno, line in enumerate(text.split("\n"), 1):
        if not line.strip():
            continue
        obj = _parse_line(p, lineno, line)
        if not isinstance(obj, dict) or not isinstance(obj.get("id"), str) or not obj["id"]:
            raise InvalidInput(f"{p}:{lineno}: each line needs a string 'id'")
        pid = obj["id"]
        if pid in seen:
            raise InvalidInput(f"{p}:{lineno}: duplicate prompt id {pid!r}")
        seen.add(pid)
        text_, tokens = obj.get("text"), obj.get("tokens")
        if tokens is not None:
            if not isinstance(tokens, list) or not tokens or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in tokens):
                raise InvalidInput(f"{p}:{lineno}: 'tokens' must be a non-empty list of non-negative ints")
            big = next((t for t in tokens if t > MAX_TOKEN_ID), None)
            if big is not None:
                shown = str(big) if big < 10**30 else f"{str(big)[:12]}… ({len(str(big))} digits)"
                raise InvalidInput(f"{p}:{lineno}: token id {shown} is larger than any token id can be ({MAX_TOKEN_ID}, int32)")
        elif not isinstance(text_, str) or not text_:
            raise InvalidInput(f"{p}:{lineno}: prompt {pid!r} needs a non-empty 'text' or 'tokens'")
        meta = {k: v for k, v in obj.items() if k not in ("id", "text", "tokens")}
        prompts.append(Prompt(pid, text_ if tokens is None else None, tokens, meta))
    if not prompts:
        raise InvalidInput(f"{p}: no prompts")
    return PromptSet(p, hashlib.sha256(raw).hexdigest(), prompts)


def load_prompts(path: str | Path | None) -> list[Prompt]:
    """The prompts of ``load_prompt_set(path)``."""
    return load_prompt_set(path).prompts


@dataclass
class PromptTokens:
    """A prompt's id and the token ids both engines receive; ``score_from``: the first position
    scored for perplexity and Δp (0 for a prompt; n_ctx/2 for a text window,
    ``harness.measure.text_windows``); ``judge_from``: the first position compared and judged
    at all (0: every position; ``harness parity --text --score-second-half``: ``score_from``, the
    engines asked for those rows alone where they can, as ``llama-perplexity`` asks llama.cpp)."""

    id: str
    tokens: list[int]
    source: str  # "text" (tokenized by the reference) or "ids"
    score_from: int = 0
    judge_from: int = 0


def tokenize_prompts(prompt_set: PromptSet, tokenizer: Any) -> list[PromptTokens]:
    """Token ids per prompt: given ``tokens`` as they are, ``text`` through
    ``tokenizer.tokenize`` (the reference's tokenizer). Raises ``NotComparable`` when a text
    tokenizes to nothing."""
    texts = [p.text for p in prompt_set if p.tokens is None]
    many = getattr(tokenizer, "tokenize_many", None)
    ids = iter(many(texts) if many and texts else [tokenizer.tokenize(t) for t in texts])  # no texts: no tokenizer run
    out = []
    for p in prompt_set:
        if p.tokens is not None:
            out.append(PromptTokens(p.id, list(p.tokens), "ids"))
        else:
            toks = next(ids)
            if not toks:
                raise NotComparable(f"prompt {p.id!r} tokenizes to no tokens")
            out.append(PromptTokens(p.id, toks, "text"))
    return out
