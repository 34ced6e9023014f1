"""``harness tokenizer`` (harness/runs/tokenizer.py): the candidate's own ids against llama.cpp's.

Engines judged: the example engine (llama.cpp's own tokenizer of the GGUF, protocol 2 op
``tokenize``), ``command:bpe`` (examples/bpe_tokenizer_engine.py: a byte-level BPE written from
the GGUF's tokens and merges with the qwen35 pre-tokenizer regex), its two planted faults (the
gpt2 regex; the merge of rank 0 dropped) and the real llama-cpp-python server (``http:local``,
``/extras/tokenize``). The planted faults must FAIL at the position where the faulty tokenizer,
run here directly, first parts from llama.cpp; an engine without the capability is UNMEASURED.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from harness.cli import main as cli_main
from harness.engines.http_engine import HttpEngine, HttpSpec
from harness.engines.llamacpp import LlamaCppEngine
from harness.errors import EngineError, Verdict
from harness.evidence.ledger import read_rows, verify_ledger
from harness.fixtures.resolve import default_model, resolve_model
from harness.measure.prompts import load_prompt_set
from harness.measure.tokens import compare_ids, compare_text, first_difference
from harness.runs.tokenizer import TOKENIZER_PROMPTS, TokenizerRequest, run_tokenizer

REPO = Path(__file__).resolve().parent.parent
MODEL = resolve_model(default_model())
sys.path.insert(0, str(REPO / "examples"))
from bpe_tokenizer_engine import Tokenizer  # noqa: E402  (the planted engines' tokenizer, run directly)


@pytest.fixture
def in_repo(monkeypatch):
    """Run from the repository root so its pyproject.toml (the engines) is the config."""
    monkeypatch.chdir(REPO)
    monkeypatch.delenv("HARNESS_CONFIG", raising=False)


@pytest.fixture(scope="module")
def reference_ids():
    texts = [p.text for p in load_prompt_set(TOKENIZER_PROMPTS)]
    return texts, LlamaCppEngine(MODEL, tokenizer_only=True).tokenize_many(texts)


# ------------------------------------------------------------------------------ pure comparison
def test_first_difference_and_compare():
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert first_difference([1, 2], [1, 2, 3]) == 2  # the shorter side ends there
    c = compare_ids("p", [7, 8, 9, 10], [7, 8, 11])
    assert not c.ok and c.first_diff == 2 and c.window("reference") == [9, 10] and c.window("candidate") == [11]
    d = c.to_dict(lambda t: f"t{t}")
    assert d["reference"] == [{"id": 9, "text": "t9"}, {"id": 10, "text": "t10"}] and d["n_candidate"] == 3
    t = compare_text("two-system", "<|im_start|>system\nA<|im_end|>", "<|im_start|>system\nB<|im_end|>")
    assert t.first_diff == 19 and t.reference_excerpt.endswith("A<|im_end|>")


def test_hostile_set_is_apart_from_the_parity_set():
    hostile = {p.id for p in load_prompt_set(TOKENIZER_PROMPTS)}
    assert {"cjk", "emoji-zwj", "digits", "whitespace", "code", "mixed-scripts", "split-utf8"} <= hostile
    assert not hostile & {p.id for p in load_prompt_set(None)}
    text = " ".join(p.text for p in load_prompt_set(TOKENIZER_PROMPTS))
    assert "\u200d" in text and "\r\n" in text and "e\u0301" in text  # ZWJ, CRLF, a combining sequence


# ------------------------------------------------------------------------------ engines judged
def _run(candidate: str, tmp_path: Path, **kw) -> object:
    return run_tokenizer(TokenizerRequest(model="fixture:trained-qwen35", candidate=candidate,
                                          ledger=str(tmp_path / "ledger.jsonl"), **kw))


@pytest.mark.parametrize("candidate", ["command:example", "command:bpe"])
def test_correct_tokenizers_pass(candidate, tmp_path, in_repo, reference_ids):
    texts, ids = reference_ids
    run = _run(candidate, tmp_path)
    assert run.verdict is Verdict.PASS, run.message
    assert [list(c.candidate) for c in run.comparisons] == ids and len(run.comparisons) == len(texts)
    assert run.receipt["positions"] == sum(map(len, ids))
    row = read_rows(tmp_path / "ledger.jsonl")[-1]
    assert row["kind"] == "tokenizer" and row["verdict"] == "PASS" and row["positions"] == sum(map(len, ids))
    assert verify_ledger(tmp_path / "ledger.jsonl") == []  # the row re-derives from its receipt


@pytest.mark.parametrize("candidate, pre, drop", [("command:planted-bpe-gpt2", "gpt2", None),
                                                  ("command:planted-bpe-drop-merge", None, 0)])
def test_planted_tokenizer_faults_fail_at_their_position(candidate, pre, drop, tmp_path, in_repo, reference_ids):
    texts, ids = reference_ids
    faulty = Tokenizer(str(MODEL), pre, drop)
    expect = [(i, first_difference(a, faulty.encode(t))) for i, (t, a) in enumerate(zip(texts, ids))]
    first_bad = next((i, d) for i, d in expect if d is not None)
    run = _run(candidate, tmp_path)
    assert run.verdict is Verdict.FAIL
    bad = [c for c in run.comparisons if not c.ok]
    assert [(texts.index(next(p.text for p in load_prompt_set(TOKENIZER_PROMPTS) if p.id == c.prompt)), c.first_diff) for c in bad] \
        == [(i, d) for i, d in expect if d is not None]
    pid = load_prompt_set(TOKENIZER_PROMPTS).prompts[first_bad[0]].id
    ref_tok, cand_tok = ids[first_bad[0]][first_bad[1]], faulty.encode(texts[first_bad[0]])[first_bad[1]]
    assert f"prompt {pid!r}: first difference at position {first_bad[1]}: llama.cpp {ref_tok} " in run.message
    assert f"{candidate} {cand_tok} " in run.message and "reproduce: harness tokenizer --candidate" in run.message
    c = run.receipt["comparisons"][first_bad[0]]
    assert c["reference"][0]["id"] == ref_tok and c["candidate"][0]["id"] == cand_tok
    assert read_rows(tmp_path / "ledger.jsonl")[-1]["verdict"] == "FAIL"


def test_engine_without_the_capability_is_unmeasured(tmp_path, in_repo, capsys):
    rc = cli_main(["tokenizer", "--candidate", "command:example-v1", "--model", "fixture:trained-qwen35",
                   "--ledger", str(tmp_path / "ledger.jsonl")])
    out = capsys.readouterr().out
    assert rc == Verdict.UNMEASURED.exit_code and "UNMEASURED: command:example-v1 does not declare the 'tokenize' capability" in out
    rec = json.loads(sorted((tmp_path / "receipts").rglob("*.json"))[-1].read_text())
    assert rec["verdict"] == "UNMEASURED" and rec["comparisons"] == [] and rec["positions"] == 0


def test_cli_fail_is_one_line_with_exit_1(tmp_path, in_repo, capsys):
    rc = cli_main(["tokenizer", "--candidate", "command:planted-bpe-gpt2", "--model", "fixture:trained-qwen35", "--no-evidence"])
    out = capsys.readouterr().out
    assert rc == 1
    line = next(x for x in out.splitlines() if x.startswith("FAIL: "))
    assert "\u200d" not in line and "first difference at position" in line  # untrusted token text escaped


# ------------------------------------------------------------------------------ servers
def test_malformed_tokenize_answer_is_engine_error(monkeypatch):
    eng = HttpEngine(HttpSpec("x", "http://127.0.0.1:9", "m"), MODEL)
    monkeypatch.setattr(eng, "_post", lambda path, body: {"tokens": [1, True]})
    with pytest.raises(EngineError, match="not a list of token ids"):
        eng.tokenize_text("a")
    monkeypatch.setattr(eng, "_post", lambda path, body: {"tokens": [10**6]})
    with pytest.raises(EngineError, match="outside the vocabulary"):
        eng.tokenize_text("a")


def test_llama_cpp_python_server_differs_only_where_it_parses_special_tokens(tmp_path, in_repo, monkeypatch, reference_ids):
    """llama-cpp-python's ``/extras/tokenize`` always parses special-token strings
    (``special=True``, llama_cpp/server/app.py); llama.cpp is asked with ``parse_special`` off, so
    the one hostile text that holds the specials' surface forms differs, at the first of them,
    and every other text gives llama.cpp's ids."""
    pytest.importorskip("llama_cpp.server.app", reason="needs llama-cpp-python's server extra (pip install -e .[server])")
    from test_http_engine import llama_cpp_server

    texts, ids = reference_ids
    with llama_cpp_server(MODEL) as url:
        monkeypatch.setenv("HARNESS_LOCAL_URL", url)
        run = _run("http:local", tmp_path)
    assert run.verdict is Verdict.FAIL
    special = LlamaCppEngine(MODEL, tokenizer_only=True).tokenize_many(texts, parse_special=True)
    assert [list(c.candidate) for c in run.comparisons] == special
    assert [c.prompt for c in run.comparisons if not c.ok] == ["special-surface"]
    assert run.message.startswith("prompt 'special-surface': first difference at position ")
    assert " | http:local 512 '<|endoftext|>'" in run.message  # the first surface form, parsed


