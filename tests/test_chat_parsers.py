"""The scripted fixture (harness.fixtures.scripted), the harness's parser of the think template's
grammar (harness.measure.chat_parse) against the scripts' hand-written fields, planted parser
faults, and real servers' parsers judged (harness.runs.chat_parsers)."""

from __future__ import annotations

import pytest

from harness.fixtures.scripted import TEMPLATE, load_scripts, scripted_path
from harness.measure.chat_parse import FAULTS, compare_fields, parse
from harness.measure.chat_template import render

SCRIPTS = {s.id: s for s in load_scripts()}


def _parse(s, fault=None):
    return parse(s.output, thinking=s.template_kwargs.get("enable_thinking", True) is not False, tools=s.tools, fault=fault)


def test_the_scripts_cover_the_issue_and_repeat_tokens_with_different_successors():
    assert list(SCRIPTS) == ["think-close-bare", "think-close-newline", "think-empty", "no-think", "text-before-tool-call",
                             "two-tool-calls", "think-unclosed"]
    bare, newline = SCRIPTS["think-close-bare"].output, SCRIPTS["think-close-newline"].output
    shared = "7 has no divisors but 1 and 7."
    assert bare.startswith(shared + "</think>\n") and newline.startswith(shared + "\n</think>\n")  # same text, two successors
    assert "</think>" not in SCRIPTS["think-unclosed"].output and "Oslo\n</parameter>\n<parameter=days>" in SCRIPTS["two-tool-calls"].output


@pytest.mark.parametrize("sid", list(SCRIPTS))
def test_the_harness_parser_gives_each_scripts_hand_written_fields(sid):
    s = SCRIPTS[sid]
    assert _parse(s).to_dict() == s.expected


def test_planted_parsers_fail_naming_the_field():
    def diffs(sid, fault):
        return {d.field: d for d in compare_fields(SCRIPTS[sid].expected, _parse(SCRIPTS[sid], fault).to_dict())}

    assert set(FAULTS) == {"needs-newline-close", "leaks-close", "json-tool-calls"}
    # a parser that needs "\n</think>\n": a bare close is missed and the tool call is lost (llama.cpp #20260)
    d = diffs("text-before-tool-call", "needs-newline-close")
    assert set(d) == {"reasoning_content", "content", "tool_calls"} and d["reasoning_content"].at == len("The user wants the weather.")
    assert diffs("think-close-newline", "needs-newline-close") == {}
    # a parser that leaks "</think>" into the content (vLLM #39697)
    d = diffs("think-close-bare", "leaks-close")
    assert set(d) == {"content"} and d["content"].at == 0 and d["content"].got.startswith("</think>")
    assert "content differs at character 0: expected 'Yes, 7 is prime.' | got '</think>\\nYes, 7 is prime'" in d["content"].line()
    # a tool-call parser that expects JSON (ollama PR #14603): no calls, the XML left in the content
    d = diffs("two-tool-calls", "json-tool-calls")
    assert set(d) == {"content", "tool_calls"} and d["content"].got == "<tool_call>\n<function=ge"
    assert d["tool_calls"].at == 1 and d["tool_calls"].got == "[]"


def test_llama_cpps_greedy_output_is_each_script_exactly():
    from llama_cpp import Llama

    m = Llama(str(scripted_path()), n_ctx=2048, verbose=False, n_threads=1)
    template = TEMPLATE.read_text(encoding="utf-8")
    for s in SCRIPTS.values():
        ids = m.tokenize(render(template, s.conversation()).encode(), add_bos=False, special=True)
        out = []
        m.reset()
        for t in m.generate(ids, temp=0.0, top_k=1):
            if t == m.token_eos() or len(out) > 300:
                break
            out.append(t)
        assert m.detokenize(out).decode("utf-8") == s.output, s.id
        assert out and len(out) < 300  # it ended with the end-of-turn token


