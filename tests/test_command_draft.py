"""Command protocol 2, op ``draft`` (capability ``mtp``; docs/engine-protocol.md, "Op draft"):
the MTP head's draft logits from an external engine. The reply files are checked as the other
reply files are (fakes: each malformed reply is one ENGINE-ERROR with its reason), and the example
engine (examples/llamacpp_engine.py, llama.cpp's own MTP context) gives what the reference worker
gives and what the float64 oracle computes, whole, chunked and for two sequences side by side."""

from __future__ import annotations

import textwrap

import numpy as np
import pytest

from harness.engines import persistent
from harness.engines.base import gather
from harness.engines.command import load_command_engine
from harness.engines.llamacpp import LlamaCppEngine
from harness.engines.oracle import load_oracle
from harness.errors import EngineError, InvalidInput, NotComparable
from harness.fixtures import synthetic as fx
from harness.measure.metrics import cosine

TOKENS = list(range(30, 130))
MTP = "tiny-qwen35-mtp"


@pytest.fixture(autouse=True)
def _fresh_processes():
    persistent.close_all()
    persistent.STARTS.clear()
    yield
    persistent.close_all()


# ---------------------------------------------------------------------------------------------
# a fake protocol-2 engine whose draft reply is broken one way per mode
# ---------------------------------------------------------------------------------------------
FAKE = """
import json, os, sys
import numpy as np
V, E, MODE = @V@, @E@, sys.argv[1]
for line in sys.stdin:
    req = json.loads(line)
    out = req["out_dir"]
    seqs = [q["tokens"] for q in req["sequences"]] if req.get("sequences") else [req["tokens"]]
    n_rows, n_tok = sum(len(q) - 1 for q in seqs), sum(len(q) for q in seqs)
    # row r of the draft logits holds r + 1 in column 0, row t of hidden t + 0.5: a split or
    # off-by-one in the harness's reading shows in the values
    d = np.zeros((n_rows, V), np.float32); d[:, 0] = np.arange(1, n_rows + 1)
    h = np.zeros((n_tok, E), np.float32); h[:, 0] = np.arange(n_tok) + 0.5
    files = ["draft_logits.npy", "hidden.npy", "info.json"]
    conv = {"no-convention": None, "bad-convention": "sglang"}.get(MODE, "vllm" if MODE == "vllm" else "llama.cpp")
    info = {"name": "fake", "settings": {} if conv is None else {"mtp_convention": conv}}
    if MODE == "no-info":
        files.remove("info.json")
    else:
        json.dump(info, open(out + "/info.json", "w"))
    if MODE == "no-draft":
        files.remove("draft_logits.npy")
    elif MODE == "garbage":
        open(out + "/draft_logits.npy", "wb").write(b"not a numpy file")
    elif MODE == "pickle":
        np.save(out + "/draft_logits.npy", np.array([object()] * 4, dtype=object), allow_pickle=True)
    elif MODE == "float64":
        np.save(out + "/draft_logits.npy", d.astype(np.float64))
    elif MODE == "all-rows":  # T rows instead of T - 1: the sentinel row left in
        np.save(out + "/draft_logits.npy", np.zeros((n_tok, V), np.float32))
    elif MODE == "flat":
        np.save(out + "/draft_logits.npy", d.ravel())
    elif MODE == "wrong-vocab":
        np.save(out + "/draft_logits.npy", np.zeros((n_rows, V + 1), np.float32))
    elif MODE == "truncated":  # a header promising more rows than the file holds
        np.save(out + "/draft_logits.npy", d)
        os.truncate(out + "/draft_logits.npy", os.path.getsize(out + "/draft_logits.npy") // 2)
    elif MODE == "fifo":
        os.mkfifo(out + "/draft_logits.npy")
    else:
        np.save(out + "/draft_logits.npy", d)
    if MODE == "no-hidden":
        files.remove("hidden.npy")
    elif MODE == "hidden-named-absent":
        pass
    elif MODE == "hidden-width":
        np.save(out + "/hidden.npy", np.zeros((n_tok, E + 1), np.float32))
    elif MODE == "hidden-rows":
        np.save(out + "/hidden.npy", np.zeros((n_rows, E), np.float32))
    elif MODE == "hidden-f16":
        np.save(out + "/hidden.npy", h.astype(np.float16))
    else:
        np.save(out + "/hidden.npy", h)
    if req.get("depth") == 2:  # row t: d_t + 0.25 in column 0, so the harness's draft_tokens show
        d2 = np.zeros((n_rows, V), np.float32); d2[:, 0] = np.asarray(req["draft_tokens"]) + 0.25
        files.append("draft2_logits.npy")
        if MODE == "no-draft2":
            files.remove("draft2_logits.npy")
        elif MODE == "draft2-rows":
            np.save(out + "/draft2_logits.npy", d2[:-1])
        elif MODE == "draft2-f64":
            np.save(out + "/draft2_logits.npy", d2.astype(np.float64))
        elif MODE == "draft2-vocab":
            np.save(out + "/draft2_logits.npy", np.zeros((n_rows, V - 1), np.float32))
        else:
            np.save(out + "/draft2_logits.npy", d2)
    if MODE == "odd-name":
        files.append("draft.npy")
    print(json.dumps({"id": req["id"], "ok": True, "files": files}), flush=True)
"""