# ------------------------------------------------------------------------------ the chat template
CHAT = "fixture:trained-qwen35-chat"


def test_reference_rendering_follows_llama_cpps_jinja_path():
    from harness.errors import InvalidInput
    from harness.measure.chat_template import Conversation, load_conversations, render
    from harness.runs.tokenizer import CONVERSATIONS

    tpl = resolve_model(CHAT)
    from harness.model.gguf_model import GGUFModel
    template = GGUFModel(tpl).raw_metadata("tokenizer.chat_template")
    convs = {c.id: c for c in load_conversations(CONVERSATIONS)}
    assert {"two-system", "tools", "empty-assistant", "no-generation-prompt"} <= set(convs)
    two = render(template, convs["two-system"])
    assert two.count("<|im_start|>system\n") == 2 and two.endswith("<|im_start|>assistant\n")
    assert "<|im_start|>assistant\n<|im_end|>\n" in render(template, convs["empty-assistant"])
    assert "城市" in render(template, convs["tools"])  # tojson keeps non-ASCII, as llama.cpp's does
    assert not render(template, convs["no-generation-prompt"]).endswith("<|im_start|>assistant\n")
    with pytest.raises(InvalidInput, match="the chat template raised: unknown role: robot"):
        render(template, Conversation("bad", [{"role": "robot", "content": "x"}]))
    with pytest.raises(InvalidInput, match="does not render"):
        render("{{ messages[0].content.__class__ }}{% for %}", convs["tools"])
    with pytest.raises(Exception):  # sandboxed: no reaching Python internals
        render("{{ ''.__class__.__mro__[1].__subclasses__() }}", convs["tools"])