def test_llama_server_emits_each_script_after_its_own_generation_prompt():
    """The server's own rendering (/apply-template, --jinja) sent to /completion at temperature 0:
    the text is each script exactly, ended by the end-of-turn token, the prompt as long as the
    reference's rendering tokenized by llama.cpp."""
    import httpx

    from harness.engines.llama_server import LlamaServer, apply_template, built_binary
    from harness.runs.inputs import resolve_inputs

    if built_binary() is None:
        pytest.fail("llama-server is not built for the installed llama-cpp-python: run `make llama-server` (not run)")
    template = TEMPLATE.read_text(encoding="utf-8")
    ref = resolve_inputs(str(scripted_path())).tokenizer(None).tokenize_many(
        [render(template, s.conversation()) for s in SCRIPTS.values()], add_special=False, parse_special=True)
    with LlamaServer(model=scripted_path(), parallel=1, n_ctx_slot=2048, extra=["--jinja"]) as server:
        for s, ids in zip(SCRIPTS.values(), ref):
            prompt = apply_template(server.url, s.conversation())
            r = httpx.post(server.url + "/completion", json={"prompt": prompt, "temperature": 0, "n_predict": 256,
                                                              "cache_prompt": False}, timeout=60).json()
            assert (r["content"], r["stop_type"], r["tokens_evaluated"]) == (s.output, "eos", len(ids)), s.id


def test_malformed_scripts_and_conversations_are_one_line(tmp_path):
    from harness.errors import InvalidInput
    from harness.fixtures.scripted import load_scripts as load
    from harness.measure.chat_template import load_conversations

    (tmp_path / "a.json").write_text('{"id": "a", "messages": [], "output": "x", "expected": {"content": "x"}}')
    with pytest.raises(InvalidInput, match=r"a\.json: a script is \{id, messages"):
        load(tmp_path)
    (tmp_path / "a.json").write_text("{")
    with pytest.raises(InvalidInput, match=r"a\.json: cannot read a script"):
        load(tmp_path)
    (tmp_path / "c.json").write_text('[{"id": "c", "messages": [], "template_kwargs": ["enable_thinking"]}]')
    with pytest.raises(InvalidInput, match=r"entry 0 is not .*template_kwargs"):
        load_conversations(tmp_path / "c.json")


LLAMA_SERVER_FINDINGS = {
    # llama-server (llama.cpp 0c1e570, --jinja --reasoning-format deepseek; its Qwen3-Coder/Qwen3.5 PEG parser)
    # keeps the newline before "</think>" in reasoning_content and the blank line before
    # "<tool_call>" in content: whitespace the template's grammar does not count as either field
    "think-close-newline": {"reasoning_content": "7 has no divisors but 1 and 7.\n"},
    "text-before-tool-call": {"content": "Let me check.\n\n"},
}


def test_llama_server_parsers_judged_streamed_and_not():
    from harness.engines.llama_server import LlamaServer, built_binary
    from harness.runs.chat_parsers import judge

    if built_binary() is None:
        pytest.fail("llama-server is not built for the installed llama-cpp-python: run `make llama-server` (not run)")
    with LlamaServer(model=scripted_path(), parallel=1, n_ctx_slot=2048, extra=["--jinja", "--reasoning-format", "deepseek"]) as s:
        results = judge(s.url, SCRIPTS.values())
    assert len(results) == 14
    for r in results:
        want = {**SCRIPTS[r.script].expected, **LLAMA_SERVER_FINDINGS.get(r.script, {})}
        assert compare_fields(want, r.got) == [], r.message  # the server's fields, exactly
        assert (r.verdict.value == "FAIL") == (r.script in LLAMA_SERVER_FINDINGS), r.message
    bad = next(r for r in results if r.script == "think-close-newline")
    assert bad.message.startswith("script 'think-close-newline' (not streamed): FAIL: reasoning_content differs at character 30")
    # llama.cpp #20260 (a bare "</think>\n", text, then a tool call) does not reproduce at this commit:
    # the tool call is parsed, streamed and not
    tool = [r for r in results if r.script == "text-before-tool-call"]
    assert all(r.got["tool_calls"] == [{"name": "get_weather", "arguments": {"city": "Oslo"}}] for r in tool)


