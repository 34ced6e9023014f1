"""The harness's Qwen3.5-style chat template (harness/data/chat/qwen35-think.jinja, carried by
fixture:trained-qwen35-think): its features as rendered by jinja2, template options
(template_kwargs) through every renderer, and its renderings by llama.cpp's own template engine
(llama-server --jinja, /apply-template), with each difference named."""

from __future__ import annotations

import pytest

from harness.errors import InvalidInput, Verdict
from harness.fixtures.resolve import resolve_model
from harness.measure.chat_template import Conversation, load_conversations, render
from harness.model.gguf_model import GGUFModel
from harness.runs.tokenizer import CONVERSATIONS, REASONING_CONVERSATIONS, TokenizerRequest, conversations_for, run_tokenizer

THINK = "fixture:trained-qwen35-think"


@pytest.fixture(scope="module")
def template() -> str:
    return GGUFModel(resolve_model(THINK)).raw_metadata("tokenizer.chat_template")


@pytest.fixture(scope="module")
def convs(template) -> dict[str, Conversation]:
    return {c.id: c for c in conversations_for(template)}


@pytest.fixture
def in_repo(monkeypatch):
    from pathlib import Path

    monkeypatch.chdir(Path(__file__).resolve().parents[1])
    monkeypatch.delenv("HARNESS_CONFIG", raising=False)


def test_the_think_fixture_gets_the_reasoning_set_and_the_chatml_one_does_not(template, convs):
    chatml = GGUFModel(resolve_model("fixture:trained-qwen35-chat")).raw_metadata("tokenizer.chat_template")
    assert len(conversations_for(chatml)) == len(load_conversations(CONVERSATIONS)) == 9
    assert len(convs) == 9 + len(load_conversations(REASONING_CONVERSATIONS)) == 17


def test_generation_prompts_thinking_on_off_and_unset(template, convs):
    head = "<|im_start|>user\nIs 91 prime?<|im_end|>\n<|im_start|>assistant\n"
    assert render(template, convs["think-on"]) == head + "<think>\n"
    assert render(template, convs["think-unset"]) == head + "<think>\n"  # thinking is the default
    assert render(template, convs["think-off"]) == head + "<think>\n\n</think>\n\n"  # the closed empty block


def test_reasoning_is_dropped_from_earlier_turns_and_kept_after_the_last_user_message(template, convs):
    earlier = render(template, convs["earlier-reasoning"])
    assert "91 = 7 * 13" not in earlier and "<|im_start|>assistant\nNo: 7 × 13.<|im_end|>" in earlier
    in_content = render(template, convs["earlier-reasoning-in-content"])
    assert "Two and two" not in in_content and "<|im_start|>assistant\n4<|im_end|>" in in_content
    last = render(template, convs["last-turn-reasoning"])
    assert last.endswith("<|im_start|>assistant\n<think>\n91 = 7 * 13.\n</think>\n\nNo.<|im_end|>\n")


def test_tools_in_the_system_turn_xml_tool_calls_and_grouped_responses(template, convs):
    text = render(template, convs["tool-call-after-text"])
    assert text.startswith("<|im_start|>system\nYou can look up the weather.\n\n# Tools\n")
    assert '\n{"type": "function", "function": {"name": "get_weather"' in text and "城市" in text
    assert ("<|im_start|>assistant\n<think>\nThe user wants the weather; call the tool.\n</think>\n\nLet me look that up.\n\n"
            "<tool_call>\n<function=get_weather>\n<parameter=city>\nZürich\n</parameter>\n</function>\n</tool_call><|im_end|>\n"
            "<|im_start|>user\n<tool_response>\n{\"temp_c\": 21}\n</tool_response><|im_end|>\n") in text
    two = render(template, convs["two-tool-calls"])
    assert ("<|im_start|>assistant\n<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n"
            "<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=get_time>\n") in two
    assert "<tool_response>\nrain\n</tool_response>\n<tool_response>\n14:05\n</tool_response><|im_end|>" in two


