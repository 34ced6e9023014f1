"""Servers' output parsers judged: what a server makes of text the model really emits.

The scripted fixture (``harness.fixtures.scripted``) writes each script's text greedily; a server
asked for the script's conversation on ``/v1/chat/completions`` (temperature 0, streamed or not)
splits that text into ``reasoning_content``, ``content`` and ``tool_calls``. Each field is compared
with the script's hand-written ``expected`` fields, which the harness's own parser of the
template's grammar (``harness.measure.chat_parse``) reproduces (its tests hold it to them). A
FAIL names the script, the mode, the field and its first differing character.

Normalization before comparing (what an OpenAI client reads): a missing or null
``reasoning_content`` or ``content`` is ""; ``tool_calls`` are ``[{name, arguments}]`` with the
arguments' JSON string parsed (left as the string where it does not parse); a stream's deltas are
concatenated per field and per tool-call index.

Errors: ``EngineError`` (one line) for a server that does not answer or answers malformed JSON.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Iterable

from harness.errors import EngineError, Verdict
from harness.measure.chat_parse import FieldDiff, compare_fields

MAX_TOKENS = 256
"""Generation cap per request: every script is shorter."""


def _calls(raw: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for c in raw:
        f = c.get("function") or {}
        args: Any = f.get("arguments")
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except ValueError:
                pass
        out.append({"name": f.get("name"), "arguments": args})
    return out


def fields_of_message(message: dict[str, Any]) -> dict[str, Any]:
    """The three fields of a non-streamed ``choices[0].message`` (module docstring's normalization)."""
    return {"reasoning_content": message.get("reasoning_content") or "", "content": message.get("content") or "",
            "tool_calls": _calls(message.get("tool_calls") or [])}


def fields_of_stream(chunks: Iterable[dict[str, Any]]) -> dict[str, Any]:
    """The three fields of a stream's ``choices[0].delta`` chunks, concatenated (tool calls by
    ``index``: the name from the first delta that has one, the argument pieces joined)."""
    reasoning, content, calls = [], [], {}
    for ch in chunks:
        for choice in ch.get("choices") or []:
            d = choice.get("delta") or {}
            reasoning.append(d.get("reasoning_content") or "")
            content.append(d.get("content") or "")
            for tc in d.get("tool_calls") or []:
                slot = calls.setdefault(tc.get("index", len(calls)), {"function": {"name": None, "arguments": ""}})
                f = tc.get("function") or {}
                slot["function"]["name"] = slot["function"]["name"] or f.get("name")
                slot["function"]["arguments"] += f.get("arguments") or ""
    return {"reasoning_content": "".join(reasoning), "content": "".join(content), "tool_calls": _calls(calls[k] for k in sorted(calls))}


def ask(url: str, script: Any, *, stream: bool, model: str = "scripted-qwen35", timeout_s: float = 120.0) -> dict[str, Any]:
    """The server at ``url``'s fields for ``script`` (``harness.fixtures.scripted.Script``):
    ``/v1/chat/completions`` with its messages, tools and ``chat_template_kwargs``, temperature 0,
    ``max_tokens`` ``MAX_TOKENS``. Raises ``EngineError`` (transport, status, malformed answer)."""
    import httpx

    body: dict[str, Any] = {"model": model, "messages": script.messages, "temperature": 0, "max_tokens": MAX_TOKENS,
                            "stream": stream, "chat_template_kwargs": dict(script.template_kwargs)}
    if script.tools:
        body["tools"] = script.tools
    try:
        with httpx.Client(timeout=timeout_s) as client:
            if not stream:
                r = client.post(url + "/v1/chat/completions", json=body)
                if r.status_code != 200:
                    raise EngineError(f"{url} answered HTTP {r.status_code} for script {script.id!r}: {r.text[:200]!r}")
                return fields_of_message(r.json()["choices"][0]["message"])
            chunks = []
            with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
                if r.status_code != 200:
                    raise EngineError(f"{url} answered HTTP {r.status_code} for script {script.id!r} (streamed)")
                for line in r.iter_lines():
                    if line.startswith("data:") and line[5:].strip() not in ("", "[DONE]"):
                        chunks.append(json.loads(line[5:]))
            return fields_of_stream(chunks)
    except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError) as e:
        raise EngineError(f"{url} gave no chat completion for script {script.id!r}: {type(e).__name__}: {str(e)[:200]}") from None


@dataclass
class ScriptResult:
    """One script in one mode: ``script``, ``stream``, ``got`` (the server's fields), ``diffs``
    (fields differing from ``expected``), ``verdict`` and one-line ``message``."""

    script: str
    stream: bool
    got: dict[str, Any]
    diffs: list[FieldDiff]

    @property
    def verdict(self) -> Verdict:
        return Verdict.FAIL if self.diffs else Verdict.PASS

    @property
    def message(self) -> str:
        mode = "streamed" if self.stream else "not streamed"
        if not self.diffs:
            return f"script {self.script!r} ({mode}): PASS"
        return f"script {self.script!r} ({mode}): FAIL: " + "; ".join(d.line() for d in self.diffs)


def judge(url: str, scripts: Iterable[Any], *, model: str = "scripted-qwen35") -> list[ScriptResult]:
    """Every script asked of the server at ``url`` not streamed and streamed, each compared with
    its ``expected`` fields (``compare_fields``). Raises ``EngineError`` as ``ask``."""
    out = []
    for s in scripts:
        for stream in (False, True):
            got = ask(url, s, stream=stream, model=model)
            out.append(ScriptResult(s.id, stream, got, compare_fields(s.expected, got)))
    return out