def test_llama_cpp_python_server_parsers_judged_streamed_and_not():
    """llama-cpp-python 0.3.36's server with the GGUF's template (chat handler
    'chat_template.default', Jinja2ChatFormatter): no reasoning parser (the reasoning and the
    '</think>' marker stay in the content: vLLM #39697's symptom, ollama PR #17078's leaked empty
    block), no XML tool-call parser (ollama PR #14603's symptom), and a request's
    chat_template_kwargs ignored, so the no-thinking scripts get the thinking prompt."""
    pytest.importorskip("llama_cpp.server.app", reason="needs llama-cpp-python's server extra (pip install -e .[server])")
    from test_http_engine import llama_cpp_server

    from harness.runs.chat_parsers import judge

    with llama_cpp_server(scripted_path(), alias="scripted-qwen35") as url:
        results = judge(url, SCRIPTS.values())
    by = {(r.script, r.stream): r for r in results}
    assert all(r.verdict.value == "FAIL" for r in results)
    for stream in (False, True):
        assert by[("think-close-bare", stream)].got == {"reasoning_content": "", "content": SCRIPTS["think-close-bare"].output, "tool_calls": []}
        assert by[("think-empty", stream)].got["content"] == "\n</think>\n\nHi."
        assert by[("no-think", stream)].got["content"] == "\n</think>\n\nHi."  # enable_thinking=false ignored
        tool = by[("text-before-tool-call", stream)]
        assert tool.got["tool_calls"] == [] and "<tool_call>\n<function=get_weather>" in tool.got["content"]
        assert [d.field for d in tool.diffs] == ["reasoning_content", "content", "tool_calls"]


# ------------------------------------------------------------------ lint, sign-off, generation defaults
def test_lint_reports_the_scripted_fixture_and_a_signoff_refuses_it(tmp_path, monkeypatch, capsys):
    from harness.model.lint import lint_path
    from test_release import make_project, signoff_json

    report = lint_path(scripted_path())
    assert [(f.code, f.severity) for f in report.findings] == [("QL601", "info")] and report.exit_code == 0
    root = make_project(tmp_path / "p", ["oracle"], ["scripted-qwen35"])
    rc, doc = signoff_json(root, capsys, monkeypatch)
    lint = [i for i in doc["items"] if i["what"] == "lint"]
    assert rc == 1 and [(i["status"], i["label"]) for i in lint] == [("failed", "fixture:scripted-qwen35")]
    assert "scripted fixture" in lint[0]["detail"] and "not a release model" in lint[0]["detail"]


def test_lint_reports_declared_generation_defaults_and_llama_server_applies_them(tmp_path):
    """gguf-py's general.sampling.* keys (top_k, top_p, min_p, temp, penalty_repeat, ...): lint names
    what a file declares (QL602), and that no key carries a presence penalty; llama-server at this
    commit reads them as its defaults (its /props default_generation_settings)."""
    import httpx

    from harness.engines.llama_server import LlamaServer, built_binary
    from harness.fixtures.synthetic import add_chat_template
    from harness.model.lint import SAMPLING_KEYS, lint_path

    assert "general.sampling.top_k" in SAMPLING_KEYS and not any("presence" in k for k in SAMPLING_KEYS)
    path = add_chat_template(scripted_path(), TEMPLATE.read_text(encoding="utf-8"), tmp_path / "defaults.gguf", "defaults", extra={
        "general.sampling.temp": ("f32", 0.6), "general.sampling.top_k": ("i32", 20), "general.sampling.top_p": ("f32", 0.95)})
    found = {f.code: f for f in lint_path(path).findings}
    assert set(found) == {"QL601", "QL602"} and found["QL602"].severity == "info"
    assert "generation defaults declared: temp=0.6" in found["QL602"].message and "top_k=20" in found["QL602"].message
    assert "no GGUF key carries a presence penalty" in found["QL602"].message
    if built_binary() is None:
        pytest.fail("llama-server is not built for the installed llama-cpp-python: run `make llama-server` (not run)")
    with LlamaServer(model=path, parallel=1, n_ctx_slot=1024, extra=["--jinja"]) as s:
        params = httpx.get(s.url + "/props", timeout=10).json()["default_generation_settings"]["params"]
    assert params["top_k"] == 20 and abs(params["top_p"] - 0.95) < 1e-6 and abs(params["temperature"] - 0.6) < 1e-6
    assert params["presence_penalty"] == 0.0  # nothing in the file can set it


