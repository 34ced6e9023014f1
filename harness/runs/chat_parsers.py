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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable

from harness import display
from harness.errors import EngineError, Verdict
from harness.evidence.receipts import harness_info, host_info, prepare_receipt
from harness.evidence.record import preflight_evidence, record_evidence
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


# ----------------------------------------------------------------------------- harness chat-parsers: the run
SERVERS = ("llama-server", "llama-cpp-python")
"""The servers ``harness chat-parsers`` starts and judges (``--server``), in this order."""
REASONING_FORMATS = ("deepseek", "deepseek-legacy", "none", "auto")
"""llama-server's ``--reasoning-format`` values (``common/arg.cpp`` at the reference's commit)."""
DEFAULT_MODEL = "fixture:scripted-qwen35"
FIELDS = ("reasoning_content", "content", "tool_calls")


@dataclass(kw_only=True)
class ChatParsersRequest:
    """``harness chat-parsers``: the ``servers`` to start (``SERVERS``), llama-server's
    ``reasoning_format``, llama-cpp-python's ``chat_format`` (None: the handler it picks from the
    GGUF), the ``model`` (a scripted fixture of ``scripts``), the ``scripts`` folder (None: the
    shipped scripts), the ledger (None: the default), the command line recorded, whether to write
    evidence."""

    servers: tuple[str, ...] = SERVERS
    reasoning_format: str = "deepseek"
    chat_format: str | None = None
    model: str = DEFAULT_MODEL
    scripts: str | None = None
    ledger: str | None = None
    argv: list[str] = field(default_factory=list)
    write_evidence: bool = True


@dataclass
class ChatParsersRun:
    """One server's outcome: ``server``, its ``results`` (per script and mode; empty when
    UNMEASURED), ``verdict``, one-line ``message``, the ``receipt`` and where it went (path and
    ledger row; None for a dry run)."""

    server: str
    results: list[ScriptResult]
    verdict: Verdict
    message: str
    receipt: dict[str, Any]
    receipt_path: Any = None
    ledger_row: dict[str, Any] | None = None


def reference_fields(scripts: Iterable[Any]) -> dict[str, dict[str, Any]]:
    """Per script id, what the template's grammar says its output means (``harness.measure.chat_parse.parse``:
    thinking unless ``enable_thinking`` is false, the script's tools typing the arguments). Raises
    ``InvalidInput`` (one line) for a script whose hand-written ``expected`` fields differ from it:
    the script file, not a server, is wrong."""
    from harness.errors import InvalidInput
    from harness.measure.chat_parse import parse

    out = {}
    for s in scripts:
        got = parse(s.output, thinking=s.template_kwargs.get("enable_thinking", True) is not False, tools=s.tools).to_dict()
        diffs = compare_fields(s.expected, got)
        if diffs:
            raise InvalidInput(f"script {s.id!r}: its expected fields are not what the template's grammar makes of its output: {diffs[0].line()}")
        out[s.id] = got
    return out


def _reproduce(req: ChatParsersRequest, server: str) -> str:
    from harness.judge.reproducer import command

    argv = ["harness", "chat-parsers", "--server", server, "--model", req.model]
    if server == "llama-server":
        argv += ["--reasoning-format", req.reasoning_format]
    elif req.chat_format:
        argv += ["--chat-format", req.chat_format]
    if req.scripts:
        argv += ["--scripts", str(req.scripts)]
    return command(*argv)


def verdict_of(results: list[ScriptResult], reproduce: str) -> tuple[Verdict, str]:
    """FAIL naming the first differing script, mode, field and character and how many of the runs
    differ; PASS with the count; UNMEASURED when nothing was asked."""
    bad = [r for r in results if r.diffs]
    if bad:
        more = f" ({len(bad)} of {len(results)} script runs differ)" if len(bad) > 1 else ""
        return Verdict.FAIL, f"{display.plain(bad[0].message)}{more}; reproduce: {reproduce}"
    if not results:
        return Verdict.UNMEASURED, "no script was asked"
    n = len({r.script for r in results})
    return Verdict.PASS, f"all {n} scripts give the template grammar's reasoning, content and tool calls, streamed and not"