MODES = ("good", "vllm", "no-info", "no-convention", "bad-convention", "no-draft", "garbage", "pickle", "float64", "all-rows",
         "flat", "wrong-vocab", "truncated", "fifo", "no-hidden", "hidden-named-absent", "hidden-width", "hidden-rows",
         "hidden-f16", "odd-name", "no-draft2", "draft2-rows", "draft2-f64", "draft2-vocab")


@pytest.fixture()
def fakes(tmp_path, monkeypatch):
    hp = load_command_engine("example", fx.build(MTP))._hparams
    script = tmp_path / "fake_draft_engine.py"
    script.write_text(textwrap.dedent(FAKE).replace("@V@", str(hp.n_vocab)).replace("@E@", str(hp.n_embd)))
    tables = [f'[engines.{m}]\ncommand = ["{{python}}", "{script}", "{m}"]\nprotocol = 2\ntimeout_s = 10\n'
              f'capabilities = ["mtp", "mtp_chain", "multi_seq", "chunks"]\n' for m in MODES]
    tables.append(f'[engines.no-mtp]\ncommand = ["{{python}}", "{script}", "good"]\nprotocol = 2\ncapabilities = ["multi_seq"]\n')
    tables.append(f'[engines.mtp-solo]\ncommand = ["{{python}}", "{script}", "good"]\nprotocol = 2\ncapabilities = ["mtp"]\n')
    cfg = tmp_path / "harness.toml"
    cfg.write_text("\n".join(tables))
    monkeypatch.setenv("HARNESS_CONFIG", str(cfg))
    return hp


def _fake(name):
    return load_command_engine(name, fx.build(MTP))


def test_a_good_draft_reply_becomes_drafts_row_for_row(fakes):
    eng = _fake("good")
    d = eng.draft(TOKENS[:10], chunks=[3, 7])
    assert d.logits.dtype == np.float32 and d.logits.shape == (9, fakes.n_vocab)
    assert d.logits[:, 0].tolist() == list(range(1, 10))
    assert d.hidden is not None and d.hidden.shape == (10, fakes.n_embd) and d.hidden[:, 0].tolist() == [t + 0.5 for t in range(10)]
    assert eng.info.settings["mtp_convention"] == "llama.cpp"
    a, b = eng.draft_multi([TOKENS[:4], TOKENS[4:10]])  # 3 + 5 draft rows, 4 + 6 hidden rows
    assert a.logits[:, 0].tolist() == [1, 2, 3] and b.logits[:, 0].tolist() == [4, 5, 6, 7, 8]
    assert a.hidden[:, 0].tolist() == [0.5, 1.5, 2.5, 3.5] and b.hidden[:, 0].tolist() == [4.5 + t for t in range(6)]
    assert _fake("vllm").draft(TOKENS[:5]) and _fake("vllm").info.settings["mtp_convention"] == "vllm"
    assert _fake("no-hidden").draft(TOKENS[:5]).hidden is None  # hidden.npy is optional
    assert sum(persistent.STARTS.values()) == 3


