"""Command protocol 2, op ``generate`` with ``speculative`` (capability ``speculative``;
docs/engine-protocol.md, "Op generate with speculative"). The reply's ``tokens.json`` and
``speculative.json`` are checked as the other reply files are (a fake engine: each malformed reply
is one ENGINE-ERROR with its reason), and the example engine (examples/llamacpp_engine.py,
llama.cpp's MTP context) is driven through its accept path by a drafter that proposes its own
plain greedy tokens with every third one wrong: partly accepted drafts, then the rollback of the
rest, must still give plain greedy, with the counts showing both."""

from __future__ import annotations

import importlib.util
import json
import textwrap
from pathlib import Path

import numpy as np
import pytest

from harness.engines import persistent
from harness.engines.command import load_command_engine
from harness.errors import EngineError
from harness.fixtures import synthetic as fx

MTP = "tiny-qwen35-mtp"
PROMPT = list(range(30, 70))


@pytest.fixture(autouse=True)
def _fresh_processes():
    persistent.close_all()
    persistent.STARTS.clear()
    yield
    persistent.close_all()


FAKE = """
import json, sys
MODE = sys.argv[1]
for line in sys.stdin:
    req = json.loads(line)
    out, n = req["out_dir"], req.get("n_tokens", 0)
    spec = req.get("speculative") or {}
    k = spec.get("draft_max", 0)
    seqs = [q["tokens"] for q in req["sequences"]] if req.get("sequences") else [req["tokens"]]
    # ids: 100 + the request's first token + i; steps of 1 accepted + (k - 1) rejected, last one draft-less
    ids = [[(100 + q[0] + i) % 500 for i in range(n)] for q in seqs]
    acc = [1] * ((n - 1) // 2) + ([0] if (n - 1) % 2 else [])
    rej = [k - 1] * ((n - 1) // 2) + ([0] if (n - 1) % 2 else [])
    counts = {"draft": spec.get("draft", "mtp"), "draft_max": k, "sequences": [{"accepted": acc, "rejected": rej} for _ in seqs]}
    if MODE == "no-counts":
        counts = None
    elif MODE == "bad-json":
        counts = "{not json"
    elif MODE == "wrong-k":
        counts["draft_max"] = k + 1
    elif MODE == "too-many-drafts":
        counts["sequences"][0]["rejected"][0] = k + 1
    elif MODE == "negative":
        counts["sequences"][0]["accepted"][0] = -1
    elif MODE == "bool":
        counts["sequences"][0]["accepted"][0] = True
    elif MODE == "lengths":
        counts["sequences"][0]["rejected"].append(0)
    elif MODE == "extra-step":  # a step that gives no token of its own
        counts["sequences"][0]["accepted"].append(0); counts["sequences"][0]["rejected"].append(0)
    elif MODE == "missing-step":
        counts["sequences"][0]["accepted"].pop(); counts["sequences"][0]["rejected"].pop()
    elif MODE == "one-entry":
        counts["sequences"] = counts["sequences"][:1]
    elif MODE == "too-many-ids":
        ids[0].append(1)
    elif MODE == "out-of-vocab":
        ids[0][0] = 10 ** 6
    elif MODE == "flat-multi":
        ids = ids[0]
    json.dump(ids if req.get("sequences") or MODE == "flat-multi" else ids[0], open(out + "/tokens.json", "w"))
    files = ["tokens.json", "speculative.json"]
    if counts is None:
        files.remove("speculative.json")
    elif isinstance(counts, str):
        open(out + "/speculative.json", "w").write(counts)
    else:
        json.dump(counts, open(out + "/speculative.json", "w"))
    print(json.dumps({"id": req["id"], "ok": True, "files": files}), flush=True)
"""

MODES = ("good", "no-counts", "bad-json", "wrong-k", "too-many-drafts", "negative", "bool", "lengths", "extra-step",
         "missing-step", "one-entry", "too-many-ids", "out-of-vocab", "flat-multi")


@pytest.fixture()
def fakes(tmp_path, monkeypatch):
    script = tmp_path / "fake_spec_engine.py"
    script.write_text(textwrap.dedent(FAKE))
    tables = [f'[engines.{m}]\ncommand = ["{{python}}", "{script}", "{m}"]\nprotocol = 2\ntimeout_s = 10\n'
              f'capabilities = ["speculative", "multi_seq", "chunks", "generate"]\n' for m in MODES]
    tables.append(f'[engines.plain]\ncommand = ["{{python}}", "{script}", "good"]\nprotocol = 2\ncapabilities = ["generate", "multi_seq"]\n')
    tables.append(f'[engines.solo]\ncommand = ["{{python}}", "{script}", "good"]\nprotocol = 2\ncapabilities = ["speculative"]\n')
    cfg = tmp_path / "harness.toml"
    cfg.write_text("\n".join(tables))
    monkeypatch.setenv("HARNESS_CONFIG", str(cfg))


def _fake(name):
    return load_command_engine(name, fx.build(MTP))