def test_chat_template_passes_for_the_formatter_and_fails_on_a_dropped_system_message(tmp_path, in_repo):
    from harness.measure.chat_template import load_conversations, render
    from harness.model.gguf_model import GGUFModel
    from harness.runs.tokenizer import CONVERSATIONS

    ok = run_tokenizer(TokenizerRequest(model=CHAT, candidate="command:chat", ledger=str(tmp_path / "ledger.jsonl")))
    assert ok.verdict is Verdict.PASS and ok.chat["mode"] == "render", ok.message
    assert len(ok.chat["conversations"]) == len(load_conversations(CONVERSATIONS)) and all(c["ok"] for c in ok.chat["conversations"])
    bad = run_tokenizer(TokenizerRequest(model=CHAT, candidate="command:planted-chat-drop-system", ledger=str(tmp_path / "ledger.jsonl")))
    assert bad.verdict is Verdict.FAIL
    assert [c["conversation"] for c in bad.chat["conversations"] if not c["ok"]] == ["two-system"]
    conv = next(c for c in load_conversations(CONVERSATIONS) if c.id == "two-system")
    ref = render(GGUFModel(resolve_model(CHAT)).raw_metadata("tokenizer.chat_template"), conv)
    dropped = render(GGUFModel(resolve_model(CHAT)).raw_metadata("tokenizer.chat_template"),
                     type(conv)(conv.id, [m for i, m in enumerate(conv.messages) if m["role"] != "system" or i == 0]))
    at = first_difference(ref, dropped)
    assert f"conversation 'two-system': first difference at character {at}: " in bad.message
    assert ref[at:].startswith("system\nFrom now on") and dropped[at:].startswith("user\nAnother one.")
    rows = read_rows(tmp_path / "ledger.jsonl")
    assert [r["verdict"] for r in rows] == ["PASS", "FAIL"] and verify_ledger(tmp_path / "ledger.jsonl") == []