def test_an_unknown_option_or_a_raising_template_is_one_line_naming_the_conversation(template):
    typo = Conversation("typo", [{"role": "user", "content": "x"}], template_kwargs={"enable_thinkng": False})
    with pytest.raises(InvalidInput, match=r"^conversation 'typo': template_kwargs key 'enable_thinkng' is not read by the chat "
                                           r"template \(it reads: enable_thinking\)$"):
        render(template, typo)
    clash = Conversation("clash", [{"role": "user", "content": "x"}], template_kwargs={"messages": []})
    with pytest.raises(InvalidInput, match="conversation 'clash': .*would replace a variable the renderer sets"):
        render(template, clash)
    with pytest.raises(InvalidInput, match=r"^conversation 'robot': the chat template raised: unknown role: robot$"):
        render(template, Conversation("robot", [{"role": "robot", "content": "x"}]))


def test_string_arguments_are_parsed_as_llama_cpp_does_and_fail_as_transformers_renders(template, convs):
    """Finding: OpenAI's tool-call arguments are a JSON string. llama.cpp parses them into an object
    for a template that reads them as one (common/chat.cpp func_args_not_string); transformers and
    llama-cpp-python pass the string through, and an XML tool-call template cannot render it."""
    assert isinstance(convs["tools"].messages[2]["tool_calls"][0]["function"]["arguments"], str)
    assert "<parameter=city>\nZürich\n</parameter>" in render(template, convs["tools"])
    with pytest.raises(InvalidInput, match="conversation 'tools': the chat template raised: tool call arguments must be an object"):
        render(template, convs["tools"], parse_arguments=False)


def test_render_op_passes_options_and_a_renderer_ignoring_them_fails(tmp_path, in_repo):
    ok = run_tokenizer(TokenizerRequest(model=THINK, candidate="command:chat", write_evidence=False))
    assert ok.verdict is Verdict.PASS and len(ok.chat["conversations"]) == 17, ok.message
    bad = run_tokenizer(TokenizerRequest(model=THINK, candidate="command:planted-chat-ignore-options", write_evidence=False))
    assert bad.verdict is Verdict.FAIL
    assert sorted(c["conversation"] for c in bad.chat["conversations"] if not c["ok"]) == [
        "earlier-reasoning-in-content", "think-off", "two-tool-calls"]  # exactly the enable_thinking=false ones
    assert "conversation 'think-off': first difference at character 70: " in bad.message
    assert "'|>assistant\\\\x0a<think>\\\\x0a\\\\x0a</think>\\\\x0a\\\\x0a'" in bad.message


# ------------------------------------------------------------------ llama.cpp's own template engine
LLAMA_CPP_DIFFERS = {
    # llama-server continues a final assistant message (add_generation_prompt false): its own
    # generation prompt, the message's reasoning unstripped, no <|im_end|> (common/chat.cpp
    # continue_final_message; common/parsers/qwen3-coder.cpp)
    "no-generation-prompt": ("<|im_start|>assistant\nDone.<|im_end|>\n", "<|im_start|>assistant\n<think>\n\n</think>\n\nDone."),
    "last-turn-reasoning": ("<|im_start|>assistant\n<think>\n91 = 7 * 13.\n</think>\n\nNo.<|im_end|>\n",
                            "<|im_start|>assistant\n<think>\n\n91 = 7 * 13.\n\n</think>\n\n\nNo."),
    # llama-server gives a tool without a description an empty one
    "tools-no-system": ('{"name": "add", "parameters"', '{"name": "add", "description": "", "parameters"'),
}
"""Where llama.cpp's rendering differs from jinja2's (both sides' text at the difference)."""


def test_llama_server_apply_template_equals_jinja2_but_for_named_findings(template, convs):
    from harness.engines.llama_server import LlamaServer, apply_template, built_binary

    if built_binary() is None:
        pytest.fail("llama-server is not built for the installed llama-cpp-python: run `make llama-server` (not run)")
    with LlamaServer(model=resolve_model(THINK), parallel=1, n_ctx_slot=2048, extra=["--jinja"]) as server:
        got = {cid: apply_template(server.url, c) for cid, c in convs.items()}
    same = sorted(cid for cid, c in convs.items() if got[cid] == render(template, c))
    assert same == sorted(set(convs) - set(LLAMA_CPP_DIFFERS)), same
    for cid, (ours, theirs) in LLAMA_CPP_DIFFERS.items():
        assert ours in render(template, convs[cid]) and theirs in got[cid], (cid, got[cid])