@pytest.mark.parametrize("mode, error, message", [
    ("no-info", EngineError, "info.json states no settings.mtp_convention; a draft reply must state 'llama.cpp' or 'vllm'"),
    ("no-convention", EngineError, "states no settings.mtp_convention; .* 'llama.cpp' or 'vllm'"),
    ("bad-convention", EngineError, "states settings.mtp_convention 'sglang'; .* 'llama.cpp' or 'vllm'"),
    ("no-draft", EngineError, "wrote no draft_logits.npy"),
    ("garbage", EngineError, "unreadable draft_logits.npy"),
    ("pickle", EngineError, "unreadable draft_logits.npy"),
    ("float64", EngineError, "draft logits of dtype float64; the protocol requires float32"),
    ("all-rows", EngineError, r"draft logits of shape \(10, 515\); expected \[9, V\]"),
    ("flat", EngineError, r"draft logits of shape \(4635,\)"),
    ("wrong-vocab", NotComparable, "draft logits have 516 columns but the model's vocab has 515"),
    ("truncated", EngineError, "unreadable draft_logits.npy"),
    ("fifo", EngineError, "draft_logits.npy as a FIFO; outputs must be regular files"),
    ("hidden-named-absent", EngineError, "named hidden.npy among its files but wrote none"),
    ("hidden-width", EngineError, r"hidden states of shape \(10, 65\); expected \[10, 64\]"),
    ("hidden-rows", EngineError, r"hidden states of shape \(9, 64\); expected \[10, 64\]"),
    ("hidden-f16", EngineError, "hidden states of dtype float16; the protocol requires float32"),
    ("odd-name", EngineError, "named 'draft.npy' among its files; the protocol's files are .*draft_logits.npy, hidden.npy"),
])
def test_a_malformed_draft_reply_is_one_engine_error(fakes, mode, error, message):
    assert fakes.n_vocab == 515 and fakes.n_embd == 64  # the shapes the messages name
    with pytest.raises(error, match=message) as e:
        _fake(mode).draft(TOKENS[:10])
    assert "\n" not in str(e.value)


def test_a_good_depth_2_reply_becomes_chained_drafts(fakes):
    """The harness's draft_tokens reach the engine (echoed in column 0) and both files are read."""
    c = _fake("good").draft_chain(TOKENS[:10], [7, 3, 5, 1, 0, 2, 9, 4, 6])
    assert c.logits.shape == c.logits2.shape == (9, fakes.n_vocab) and c.logits2.dtype == np.float32
    assert c.logits[:, 0].tolist() == list(range(1, 10)) and c.logits2[:, 0].tolist() == [x + 0.25 for x in (7, 3, 5, 1, 0, 2, 9, 4, 6)]
    assert c.tokens.tolist() == [7, 3, 5, 1, 0, 2, 9, 4, 6]
    own = _fake("good").draft_chain(TOKENS[:5])  # none given: the argmax of its own depth-1 rows (column 0 holds 1 … 4)
    assert own.tokens.tolist() == [0, 0, 0, 0] and own.logits2[:, 0].tolist() == [0.25] * 4


@pytest.mark.parametrize("mode, error, message", [
    ("no-draft2", EngineError, "wrote no draft2_logits.npy"),
    ("draft2-rows", EngineError, r"depth-2 draft logits of shape \(8, 515\); expected \[9, V\]"),
    ("draft2-f64", EngineError, "depth-2 draft logits of dtype float64; the protocol requires float32"),
    ("draft2-vocab", NotComparable, "depth-2 draft logits have 514 columns but the model's vocab has 515"),
])
def test_a_malformed_depth_2_reply_is_one_engine_error(fakes, mode, error, message):
    with pytest.raises(error, match=message) as e:
        _fake(mode).draft_chain(TOKENS[:10], list(range(9)))
    assert "\n" not in str(e.value)


def test_depth_2_needs_its_capability(fakes, tmp_path, monkeypatch):
    with pytest.raises(EngineError, match="does not declare the 'mtp_chain' capability"):
        _fake("mtp-solo").draft_chain(TOKENS[:10], list(range(9)))
    with pytest.raises(EngineError, match="3 draft_tokens for 9 draft rows"):
        _fake("good").draft_chain(TOKENS[:10], [1, 2, 3])
    with pytest.raises(EngineError, match=r"one id in \[0, 515\) per row"):
        _fake("good").draft_chain(TOKENS[:10], [515] * 9)
    assert sum(persistent.STARTS.values()) == 0  # nothing was sent
    from helpers import command_table_refused

    command_table_refused(tmp_path, monkeypatch, '[engines.c]\ncommand = ["x"]\nprotocol = 2\ncapabilities = ["mtp_chain"]\n',
                          "capability 'mtp_chain' \\(depth-2 drafts\\) needs 'mtp' too")


def test_draft_needs_its_capabilities_and_two_tokens(fakes, tmp_path, monkeypatch):
    with pytest.raises(EngineError, match="does not declare the 'mtp' capability"):
        _fake("no-mtp").draft(TOKENS[:10])
    with pytest.raises(EngineError, match="does not declare the 'multi_seq' capability"):
        _fake("mtp-solo").draft_multi([TOKENS[:10], TOKENS[:5]])
    with pytest.raises(EngineError, match="does not declare the 'chunks' capability"):
        _fake("mtp-solo").draft(TOKENS[:10], chunks=[5, 5])
    with pytest.raises(EngineError, match="at least 2 tokens per sequence"):
        _fake("good").draft_multi([TOKENS[:10], TOKENS[:1]])
    assert sum(persistent.STARTS.values()) == 0  # nothing was sent
    from helpers import command_table_refused

    command_table_refused(tmp_path, monkeypatch, '[engines.v1]\ncommand = ["x", "{request}", "{out_dir}"]\ncapabilities = ["mtp"]\n',
                          "capability 'mtp' needs protocol = 2")