def test_chat_template_unmeasured_without_a_template_or_the_capability(tmp_path, in_repo):
    run = _run("command:bpe", tmp_path)  # trained-qwen35 has no tokenizer.chat_template
    assert run.verdict is Verdict.PASS and run.chat["verdict"] == "UNMEASURED"
    assert "no tokenizer.chat_template" in run.chat["unmeasured"] and "chat template not judged" in run.message
    only = run_tokenizer(TokenizerRequest(model="fixture:trained-qwen35", candidate="command:chat", write_evidence=False))
    assert only.verdict is Verdict.UNMEASURED  # neither part measured


def test_llama_cpp_python_server_chat_template_passes(tmp_path, in_repo, monkeypatch):
    pytest.importorskip("llama_cpp.server.app", reason="needs llama-cpp-python's server extra (pip install -e .[server])")
    from test_http_engine import llama_cpp_server

    with llama_cpp_server(resolve_model(CHAT)) as url:
        monkeypatch.setenv("HARNESS_LOCAL_URL", url)
        run = run_tokenizer(TokenizerRequest(model=CHAT, candidate="http:local", ledger=str(tmp_path / "ledger.jsonl")))
    assert run.chat["verdict"] == "PASS", run.chat["message"]
    # the ids part fails on the specials' surface forms alone (the server parses them: see above)
    assert run.verdict is Verdict.FAIL and [c.prompt for c in run.comparisons if not c.ok] == ["special-surface"], run.message
    assert run.chat["mode"] == "prompt_tokens" and run.chat["skipped"] == ["no-generation-prompt"]
    rows = {c["conversation"]: c for c in run.chat["conversations"]}
    assert rows["two-system"]["n_candidate_tokens"] == rows["two-system"]["n_reference_tokens"] > rows["system-user"]["n_reference_tokens"]


# ------------------------------------------------------------------------------ transformers' own tokenizer
def test_transformers_without_tokenizer_files_is_unmeasured(tmp_path, in_repo, capsys):
    for mod in ("torch", "transformers"):  # the engine needs both to start, though this path loads no weights
        pytest.importorskip(mod, reason="the transformers engine needs the hf extra (pip install -e .[hf])")
    rc = cli_main(["tokenizer", "--candidate", "transformers", "--model", "fixture:trained-qwen35",
                   "--ledger", str(tmp_path / "ledger.jsonl")])
    out = capsys.readouterr().out
    assert rc == Verdict.UNMEASURED.exit_code
    assert "UNMEASURED: transformers has no tokenizer of its own for this model" in out and "--tokenizer-dir" in out
    rec = json.loads(sorted((tmp_path / "receipts").rglob("*.json"))[-1].read_text())
    assert rec["verdict"] == "UNMEASURED" and rec["comparisons"] == [] and "harness.fixtures.convert" in rec["unmeasured"]