def test_llama_cpp_python_server_findings_on_the_think_template(in_repo, monkeypatch):
    """Findings on llama-cpp-python 0.3.36's server (its GGUF-template chat handler, Jinja2ChatFormatter):
    it refuses OpenAI's string tool-call arguments for an XML tool-call template (it does not parse
    them as llama.cpp does), and it ignores a request's chat_template_kwargs (only a load-time
    setting exists), so enable_thinking=false loses the closed empty block (ollama PR #17078,
    paiml/aprender #3755)."""
    pytest.importorskip("llama_cpp.server.app", reason="needs llama-cpp-python's server extra (pip install -e .[server])")
    from test_http_engine import llama_cpp_server

    with llama_cpp_server(resolve_model(THINK)) as url:
        monkeypatch.setenv("HARNESS_LOCAL_URL", url)
        run = run_tokenizer(TokenizerRequest(model=THINK, candidate="http:local", write_evidence=False))
    rows = {c["conversation"]: c for c in run.chat["conversations"]}
    assert run.chat["verdict"] == "FAIL" and run.chat["mode"] == "prompt_tokens"
    assert sorted(k for k, r in rows.items() if "refused" in r) == ["tool-call-after-text", "tools", "two-tool-calls"]
    assert all("tool call arguments must be an object" in rows[k]["refused"] for k in ("tools", "two-tool-calls"))
    assert sorted(k for k, r in rows.items() if not r["ok"] and "refused" not in r) == ["earlier-reasoning-in-content", "think-off"]
    off = rows["think-off"]
    assert off["n_candidate_tokens"] < off["n_reference_tokens"]  # "<think>\n" where "<think>\n\n</think>\n\n" belongs
    assert rows["think-on"]["ok"] and rows["think-unset"]["ok"] and rows["earlier-reasoning"]["ok"]
    assert "conversation 'tools': the server refused it" in run.chat["message"]


def test_llama_server_prompt_token_counts_against_the_reference_tokenized_by_llama_cpp(template, convs):
    """Per conversation (generation prompt on: a chat endpoint always adds it), llama-server's
    usage.prompt_tokens against the reference rendering tokenized by llama.cpp (specials parsed, no
    BOS). Equal everywhere but where its rendering differs (LLAMA_CPP_DIFFERS: the empty tool
    description it adds)."""
    from harness.engines.llama_server import LlamaServer, built_binary, chat_prompt_tokens
    from harness.runs.inputs import resolve_inputs

    if built_binary() is None:
        pytest.fail("llama-server is not built for the installed llama-cpp-python: run `make llama-server` (not run)")
    asked = [c for c in convs.values() if c.add_generation_prompt]
    tok = resolve_inputs(THINK).tokenizer(None)
    ref = dict(zip((c.id for c in asked), map(len, tok.tokenize_many([render(template, c) for c in asked], add_special=False,
                                                                      parse_special=True))))
    with LlamaServer(model=resolve_model(THINK), parallel=1, n_ctx_slot=2048, extra=["--jinja"]) as server:
        got = {c.id: chat_prompt_tokens(server.url, c) for c in asked}
    differ = sorted(cid for cid in got if got[cid] != ref[cid])
    assert differ == ["tools-no-system"], {cid: (ref[cid], got[cid]) for cid in differ}
    assert got["tools-no-system"] > ref["tools-no-system"]  # '"description": "", ' more
    assert got["think-off"] - got["think-on"] == ref["think-off"] - ref["think-on"] > 0  # the closed empty block counted


def test_harness_tokenizer_judges_llama_servers_rendering_through_apply_template(in_repo):
    """The llama-server engine declares chat_template and renders by /apply-template: the run
    FAILs on exactly the named differences (LLAMA_CPP_DIFFERS), naming the first one."""
    from harness.engines.llama_server import built_binary

    if built_binary() is None:
        pytest.fail("llama-server is not built for the installed llama-cpp-python: run `make llama-server` (not run)")
    run = run_tokenizer(TokenizerRequest(model=THINK, candidate="llama-server", write_evidence=False))
    assert run.chat["mode"] == "render" and run.chat["verdict"] == "FAIL"
    assert sorted(c["conversation"] for c in run.chat["conversations"] if not c["ok"]) == sorted(LLAMA_CPP_DIFFERS)
    assert "chat template: conversation 'no-generation-prompt': first difference at character 55: " in run.message
