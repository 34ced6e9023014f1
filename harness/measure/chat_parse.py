"""What a model's generated text means under the grammar of the harness's Qwen3.5-style template
(harness/data/chat/qwen35-think.jinja): its reasoning, its content and its tool calls, the three
fields an OpenAI-style server returns (``reasoning_content``, ``content``, ``tool_calls``).

Pure: text in, fields out. The grammar, from the template:

- thinking on (the generation prompt ended with ``<think>\\n``): the text up to the first
  ``</think>`` is reasoning, however the marker is preceded (``\\n</think>`` or ``</think>``),
  without its leading and trailing newlines; what follows, without leading newlines, is the answer.
  A text with no ``</think>`` is all reasoning (an unclosed block) and has no answer.
- thinking off (the prompt carried the closed empty block): all of the text is the answer.
- the answer: the content is what comes before the first ``<tool_call>``, without leading or
  trailing newlines; each tool call is ``<tool_call>\\n<function=NAME>\\n`` then per argument
  ``<parameter=KEY>\\nVALUE\\n</parameter>\\n``, then ``</function>\\n</tool_call>``, calls
  separated by newlines. A value is the text as is where the tool's schema types the parameter
  ``string`` (or does not declare it), else JSON (left as text where it does not parse).

``FAULTS`` are planted parsers, each reproducing a public bug, for the parser check's own tests.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

FAULTS = {
    "needs-newline-close": "reasoning ends only at '\\n</think>\\n' (llama.cpp #20260: a bare '</think>\\n' is missed)",
    "leaks-close": "the '</think>' marker is left at the start of the content (vLLM #39697)",
    "json-tool-calls": "tool calls are read as Hermes JSON inside <tool_call> (ollama PR #14603); the XML form stays content",
}
"""Planted parser faults: name -> what goes wrong."""

_CALL = re.compile(r"<tool_call>\n<function=([^>\n]+)>\n((?:<parameter=[^>\n]+>\n.*?\n</parameter>\n)*)</function>\n</tool_call>", re.S)
_PARAM = re.compile(r"<parameter=([^>\n]+)>\n(.*?)\n</parameter>\n", re.S)
_JSON_CALL = re.compile(r"<tool_call>\n(\{.*?\})\n</tool_call>", re.S)


@dataclass(frozen=True)
class Parsed:
    """The three fields: ``reasoning_content`` and ``content`` (str, "" for none) and
    ``tool_calls`` (list of ``{"name": str, "arguments": dict}``)."""

    reasoning_content: str
    content: str
    tool_calls: list[dict[str, Any]]

    def to_dict(self) -> dict[str, Any]:
        """The fields as a dict (the script files' ``expected`` form)."""
        return {"reasoning_content": self.reasoning_content, "content": self.content, "tool_calls": self.tool_calls}


def _param_types(tools: list[dict[str, Any]] | None) -> dict[tuple[str, str], Any]:
    out: dict[tuple[str, str], Any] = {}
    for t in tools or []:
        f = t.get("function", t) if isinstance(t, dict) else {}
        props = ((f.get("parameters") or {}).get("properties") or {}) if isinstance(f, dict) else {}
        for k, v in props.items():
            out[(str(f.get("name")), k)] = v.get("type") if isinstance(v, dict) else None
    return out


def _value(raw: str, kind: Any) -> Any:
    if kind in (None, "string") or (isinstance(kind, list) and "string" in kind):
        return raw
    try:
        return json.loads(raw)
    except ValueError:
        return raw


def _answer(text: str, tools: list[dict[str, Any]] | None, fault: str | None) -> tuple[str, list[dict[str, Any]]]:
    if fault == "json-tool-calls":
        calls = []
        for m in _JSON_CALL.finditer(text):
            try:
                obj = json.loads(m.group(1))
                calls.append({"name": obj["name"], "arguments": obj.get("arguments", {})})
            except (ValueError, KeyError, TypeError):
                continue
        cut = text.find("<tool_call>\n{") if calls else -1
        return (text[:cut] if cut >= 0 else text).strip("\n"), calls
    at = text.find("<tool_call>")
    if at < 0:
        return text.strip("\n"), []
    types = _param_types(tools)
    calls = []
    for m in _CALL.finditer(text, at):
        name = m.group(1)
        args = {k: _value(v, types.get((name, k))) for k, v in _PARAM.findall(m.group(2))}
        calls.append({"name": name, "arguments": args})
    return text[:at].strip("\n"), calls


def parse(text: str, *, thinking: bool, tools: list[dict[str, Any]] | None = None, fault: str | None = None) -> Parsed:
    """The fields of ``text``, the model's output after the generation prompt (module docstring).
    ``thinking``: whether the generation prompt opened a ``<think>`` block (``enable_thinking``
    true or unset); ``tools``: the request's tools (their schemas type the argument values);
    ``fault``: a planted fault of ``FAULTS`` (tests only). Raises ``KeyError`` for an unknown
    fault."""
    if fault is not None and fault not in FAULTS:
        raise KeyError(fault)
    reasoning, answer = "", text
    if thinking:
        marker = "\n</think>\n" if fault == "needs-newline-close" else "</think>"
        at = text.find(marker)
        if at < 0:
            reasoning, answer = text, ""
        else:
            reasoning = text[:at]
            answer = text[at:] if fault == "leaks-close" else text[at + len(marker):]
        reasoning = reasoning.strip("\n")
        answer = answer.lstrip("\n")
    content, calls = _answer(answer, tools, fault)
    return Parsed(reasoning, content, calls)


@dataclass(frozen=True)
class FieldDiff:
    """One field that differs: ``field``, the first differing character ``at``, both sides'
    text from a few characters before it (``expected``, ``got``)."""

    field: str
    at: int
    expected: str
    got: str

    def line(self) -> str:
        """``FIELD differs at character N: expected '...' | got '...'``, both texts escaped for one
        line (``repr``: control characters and newlines written as escapes)."""
        return f"{self.field} differs at character {self.at}: expected {self.expected!r} | got {self.got!r}"


def field_text(fields: dict[str, Any], name: str) -> str:
    """A field as text for comparison: the strings as they are (None as ""), ``tool_calls`` as
    canonical JSON of ``[{name, arguments}]`` (sorted keys, non-ASCII kept)."""
    v = fields.get(name)
    if name == "tool_calls":
        return json.dumps([{"name": c.get("name"), "arguments": c.get("arguments")} for c in (v or [])], sort_keys=True, ensure_ascii=False)
    return "" if v is None else str(v)


def compare_fields(expected: dict[str, Any], got: dict[str, Any]) -> list[FieldDiff]:
    """The fields (``reasoning_content``, ``content``, ``tool_calls``, in that order) whose text
    (``field_text``) differs, each with its first differing character; [] when all agree."""
    out = []
    for name in ("reasoning_content", "content", "tool_calls"):
        a, b = field_text(expected, name), field_text(got, name)
        if a != b:
            at = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            lo = max(0, at - 8)
            out.append(FieldDiff(name, at, a[lo:at + 24], b[lo:at + 24]))
    return out