def _result_record(r: ScriptResult) -> dict[str, Any]:
    failed = {d.field for d in r.diffs}
    return {"script": r.script, "stream": r.stream, "verdict": r.verdict.value,
            "fields": {f: "FAIL" if f in failed else "PASS" for f in FIELDS}, "got": r.got,
            "diffs": [{"field": d.field, "at": d.at, "expected": d.expected, "got": d.got} for d in r.diffs],
            "message": r.message}


def _serve_llama_server(req: ChatParsersRequest, model: Any, scripts: list[Any]) -> tuple[dict[str, Any], list[ScriptResult]]:
    """llama-server started with ``--jinja --reasoning-format X`` on the model, asked every script;
    its record and results. Its version is ``/props``'s ``build_info`` with the llama.cpp commit of
    the build's ``COMMIT`` file where ``build_info`` lacks it (a build outside a git checkout says
    ``b0-unknown``)."""
    import httpx

    from harness.engines.llama_server import LlamaServer, build_commit, built_binary

    binary = built_binary()
    server = LlamaServer(model=model.path, binary=binary, parallel=1, n_ctx_slot=2048,
                         extra=["--jinja", "--reasoning-format", req.reasoning_format])
    with server:
        try:
            props = httpx.get(server.url + "/props", timeout=10).json()
        except (httpx.HTTPError, ValueError) as e:
            raise EngineError(f"llama-server gave no /props: {type(e).__name__}: {str(e)[:200]}") from None
        results = judge(server.url, scripts)
        cmd = server.command()
    commit = build_commit(Path(binary)) if binary else None
    built = display.plain(str(props.get("build_info") or "unknown"))
    info = {"name": "llama-server", "version": f"{built} (llama.cpp {commit[:12]})" if commit and commit[:7] not in built else built,
            "settings": {"jinja": True, "reasoning_format": req.reasoning_format, "temperature": 0, "max_tokens": MAX_TOKENS},
            "command": [str(x) for x in cmd], "build": {"commit": commit, "build_info": built, "binary": str(binary)}}
    return info, results


def _serve_llama_cpp_python(req: ChatParsersRequest, model: Any, scripts: list[Any]) -> tuple[dict[str, Any], list[ScriptResult]]:
    """llama-cpp-python's server on the model with the chat handler named (or the one it picks),
    asked every script; its record (the package's version, the handler) and results."""
    from harness.engines.llamacpp_python_server import LlamaCppPythonServer, chat_handler, version

    metadata = {k: model.raw_metadata(k) for k in ("tokenizer.chat_template",)}
    server = LlamaCppPythonServer(model=model.path, parallel=1, n_ctx_slot=2048, threads=1, model_alias="scripted-qwen35",
                                  chat_format=req.chat_format, verbose=False)
    with server:
        results = judge(server.url, scripts)
        cmd = server.command()
    info = {"name": "llama-cpp-python", "version": version() or "unknown",
            "settings": {"chat_handler": chat_handler(metadata, req.chat_format), "chat_format": req.chat_format,
                         "temperature": 0, "max_tokens": MAX_TOKENS},
            "command": [str(x) for x in cmd], "build": {}}
    return info, results


def _missing(server: str) -> str | None:
    from harness.engines import llama_server, llamacpp_python_server

    if server == "llama-server":
        if llama_server.built_binary() is None:
            return f"llama-server is not built for the installed llama-cpp-python: run `{llama_server.BUILD_COMMAND}`"
        return None
    return llamacpp_python_server.missing()


def _unmeasured_info(server: str, req: ChatParsersRequest) -> dict[str, Any]:
    from harness.engines.llamacpp_python_server import version

    settings: dict[str, Any] = ({"jinja": True, "reasoning_format": req.reasoning_format} if server == "llama-server"
                                else {"chat_format": req.chat_format})
    ver = version() if server == "llama-cpp-python" else None
    return {"name": server, "version": ver or "not available", "settings": settings, "command": [], "build": {}}


