"""The reference rendering of a chat conversation: the GGUF's ``tokenizer.chat_template`` rendered
by jinja2 the way llama.cpp's Jinja path renders it.

Pure: a template string and a conversation in, the prompt text out. The environment follows
llama.cpp's ``common/chat.cpp`` (its minja engine: ``trim_blocks`` and ``lstrip_blocks`` on,
the trailing newline dropped) and the Hugging Face ``apply_chat_template`` it mirrors, which
llama-cpp-python's ``Jinja2ChatFormatter`` also follows: a sandboxed, immutable environment
(``jinja2.sandbox.ImmutableSandboxedEnvironment``), the ``loopcontrols`` extension, a ``tojson``
filter that keeps non-ASCII characters (``json.dumps(ensure_ascii=False)``), the globals
``raise_exception`` (a template's own error: ``InvalidInput`` here) and ``strftime_now``, and
the variables ``messages``, ``tools``, ``add_generation_prompt``, ``bos_token``, ``eos_token``,
and a conversation's ``template_kwargs`` (template options such as ``enable_thinking``: the
``chat_template_kwargs`` of llama-server and transformers' extra ``apply_chat_template`` keyword
arguments). A key the template never reads, or one that would replace a variable the renderer
sets, is an error naming the conversation (``check_template_kwargs``): a misspelt option would
otherwise render as if it were unset.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from harness.errors import InvalidInput


@dataclass(frozen=True)
class Conversation:
    """One conversation of a set: ``id``, ``messages`` (OpenAI-style dicts: ``role``,
    ``content``, optional ``tool_calls``), ``tools`` (OpenAI function tools, None without) and
    ``add_generation_prompt`` (default true: the prompt ends with the assistant's header) and
    ``template_kwargs`` (template options, e.g. ``{"enable_thinking": false}``; empty without)."""

    id: str
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None
    add_generation_prompt: bool = True
    template_kwargs: dict[str, Any] = field(default_factory=dict)

    def to_request(self) -> dict[str, Any]:
        """The conversation as a protocol-2 ``render`` request's fields (docs/engine-protocol.md)."""
        return {"messages": self.messages, "tools": self.tools, "add_generation_prompt": self.add_generation_prompt,
                "template_kwargs": dict(self.template_kwargs)}

    def cut(self, k: int, add_generation_prompt: bool = True) -> "Conversation":
        """The conversation's first ``k`` messages, tools and options kept."""
        return Conversation(self.id, self.messages[:k], self.tools, add_generation_prompt, dict(self.template_kwargs))


def load_conversations(path: str | Path) -> list[Conversation]:
    """The conversations of a JSON file: a list of ``{"id", "messages", "tools"?,
    "add_generation_prompt"?, "template_kwargs"?}``. Raises ``InvalidInput`` for an unreadable file, a malformed entry
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
              and isinstance(c.get("add_generation_prompt", True), bool)
              and isinstance(c.get("template_kwargs", {}), dict))
        if not ok:
            raise InvalidInput(f"{p}: entry {i} is not {{id, messages: [{{role, content}}], tools?, add_generation_prompt?, template_kwargs?: {{}}}}")
        if c["id"] in seen:
            raise InvalidInput(f"{p}: conversation id {c['id']!r} repeats")
        seen.add(c["id"])
        out.append(Conversation(c["id"], c["messages"], c.get("tools"), c.get("add_generation_prompt", True),
                                dict(c.get("template_kwargs", {}))))
    return out


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: tuple[str, str] | None = None,
            sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise_exception(message: str) -> None:
    raise InvalidInput(f"the chat template raised: {message}")


RENDERER_VARIABLES = frozenset({"messages", "tools", "add_generation_prompt", "bos_token", "eos_token",
                                "raise_exception", "strftime_now"})
"""What the renderer itself sets; a ``template_kwargs`` key may not replace one."""


def _environment() -> Any:
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(loader=jinja2.BaseLoader(), trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda f: datetime.now().strftime(f)
    return env


def template_variables(template: str) -> frozenset[str]:
    """The names ``template`` reads from its context (``jinja2.meta.find_undeclared_variables``,
    less the names the template assigns itself anywhere: jinja2 counts a variable set inside a loop
    and read in a nested block as undeclared): the options a ``template_kwargs`` key may set.
    Raises ``InvalidInput`` when it does not parse."""
    import jinja2
    import jinja2.meta
    from jinja2 import nodes

    try:
        ast = _environment().parse(template)
    except jinja2.TemplateError as e:
        raise InvalidInput(f"the chat template does not parse: {type(e).__name__}: {e}") from None
    assigned = {n.name for a in ast.find_all((nodes.Assign, nodes.AssignBlock, nodes.For)) for n in a.target.find_all(nodes.Name)}
    assigned |= {a.target.name for a in ast.find_all(nodes.Assign) if isinstance(a.target, nodes.Name)}
    return frozenset(jinja2.meta.find_undeclared_variables(ast) - assigned)


def check_template_kwargs(template: str, conversation: Conversation) -> None:
    """Raise ``InvalidInput`` naming the conversation when one of its ``template_kwargs`` keys is
    a variable the renderer sets (``RENDERER_VARIABLES``) or one ``template`` never reads (a
    misspelt option renders as if unset, silently)."""
    if not conversation.template_kwargs:
        return
    known = template_variables(template)
    for key in conversation.template_kwargs:
        if key in RENDERER_VARIABLES:
            raise InvalidInput(f"conversation {conversation.id!r}: template_kwargs key {key!r} would replace a variable the renderer sets")
        if key not in known:
            raise InvalidInput(f"conversation {conversation.id!r}: template_kwargs key {key!r} is not read by the chat template "
                               f"(it reads: {', '.join(sorted(known - RENDERER_VARIABLES)) or 'no options'})")


def object_arguments(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``messages`` with every tool call's ``function.arguments`` given as a JSON string replaced
    by the object it encodes (a copy; a string that is not a JSON object stays as it is). llama.cpp
    does this before rendering a template that reads arguments as an object (``common/chat.cpp``
    ``func_args_not_string``), and Qwen3.5's XML tool calls need the object; transformers and
    llama-cpp-python pass OpenAI's string through, so such a template fails there (a named
    finding: tests/test_chat_reasoning.py)."""
    out = []
    for m in messages:
        calls = m.get("tool_calls") if isinstance(m, dict) else None
        if not isinstance(calls, list):
            out.append(m)
            continue
        fixed = []
        for c in calls:
            f = c.get("function") if isinstance(c, dict) else None
            if isinstance(f, dict) and isinstance(f.get("arguments"), str):
                try:
                    obj = json.loads(f["arguments"])
                except ValueError:
                    obj = None
                if isinstance(obj, dict):
                    c = {**c, "function": {**f, "arguments": obj}}
            fixed.append(c)
        out.append({**m, "tool_calls": fixed})
    return out


def render(template: str, conversation: Conversation, *, bos_token: str = "", eos_token: str = "",
           parse_arguments: bool = True) -> str:
    """``template`` (a GGUF's ``tokenizer.chat_template``) rendered for ``conversation`` (module
    docstring: llama.cpp's Jinja path), its ``template_kwargs`` passed as template variables.
    ``bos_token``/``eos_token``: the texts of the vocabulary's BOS and EOS tokens ("" when it has
    none). Raises ``InvalidInput``, naming the conversation, when the template does not parse,
    raises (``raise_exception``) or fails while rendering, or a ``template_kwargs`` key is unknown
    (``check_template_kwargs``). ``parse_arguments`` (default, llama.cpp's way): tool-call
    arguments given as JSON strings are rendered as objects (``object_arguments``); false renders
    the messages as given, as transformers does."""
    import jinja2

    check_template_kwargs(template, conversation)
    try:
        compiled = _environment().from_string(template)
        messages = object_arguments(conversation.messages) if parse_arguments else conversation.messages
        return compiled.render(**conversation.template_kwargs, messages=messages, tools=conversation.tools,
                               add_generation_prompt=conversation.add_generation_prompt,
                               bos_token=bos_token, eos_token=eos_token)
    except InvalidInput as e:
        raise InvalidInput(f"conversation {conversation.id!r}: {e}") from None
    except jinja2.TemplateError as e:
        raise InvalidInput(f"the chat template does not render conversation {conversation.id!r}: {type(e).__name__}: {e}") from None
    except Exception as e:  # a template's own Python-level failure (e.g. a method of a wrong type)
        raise InvalidInput(f"the chat template does not render conversation {conversation.id!r}: {type(e).__name__}: {e}") from None
