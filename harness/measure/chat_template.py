"""The reference rendering of a chat conversation: the GGUF's ``tokenizer.chat_template`` rendered
by jinja2 the way llama.cpp's Jinja path renders it.

Pure: a template string and a conversation in, the prompt text out. The environment follows
llama.cpp's ``common/chat.cpp`` (its minja engine: ``trim_blocks`` and ``lstrip_blocks`` on,
the trailing newline dropped) and the Hugging Face ``apply_chat_template`` it mirrors, which
llama-cpp-python's ``Jinja2ChatFormatter`` also follows: a sandboxed, immutable environment
(``jinja2.sandbox.ImmutableSandboxedEnvironment``), the ``loopcontrols`` extension, a ``tojson``
filter that keeps non-ASCII characters (``json.dumps(ensure_ascii=False)``), the globals
``raise_exception`` (a template's own error: ``InvalidInput`` here) and ``strftime_now``, and
the variables ``messages``, ``tools``, ``add_generation_prompt``, ``bos_token``, ``eos_token``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from harness.errors import InvalidInput


@dataclass(frozen=True)
class Conversation:
    """One conversation of a set: ``id``, ``messages`` (OpenAI-style dicts: ``role``,
    ``content``, optional ``tool_calls``), ``tools`` (OpenAI function tools, None without) and
    ``add_generation_prompt`` (default true: the prompt ends with the assistant's header)."""

    id: str
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None
    add_generation_prompt: bool = True

    def to_request(self) -> dict[str, Any]:
        """The conversation as a protocol-2 ``render`` request's fields (docs/engine-protocol.md)."""
        return {"messages": self.messages, "tools": self.tools, "add_generation_prompt": self.add_generation_prompt}


def load_conversations(path: str | Path) -> list[Conversation]:
    """The conversations of a JSON file: a list of ``{"id", "messages", "tools"?,
    "add_generation_prompt"?}``. Raises ``InvalidInput`` for an unreadable file, a malformed entry
    or a repeated id."""
    p = Path(path)
    try:
        raw = json.loads(p.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise InvalidInput(f"{p}: cannot read a conversation set: {e}") from None
    if not isinstance(raw, list):
        raise InvalidInput(f"{p}: a conversation set is a JSON list")
    out, seen = [], set()
    for i, c in enumerate(raw):
        ok = (isinstance(c, dict) and isinstance(c.get("id"), str) and isinstance(c.get("messages"), list)
              and all(isinstance(m, dict) and isinstance(m.get("role"), str) for m in c["messages"])
              and (c.get("tools") is None or isinstance(c["tools"], list))
              and isinstance(c.get("add_generation_prompt", True), bool))
        if not ok:
            raise InvalidInput(f"{p}: entry {i} is not {{id, messages: [{{role, content}}], tools?, add_generation_prompt?}}")
        if c["id"] in seen:
            raise InvalidInput(f"{p}: conversation id {c['id']!r} repeats")
        seen.add(c["id"])
        out.append(Conversation(c["id"], c["messages"], c.get("tools"), c.get("add_generation_prompt", True)))
    return out


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: tuple[str, str] | None = None,
            sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise_exception(message: str) -> None:
    raise InvalidInput(f"the chat template raised: {message}")


def render(template: str, conversation: Conversation, *, bos_token: str = "", eos_token: str = "") -> str:
    """``template`` (a GGUF's ``tokenizer.chat_template``) rendered for ``conversation`` (module
    docstring: llama.cpp's Jinja path). ``bos_token``/``eos_token``: the texts of the vocabulary's
    BOS and EOS tokens ("" when it has none). Raises ``InvalidInput`` when the template does not
    parse, raises (``raise_exception``) or fails while rendering."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(loader=jinja2.BaseLoader(), trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda f: datetime.now().strftime(f)
    try:
        compiled = env.from_string(template)
        return compiled.render(messages=conversation.messages, tools=conversation.tools,
                               add_generation_prompt=conversation.add_generation_prompt,
                               bos_token=bos_token, eos_token=eos_token)
    except InvalidInput:
        raise
    except jinja2.TemplateError as e:
        raise InvalidInput(f"the chat template does not render conversation {conversation.id!r}: {type(e).__name__}: {e}") from None