def test_a_good_speculative_reply_becomes_speculations(fakes):
    eng = _fake("good")
    s = eng.speculative(PROMPT, 6, draft_max=3, chunks=[10, 30], session={"id": "a"})
    assert s.tokens == [130, 131, 132, 133, 134, 135]
    assert s.accepted == [1, 1, 0] and s.rejected == [2, 2, 0]  # 1 + 2 + 2 + 1 = 6 tokens
    assert s.proposed == 6 and s.acceptance() == pytest.approx(1 / 3) and s.step_of(5) == 2
    a, b = eng.speculative_multi([PROMPT, [7, 8, 9]], 5, draft_max=2)
    assert a.tokens == [130, 131, 132, 133, 134] and b.tokens == [107, 108, 109, 110, 111]
    assert a.accepted == b.accepted == [1, 1] and a.rejected == [1, 1]
    assert sum(persistent.STARTS.values()) == 1


def test_the_request_carries_draft_sequences_and_session(fakes, tmp_path, monkeypatch):
    seen = []
    real = persistent.PersistentProcess.request

    def spy(self, body, out_dir, timeout_s):
        seen.append(json.loads(json.dumps(body)))
        return real(self, body, out_dir, timeout_s)

    monkeypatch.setattr(persistent.PersistentProcess, "request", spy)
    eng = _fake("good")
    eng.speculative(PROMPT, 4, draft_max=2, chunks=[39, 1], session={"id": "b", "parent": "a", "after": 12})
    eng.speculative_multi([PROMPT, PROMPT[:5]], 4, draft_max=4)
    one, two = seen
    assert (one["op"], one["n_tokens"], one["speculative"], one["chunks"]) == ("generate", 4, {"draft": "mtp", "draft_max": 2}, [39, 1])
    assert one["tokens"] == PROMPT and one["session"] == {"id": "b", "parent": "a", "after": 12}
    assert two["speculative"] == {"draft": "mtp", "draft_max": 4} and [q["tokens"] for q in two["sequences"]] == [PROMPT, PROMPT[:5]]
    assert "session" not in two and "tokens" not in two


def test_given_drafts_travel_in_the_request_and_bad_ones_are_never_sent(fakes, monkeypatch):
    seen = []
    real = persistent.PersistentProcess.request

    def spy(self, body, out_dir, timeout_s):
        seen.append(json.loads(json.dumps(body)))
        return real(self, body, out_dir, timeout_s)

    monkeypatch.setattr(persistent.PersistentProcess, "request", spy)
    eng = _fake("good")
    for given, k, message in (([600], 3, "given draft 600 is not a token id in \\[0, 515\\)"), ([1], 9, "draft_max 9: at most 8"),
                              ([1] * 7, 3, "7 given drafts for 6 tokens")):
        with pytest.raises(EngineError, match=message):
            eng.speculative(PROMPT, 6, draft_max=k, given=given)
    assert not seen and sum(persistent.STARTS.values()) == 0  # refused before anything was sent
    s = eng.speculative(PROMPT, 6, draft_max=3, given=[5, 6, 7])
    assert seen[0]["speculative"] == {"draft": "given", "draft_max": 3, "tokens": [5, 6, 7]} and seen[0]["want"] == ["logits"]
    assert s.tokens == [130, 131, 132, 133, 134, 135] and s.logits is None  # no logits.npy named: none read


@pytest.mark.parametrize("mode, message", [
    ("no-counts", "wrote no speculative.json for a speculative generate request"),
    ("bad-json", "tokens.json or speculative.json that is not UTF-8 JSON"),
    ("wrong-k", 'not an object with draft "mtp" and draft_max 3'),
    ("too-many-drafts", "sequence 0 is not per-step non-negative accepted/rejected counts with accepted \\+ rejected <= draft_max 3"),
    ("negative", "sequence 0 is not per-step non-negative"),
    ("bool", "sequence 0 is not per-step non-negative"),
    ("lengths", "sequence 0 is not per-step non-negative"),
    ("extra-step", "sequence 0 has 4 steps giving 7 tokens, but 6 tokens in tokens.json"),
    ("missing-step", "sequence 0 has 2 steps giving 5 tokens, but 6 tokens in tokens.json"),
    ("too-many-ids", "tokens.json that is not a list of at most 6 token ids in \\[0, 515\\)"),
    ("out-of-vocab", "tokens.json that is not a list of at most 6 token ids"),
])
def test_a_malformed_speculative_reply_is_one_engine_error(fakes, mode, message):
    with pytest.raises(EngineError, match=message) as e:
        _fake(mode).speculative(PROMPT, 6, draft_max=3)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("mode, message", [
    ("one-entry", "speculative.json whose sequences is not a list of 2 entries"),
    ("flat-multi", "tokens.json that is not 2 lists of token ids \\(one per sequence\\)"),
])
def test_a_malformed_multi_sequence_reply_is_one_engine_error(fakes, mode, message):
    with pytest.raises(EngineError, match=message):
        _fake(mode).speculative_multi([PROMPT, PROMPT[:5]], 6, draft_max=3)