# ------------------------------------------------------------------ harness chat-parsers: the command, its receipt and row
def _receipts(folder):
    import json

    return [json.loads(p.read_text()) for p in sorted(folder.glob("receipts/*/*.json"))]


def test_the_command_judges_llama_server_end_to_end_with_receipt_row_and_page(tmp_path, capsys):
    """``harness chat-parsers --server llama-server``: exit 1, per script and field PASS/FAIL on
    the terminal, each FAIL naming the field and first differing character (escaped); a receipt
    with the server's version (its /props build_info and the build's llama.cpp commit), a ledger
    row of kind chat-parsers that verifies, and a verdict page."""
    from harness.cli import main
    from harness.engines.llama_server import build_commit, built_binary
    from harness.evidence.report import write_report
    from harness.evidence.verify import verify_ledger

    if built_binary() is None:
        pytest.fail("llama-server is not built for the installed llama-cpp-python: run `make llama-server` (not run)")
    ledger = tmp_path / "ledger.jsonl"
    assert main(["chat-parsers", "--server", "llama-server", "--reasoning-format", "deepseek", "--ledger", str(ledger)]) == 1
    out = capsys.readouterr().out
    assert "FAIL think-close-newline (not streamed) reasoning_content: first difference at character 30: expected '1 and 7.' | got '1 and 7.\\n'" in out
    assert "FAIL text-before-tool-call (streamed) content: first difference at character 13: expected 'e check.' | got 'e check.\\n\\n'" in out
    assert "reproduce: harness chat-parsers --server llama-server --model fixture:scripted-qwen35 --reasoning-format deepseek" in out
    [rec] = _receipts(tmp_path)
    cand = rec["engines"]["candidate"]
    commit = build_commit(built_binary())
    assert (rec["kind"], rec["verdict"], rec["positions"], cand["name"]) == ("chat-parsers", "FAIL", 42, "llama-server")
    assert commit and commit[:12] in cand["version"] and cand["build"]["commit"] == commit and cand["build"]["build_info"]
    assert cand["settings"]["reasoning_format"] == "deepseek" and "--jinja" in cand["command"] and "deepseek" in cand["command"]
    failed = {(r["script"], r["stream"]): [f for f, v in r["fields"].items() if v == "FAIL"] for r in rec["results"]}
    assert len(failed) == 14 and {k: v for k, v in failed.items() if v} == {
        ("think-close-newline", False): ["reasoning_content"], ("think-close-newline", True): ["reasoning_content"],
        ("text-before-tool-call", False): ["content"], ("text-before-tool-call", True): ["content"]}
    assert rec["scripts"]["expected"] == {s.id: s.expected for s in SCRIPTS.values()}
    rows = [__import__("json").loads(ln) for ln in ledger.read_text().splitlines()]
    assert [(r["kind"], r["verdict"], r["positions"], r["candidate"]) for r in rows] == [("chat-parsers", "FAIL", 42, f"llama-server {cand['version']}")]
    assert verify_ledger(ledger) == []  # deep: the row re-derived from the receipt
    page = write_report(next(tmp_path.glob("receipts/*/*.json"))).read_text()
    assert "chat parsers of llama-server" in page and "| 'think-close-newline' | not streamed | reasoning\\_content | 30 |" in page
    assert "`harness chat-parsers --server llama-server --model fixture:scripted-qwen35 --reasoning-format deepseek --ledger" in page
    assert "7 scripts, 42 fields compared" in page and " prompts, " not in page  # provenance counts what it compared