# ---------------------------------------------------------------------------------------------
# the example engine: llama.cpp's MTP context, written against llama-cpp-python only
# ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def mtp_model():
    return fx.build(MTP)


@pytest.fixture(scope="module")
def oracle(mtp_model):
    return load_oracle(mtp_model, [])


def _close(got, want):
    """Equal to float32 rounding (both sides run the same llama.cpp: measured bit-equal)."""
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6 * float(np.abs(want).max()))


def test_example_draft_equals_the_reference_worker_and_the_oracle(mtp_model, oracle):
    eng = load_command_engine("example", mtp_model)
    ref = LlamaCppEngine(mtp_model)
    for chunks in (None, [7, 1, 1, 91]):
        got, want = eng.draft(TOKENS, chunks), ref.draft(TOKENS, chunks, "llama.cpp")
        assert got.logits.shape == (len(TOKENS) - 1, eng.n_vocab) and got.hidden.shape == (len(TOKENS), eng._hparams.n_embd)
        _close(got.logits, want.logits)
        _close(got.hidden, want.hidden)
        exact = oracle.draft(TOKENS, chunks)
        assert (1 - cosine(exact.logits, got.logits)).max() < 1e-6, chunks
    assert eng.info.settings["mtp_convention"] == "llama.cpp"
    # the check is sharp: the same head in the other row convention is far off
    other = ref.draft(TOKENS, None, "vllm")
    assert (1 - cosine(other.logits, got.logits)).max() > 1e-3
    # the hidden-state check: output · h_t reproduces the engine's own trunk logits (post-output_norm h_t)
    trunk = gather(eng.logits(TOKENS), len(TOKENS))
    assert (1 - cosine(trunk, oracle.lm_head(got.hidden.astype(np.float64)))).max() < 1e-6
    assert sum(persistent.STARTS.values()) == 1


def test_example_draft_of_two_sequences_side_by_side(mtp_model, oracle):
    eng = load_command_engine("example", mtp_model)
    a, b = TOKENS[:40], TOKENS[40:]
    got = eng.draft_multi([a, b])
    want = LlamaCppEngine(mtp_model).draft_multi([a, b], "llama.cpp")
    for q, g, w in zip((a, b), got, want):
        assert g.logits.shape == (len(q) - 1, eng.n_vocab)
        _close(g.logits, w.logits)
        _close(g.hidden, w.hidden)
        assert (1 - cosine(oracle.draft(q).logits, g.logits)).max() < 1e-6  # each sequence as if alone


def test_example_depth_2_equals_the_reference_worker_and_the_oracle(mtp_model, oracle):
    """Chained drafts: the example's depth-2 rows (llama.cpp's MTP context, KV cells after each
    row removed) equal the reference worker's bit for bit and the oracle's to float32 rounding, in
    llama.cpp's convention; fed the target's hidden state instead (the mutant) they are far off."""
    from harness.engines.mutants import load_mutant

    eng = load_command_engine("example", mtp_model)
    ref = LlamaCppEngine(mtp_model).draft_chain(TOKENS, None, "llama.cpp")
    assert ref.tokens.tolist() == np.argmax(ref.logits, axis=1).tolist()
    got = eng.draft_chain(TOKENS, ref.tokens)
    assert got.logits2.shape == (len(TOKENS) - 1, eng.n_vocab)
    _close(got.logits, ref.logits)
    _close(got.logits2, ref.logits2)
    assert (1 - cosine(oracle.draft_chain(TOKENS, ref.tokens).logits2, got.logits2)).max() < 1e-6
    assert (1 - cosine(got.logits2[:-1], got.logits[1:])).max() > 0.5  # depth 2 is not depth 1 of the next row
    bad = load_mutant("mtp-chain-target-hidden", mtp_model).draft_chain(TOKENS, ref.tokens)
    assert (1 - cosine(bad.logits, got.logits)).max() < 1e-6 and cosine(bad.logits2, got.logits2).min() < 0.5


def test_example_refuses_draft_on_a_model_without_mtp():
    eng = load_command_engine("example", fx.build("tiny-qwen35"))
    with pytest.raises(EngineError, match=r"refused request 1: ValueError: this model has no MTP \(nextn\) block"):
        eng.draft(TOKENS[:10])
    assert gather(eng.logits(TOKENS[:10])).shape == (10, eng.n_vocab)  # the refusal keeps the process
    assert sum(persistent.STARTS.values()) == 1