@pytest.mark.hf
def test_transformers_own_qwen35_tokenizer_passes_with_its_nfc_difference_named(tmp_path, in_repo, reference_ids):
    """transformers' Qwen3_5Tokenizer, loaded from a model folder's files (tests/helpers.py
    ``write_qwen35_tokenizer_folder``), against llama.cpp: it NFC-normalizes the text first
    (transformers/models/qwen3_5/tokenization_qwen3_5.py), llama.cpp does not, so it parts from
    llama.cpp on the one hostile text that NFC changes (``split-utf8``'s ``e`` + combining acute)
    and gives llama.cpp's ids of the NFC form everywhere: a PASS that names that prompt as excused
    (``excuse_normalization``), not a FAIL of a correct tokenizer. A candidate that differs there
    in any other way still FAILs (``test_a_difference_nfc_does_not_explain_still_fails``)."""
    import unicodedata

    pytest.importorskip("torch", reason="the transformers engine needs the hf extra (pip install -e .[hf])")
    from transformers import AutoTokenizer

    from helpers import write_qwen35_tokenizer_folder

    texts, ids = reference_ids
    prompts = load_prompt_set(TOKENIZER_PROMPTS).prompts
    folder = write_qwen35_tokenizer_folder(MODEL, tmp_path / "model")
    tok = AutoTokenizer.from_pretrained(str(folder))
    assert type(tok).__name__ == "Qwen3_5Tokenizer" and "NFC" in repr(tok.backend_tokenizer.normalizer)
    spec = json.loads((folder / "tokenizer.json").read_text())
    spec["normalizer"], spec["pre_tokenizer"] = None, {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True}
    (folder / "tokenizer.json").write_text(json.dumps(spec))
    tok = AutoTokenizer.from_pretrained(str(folder))  # the pipeline is transformers' class, whatever the file says
    assert "NFC" in repr(tok.backend_tokenizer.normalizer) and "Split" in repr(tok.backend_tokenizer.pre_tokenizer)

    run = _run("transformers", tmp_path, candidate_settings={"tokenizer_dir": str(folder)})
    changed = [p.id for p in prompts if unicodedata.normalize("NFC", p.text) != p.text]
    assert changed == ["split-utf8"]
    assert run.verdict is Verdict.PASS, run.message
    assert [c.prompt for c in run.comparisons if c.first_diff is not None] == changed == [c.prompt for c in run.comparisons if c.excused]
    assert "'split-utf8' differs only by Unicode NFC normalization" in run.message
    nfc_ids = LlamaCppEngine(MODEL, tokenizer_only=True).tokenize_many([unicodedata.normalize("NFC", t) for t in texts])
    assert [list(c.candidate) for c in run.comparisons] == nfc_ids
    i = [p.id for p in prompts].index("split-utf8")
    at = first_difference(ids[i], nfc_ids[i])
    rec = run.comparisons[i].to_dict()
    assert rec["first_diff"] == at and rec["excused"] and rec["ok"]
    assert read_rows(tmp_path / "ledger.jsonl")[-1]["verdict"] == "PASS"

    stable = tmp_path / "nfc-stable.jsonl"
    stable.write_text("".join(json.dumps({"id": p.id, "text": p.text}) + "\n" for p in prompts if p.id not in changed))
    ok = _run("transformers", tmp_path, prompts=str(stable), candidate_settings={"tokenizer_dir": str(folder)})
    assert ok.verdict is Verdict.PASS, ok.message
    assert [list(c.candidate) for c in ok.comparisons] == [a for p, a in zip(prompts, ids) if p.id not in changed]