def test_the_command_judges_the_llama_cpp_python_server_naming_its_chat_handler(tmp_path, capsys):
    """``harness chat-parsers --server llama-cpp-python``: every script run FAILs (no reasoning or
    XML tool-call parser; chat_template_kwargs ignored); the receipt names the package's version
    and the handler that answered (the GGUF's template: ``chat_template.default``)."""
    pytest.importorskip("llama_cpp.server.app", reason="needs llama-cpp-python's server extra (pip install -e .[server])")
    from importlib import metadata

    from harness.cli import main

    assert main(["chat-parsers", "--server", "llama-cpp-python", "--ledger", str(tmp_path / "ledger.jsonl")]) == 1
    out = capsys.readouterr().out
    assert "FAIL no-think (not streamed) content: first difference at character 0: expected 'Hi.' | got '\\n</think>\\n\\nHi.'" in out
    [rec] = _receipts(tmp_path)
    cand = rec["engines"]["candidate"]
    assert (cand["name"], cand["version"], cand["settings"]["chat_handler"]) == ("llama-cpp-python", metadata.version("llama-cpp-python"), "chat_template.default")
    assert rec["verdict"] == "FAIL" and all(r["verdict"] == "FAIL" for r in rec["results"]) and len(rec["results"]) == 14
    tool = next(r for r in rec["results"] if r["script"] == "two-tool-calls" and r["stream"])
    assert tool["fields"] == {"reasoning_content": "PASS", "content": "FAIL", "tool_calls": "FAIL"} and tool["got"]["tool_calls"] == []


def test_a_server_that_cannot_start_here_is_unmeasured_never_pass(tmp_path, monkeypatch, capsys):
    """No llama-server binary and no server extra: exit 5, an UNMEASURED receipt per server naming
    what to build or install, and nothing started."""
    from harness.cli import main
    from harness.engines import llamacpp_python_server

    monkeypatch.setenv("HARNESS_LLAMA_SERVER", str(tmp_path / "no-such-llama-server"))
    monkeypatch.setattr(llamacpp_python_server, "missing", lambda: "llama-cpp-python's server extra is not installed: no module 'uvicorn'")
    assert main(["chat-parsers", "--ledger", str(tmp_path / "ledger.jsonl")]) == 5
    out = capsys.readouterr().out
    assert "llama-server: UNMEASURED: llama-server: llama-server is not built for the installed llama-cpp-python: run `make llama-server`" in out
    assert "llama-cpp-python: UNMEASURED: llama-cpp-python: llama-cpp-python's server extra is not installed" in out
    recs = {r["engines"]["candidate"]["name"]: r for r in _receipts(tmp_path)}
    assert set(recs) == {"llama-server", "llama-cpp-python"}
    assert all(r["verdict"] == "UNMEASURED" and r["results"] == [] and r["positions"] == 0 and r["unmeasured"] for r in recs.values())
    assert recs["llama-server"]["engines"]["candidate"]["version"] == "not available"


def test_wrong_model_or_script_is_one_line_exit_2(tmp_path, capsys):
    """A model that is not the scripts' scripted fixture, and a script whose hand-written fields
    are not what the grammar makes of its text: one line, exit 2, before any server starts."""
    import json
    import shutil

    from harness.cli import main
    from harness.fixtures.scripted import SCRIPTS_DIR

    assert main(["chat-parsers", "--model", "fixture:tiny-qwen35", "--no-evidence"]) == 2
    err = capsys.readouterr().err
    assert "harness: INVALID: fixture:tiny-qwen35: not the scripted fixture of" in err and len(err.strip().splitlines()) == 1
    shutil.copytree(SCRIPTS_DIR, tmp_path / "s")
    p = tmp_path / "s" / "01-think-close-bare.json"
    d = json.loads(p.read_text())
    d["expected"]["content"] = "Yes, 7 is prime!"
    p.write_text(json.dumps(d))
    assert main(["chat-parsers", "--scripts", str(tmp_path / "s"), "--no-evidence"]) == 2
    err = capsys.readouterr().err
    assert "script 'think-close-bare': its expected fields are not what the template's grammar makes of its output: content differs at character 15" in err


def test_the_commands_choices_are_the_runs():
    from harness.cli.runs import CHAT_FIELDS, CHAT_SERVERS, REASONING_FORMATS
    from harness.runs import chat_parsers

    assert (CHAT_SERVERS, REASONING_FORMATS, CHAT_FIELDS) == (chat_parsers.SERVERS, chat_parsers.REASONING_FORMATS, chat_parsers.FIELDS)