def run_chat_parsers(req: ChatParsersRequest, progress: Callable[[str], None] | None = None) -> list[ChatParsersRun]:
    """``harness chat-parsers`` (docs/engine-protocol.md, "Parsers judged"): per server of
    ``req.servers``, start it on the scripted fixture, ask each script not streamed and streamed
    at temperature 0, compare each field with the template grammar's (``reference_fields``), and
    record a ``harness-chat-parsers-receipt/v1`` and a ledger row of kind ``chat-parsers``. A
    server that cannot be started here (binary not built, server extra missing) is an UNMEASURED
    receipt naming why. Raises ``InvalidInput`` (an unknown server or reasoning format, a model
    that is not the scripts' scripted fixture, a malformed script), ``EngineError`` (a server
    that does not start or answers malformed)."""
    from harness.errors import InvalidInput
    from harness.evidence.receipts import CHAT_PARSERS_SCHEMA_ID
    from harness.fixtures.scripted import SCRIPTED_KEY, SCRIPTS_DIR, load_scripts, scripts_sha256
    from harness.runs.inputs import resolve_inputs

    for s in req.servers:
        if s not in SERVERS:
            raise InvalidInput(f"unknown server {s!r}: one of {', '.join(SERVERS)}")
    if req.reasoning_format not in REASONING_FORMATS:
        raise InvalidInput(f"unknown --reasoning-format {req.reasoning_format!r}: one of {', '.join(REASONING_FORMATS)}")
    folder = Path(req.scripts) if req.scripts else SCRIPTS_DIR
    scripts = load_scripts(folder)
    refs = reference_fields(scripts)
    inputs = resolve_inputs(req.model)
    sha = scripts_sha256(folder)
    marked = inputs.model.raw_metadata(SCRIPTED_KEY)
    if marked != sha:
        raise InvalidInput(f"{req.model}: not the scripted fixture of {folder} (its {SCRIPTED_KEY} is {display.plain(str(marked))[:16]!r}, "
                           f"the scripts' sha256 {sha[:16]}): its greedy output is not the scripts' texts (make scripted-fixture)")
    paths = preflight_evidence(req.ledger) if req.write_evidence else None
    runs = []
    for server in req.servers:
        if progress:
            progress(f"chat-parsers: starting {server} and asking {len(scripts)} scripts, not streamed and streamed")
        why = _missing(server)
        results: list[ScriptResult] = []
        if why:
            info, (verdict, message) = _unmeasured_info(server, req), (Verdict.UNMEASURED, f"{server}: {why}")
        else:
            serve = _serve_llama_server if server == "llama-server" else _serve_llama_cpp_python
            info, results = serve(req, inputs.model, scripts)
            verdict, message = verdict_of(results, _reproduce(req, server))
        receipt = {
            "schema": CHAT_PARSERS_SCHEMA_ID, "kind": "chat-parsers", "host": host_info(), "harness": harness_info(),
            "command": list(req.argv) or _reproduce(req, server).split(" "), "model": inputs.model_record(),
            "engines": {"candidate": {**info, "engine": server},
                        "reference": {"name": "harness chat_parse", "version": harness_info()["version"],
                                      "settings": {"grammar": "harness/data/chat/qwen35-think.jinja"}}},
            "scripts": {"path": str(folder.resolve()), "sha256": sha, "ids": [s.id for s in scripts], "expected": refs},
            "results": [_result_record(r) for r in results], "verdict": verdict.value, "message": message,
            "positions": len(results) * len(FIELDS), "unmeasured": message if verdict is Verdict.UNMEASURED else None,
        }
        if paths is None:
            runs.append(ChatParsersRun(server, results, verdict, message, prepare_receipt(receipt, {})))
            continue
        rec = record_evidence(receipt, {}, paths)
        runs.append(ChatParsersRun(server, results, verdict, message, rec.receipt, rec.receipt_path, rec.row))
    return runs