def test_speculative_needs_its_capabilities_and_a_draft_max(fakes, tmp_path, monkeypatch):
    with pytest.raises(EngineError, match="does not declare the 'speculative' capability"):
        _fake("plain").speculative(PROMPT, 4, draft_max=2)
    with pytest.raises(EngineError, match="does not declare the 'multi_seq' capability"):
        _fake("solo").speculative_multi([PROMPT, PROMPT], 4, draft_max=2)
    with pytest.raises(EngineError, match="does not declare the 'chunks' capability"):
        _fake("solo").speculative(PROMPT, 4, draft_max=2, chunks=[20, 20])
    for bad in (0, -1, True, 1.5):
        with pytest.raises(EngineError, match="draft_max must be an integer >= 1"):
            _fake("good").speculative(PROMPT, 4, draft_max=bad)
    with pytest.raises(EngineError, match="at least one prompt token per sequence"):
        _fake("good").speculative([], 4, draft_max=2)
    assert sum(persistent.STARTS.values()) == 0  # nothing was sent
    from helpers import command_table_refused

    command_table_refused(tmp_path, monkeypatch, '[engines.v1]\ncommand = ["x", "{request}", "{out_dir}"]\ncapabilities = ["speculative"]\n',
                          "capability 'speculative' needs protocol = 2")


# ---------------------------------------------------------------------------------------------
# the example engine's accept path, in process (llama.cpp's MTP context, real state rollback)
# ---------------------------------------------------------------------------------------------
def _example_module():
    path = Path(__file__).resolve().parents[1] / "examples" / "llamacpp_engine.py"
    spec = importlib.util.spec_from_file_location("example_llamacpp_engine", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_example_partly_accepted_drafts_equal_plain_greedy():
    mod = _example_module()
    model = str(fx.build(MTP))
    plain_engine = mod.Engine(model, [])
    n = 14
    plains = [plain_engine.generate({"tokens": q, "n_tokens": n}) for q in (PROMPT, PROMPT[::-1])]

    class Oracular(mod.Engine):
        """Drafts its own plain greedy continuation (every third draft wrong) after llama.cpp's head ran."""

        def propose(self, head, wants):
            real = super().propose(head, wants)  # the head's draft rows go into its KV cache, as for real drafts
            out = {}
            for q, (t, p, _, k) in wants.items():
                prompt, plain = (PROMPT, plains[0]) if q == 0 else (PROMPT[::-1], plains[1])
                at = p - len(prompt) + 1  # index in plain of the token after t
                d = [plain[at + i] if at + i < len(plain) else 0 for i in range(k)]
                if k >= 3:
                    d[2] = (d[2] + 1) % self.llm.n_vocab
                assert len(real[q]) == k
                out[q] = d
            return out

    eng = Oracular(model, [])
    ids, counts = eng.speculative({"tokens": PROMPT, "chunks": [7, 33], "n_tokens": n, "speculative": {"draft": "mtp", "draft_max": 3}})
    assert ids[0] == plains[0]
    assert sum(counts[0]["accepted"]) >= 6 and sum(counts[0]["rejected"]) >= 2, counts
    ids, counts = eng.speculative({"sequences": [{"tokens": PROMPT}, {"tokens": PROMPT[::-1]}], "n_tokens": n,
                                   "speculative": {"draft": "mtp", "draft_max": 3}})
    assert ids == plains
    assert all(sum(c["accepted"]) >= 6 and sum(c["rejected"]) >= 2 for c in counts), counts


def test_example_given_drafts_accept_every_run_and_reject_at_every_depth():
    """Acceptance of issue 53: command:example's accept path with given drafts runs 1 to 8
    accepted in a row and rejects at each depth 1 … 8, exactly as its plain path implies, and
    returns the verify rows of the tokens it emitted."""
    from harness.runs.spec_given import GIVEN_RUNS, plant, runs_wrong

    mod = _example_module()
    eng = mod.Engine(str(fx.build(MTP)), [])
    wrong, n = runs_wrong(GIVEN_RUNS)
    plain = eng.generate({"tokens": PROMPT, "n_tokens": n})
    given = plant(plain, wrong, eng.llm.n_vocab)
    ids, counts = eng.speculative({"tokens": PROMPT, "n_tokens": n, "speculative": {"draft": "given", "draft_max": 8, "tokens": given}})
    assert ids[0] == plain
    assert counts[0] == {"accepted": list(GIVEN_RUNS), "rejected": [8 - a for a in GIVEN_RUNS]}
    rows = np.asarray(eng.spec_rows[0])
    assert rows.shape == (n, eng.llm.n_vocab) and (rows.argmax(axis=1) == plain).all()
    for bad, why in (({"draft_max": 9, "tokens": given}, "at most 8 per step"), ({"draft_max": 8, "tokens": [10 ** 6]}, "not a token id")):
        with pytest.raises(ValueError, match=why):
            eng.speculative({"tokens": PROMPT, "n_tokens": n, "speculative": {"draft": "given", **bad}})
