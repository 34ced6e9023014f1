#!/usr/bin/env python3
"""A render-only engine: chat conversations rendered by llama-cpp-python's own chat formatter
(docs/engine-protocol.md, "Tokenizers"), for the harness's chat-template check.

Written the way an engine author wires a GGUF's chat template: read ``tokenizer.chat_template``
and the BOS/EOS token texts with the ``gguf`` package and render each conversation with
``llama_cpp.llama_chat_format.Jinja2ChatFormatter`` (what llama-cpp-python's server does with the
same file). Imports nothing from the harness. Protocol 2 (``--serve``), op ``render`` only:
``rendered.txt``.

One planted fault, one flag, reproduces a real template bug (the check must FAIL it, naming
the first differing character):

- ``--drop-later-system``: every system message after the first is dropped before rendering
  (opencode #15059: a template that cannot take a second system message).
- ``--ignore-template-kwargs``: the request's template options (``template_kwargs``, e.g.
  ``enable_thinking``) are not passed to the template, so a no-thinking generation prompt loses
  its closed empty ``<think>`` block (ollama PR #17078: ``think=false`` ignored).
"""

import argparse
import json
import sys
from pathlib import Path

import gguf
from llama_cpp.llama_chat_format import Jinja2ChatFormatter


def _field(reader, key):
    f = reader.fields.get(key)
    return None if f is None else f.contents()


def _object_arguments(message):
    """OpenAI's tool-call arguments (a JSON string) as the object a template with XML tool calls
    iterates, as llama.cpp does before rendering (common/chat.cpp ``func_args_not_string``);
    Jinja2ChatFormatter alone passes the string through and such a template fails on it."""
    calls = message.get("tool_calls")
    if not isinstance(calls, list):
        return message
    fixed = []
    for call in calls:
        f = call.get("function") if isinstance(call, dict) else None
        if isinstance(f, dict) and isinstance(f.get("arguments"), str):
            try:
                args = json.loads(f["arguments"])
            except ValueError:
                args = None
            if isinstance(args, dict):
                call = {**call, "function": {**f, "arguments": args}}
        fixed.append(call)
    return {**message, "tool_calls": fixed}


class Template:
    """The GGUF's chat template and BOS/EOS texts (``""`` where the vocabulary has none)."""

    def __init__(self, model_path):
        r = gguf.GGUFReader(model_path)
        self.template = _field(r, "tokenizer.chat_template")
        if self.template is None:
            raise ValueError(f"{model_path} has no tokenizer.chat_template")
        tokens = _field(r, "tokenizer.ggml.tokens")
        bos, eos = _field(r, "tokenizer.ggml.bos_token_id"), _field(r, "tokenizer.ggml.eos_token_id")
        self.bos = tokens[bos] if bos is not None else ""
        self.eos = tokens[eos] if eos is not None else ""

    def render(self, messages, tools, add_generation_prompt, template_kwargs, drop_later_system=False):
        if drop_later_system:
            first = next((i for i, m in enumerate(messages) if m.get("role") == "system"), None)
            messages = [m for i, m in enumerate(messages) if m.get("role") != "system" or i == first]
        messages = [_object_arguments(m) for m in messages]
        fmt = Jinja2ChatFormatter(self.template, eos_token=self.eos, bos_token=self.bos, add_generation_prompt=add_generation_prompt)
        return fmt(messages=messages, tools=tools, **template_kwargs).prompt


def serve(args):
    """Protocol 2: one JSON request per stdin line, one reply per stdout line."""
    tpl = None
    for line in sys.stdin:
        req = json.loads(line)
        try:
            if req.get("op") == "shutdown":
                reply = {"ok": True, "files": []}
            elif req.get("op") != "render":
                reply = {"ok": False, "error": f"this engine only renders chat conversations (op {req.get('op')!r})"}
            else:
                if tpl is None or tpl.path != req["model"]:
                    tpl = Template(req["model"])
                    tpl.path = req["model"]
                out = Path(req["out_dir"])
                kwargs = {} if args.ignore_template_kwargs else dict(req.get("template_kwargs") or {})
                text = tpl.render(req["messages"], req.get("tools"), bool(req.get("add_generation_prompt", True)), kwargs,
                                  args.drop_later_system)
                (out / "rendered.txt").write_bytes(text.encode("utf-8"))
                (out / "info.json").write_text(json.dumps({"name": "example-chat-template", "version": "1",
                                                           "settings": {"drop_later_system": args.drop_later_system,
                                                                        "ignore_template_kwargs": args.ignore_template_kwargs}}))
                reply = {"ok": True, "files": ["rendered.txt", "info.json"]}
        except Exception as e:  # the harness shows the message; the engine keeps serving
            reply = {"ok": False, "error": f"{type(e).__name__}: {e}"}
        sys.stdout.write(json.dumps({"id": req.get("id"), **reply}) + "\n")
        sys.stdout.flush()
        if req.get("op") == "shutdown":
            return


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--serve", action="store_true", required=True)
    ap.add_argument("--drop-later-system", action="store_true", help="planted fault: drop every system message after the first")
    ap.add_argument("--ignore-template-kwargs", action="store_true",
                    help="planted fault: render without the request's template options (enable_thinking ignored)")
    serve(ap.parse_args())