def test_a_difference_nfc_does_not_explain_still_fails():
    """``excuse_normalization`` excuses only a candidate whose ids are llama.cpp's for the NFC form:
    on a text NFC changes, ids that are neither the raw nor the NFC tokenization stay a FAIL, and on
    a text already in NFC form no difference is excused."""
    import unicodedata

    from harness.measure.tokens import compare_ids
    from harness.runs.tokenizer import excuse_normalization

    ref = LlamaCppEngine(MODEL, tokenizer_only=True)
    text = "caf\u0065\u0301 au lait"
    raw, nfc = ref.tokenize_many([text, unicodedata.normalize("NFC", text)])
    assert raw != nfc
    assert excuse_normalization(compare_ids("p", raw, nfc), text, ref, False).ok
    wrong = nfc[:-1] + [nfc[-1] + 1]
    assert not excuse_normalization(compare_ids("p", raw, wrong), text, ref, False).ok
    plain = "plain ascii text"
    ids = ref.tokenize_many([plain])[0]
    assert not excuse_normalization(compare_ids("p", ids, ids[::-1]), plain, ref, False).ok


def test_llama_cpp_python_server_chat_template_fails_on_a_planted_template(tmp_path, in_repo, monkeypatch):
    """The real server serving a copy of the chat fixture whose template drops every system message
    after the first (opencode #15059's failure, planted in the GGUF the server loads), judged against
    the fixture's own template: FAIL on ``two-system`` only, by token count (the server returns no
    text or ids), located at the message the counts first part at and the reference character
    where that message's part begins."""
    pytest.importorskip("llama_cpp.server.app", reason="needs llama-cpp-python's server extra (pip install -e .[server])")
    from test_http_engine import llama_cpp_server

    from harness.fixtures.synthetic import add_chat_template
    from harness.measure.chat_template import Conversation, load_conversations, render
    from harness.model.gguf_model import GGUFModel
    from harness.runs.tokenizer import CONVERSATIONS

    chat = resolve_model(CHAT)
    template = GGUFModel(chat).raw_metadata("tokenizer.chat_template")
    keep = "{%- if not (tools and loop.first) %}"
    assert template.count(keep) == 1
    planted = add_chat_template(chat, template.replace(keep, "{%- if loop.first and not tools %}"), tmp_path / "planted.gguf",
                                "trained-qwen35-chat-drop-system")
    with llama_cpp_server(planted) as url:
        monkeypatch.setenv("HARNESS_LOCAL_URL", url)
        run = run_tokenizer(TokenizerRequest(model=CHAT, candidate="http:local", ledger=str(tmp_path / "ledger.jsonl")))
    assert run.verdict is Verdict.FAIL and run.chat["mode"] == "prompt_tokens", run.message
    rows = {c["conversation"]: c for c in run.chat["conversations"]}
    assert [k for k, c in rows.items() if not c["ok"]] == ["two-system"]
    conv = next(c for c in load_conversations(CONVERSATIONS) if c.id == "two-system")
    two = rows["two-system"]
    n_dropped = len(LlamaCppEngine(chat, tokenizer_only=True).tokenize_many(
        [render(template.replace(keep, "{%- if loop.first and not tools %}"), conv)], parse_special=True)[0])
    assert two["n_candidate_tokens"] == n_dropped < two["n_reference_tokens"]
    at = len(render(template, Conversation(conv.id, conv.messages[:2], None, False)))
    assert two["localized"] == {"message": 3, "role": "system", "character": at,
                                "reference_excerpt": render(template, Conversation(conv.id, conv.messages[:3], None, False))[at:at + 40]}
    assert two["localized"]["reference_excerpt"].startswith("<|im_start|>system\nFrom now on")
    assert (f"conversation 'two-system': the server's chat prompt has {n_dropped} tokens, the reference rendering "
            f"{two['n_reference_tokens']}") in run.message
    assert f"part at message 3 (system), whose rendering begins at reference character {at}: " in run.message
    # the ids part (/extras/tokenize) agrees but on the specials' surface forms, which the server parses
    assert run.comparisons and [c.prompt for c in run.comparisons if not c.ok] == ["special-surface"]
    assert verify_ledger(tmp_path / "ledger.jsonl") == []
