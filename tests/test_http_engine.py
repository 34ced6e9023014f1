"""``http:NAME`` engines (harness/engines/http_engine.py) and the top-k tier (harness/measure/topk.py).

A real llama-cpp-python OpenAI-compatible server (the ``server`` extra) is started once for the
module on a free 127.0.0.1 port, with other threads and batch size than the reference
(``n_threads`` 1, ``n_batch``/``n_ubatch`` 7 vs the reference's 2 and 512): ``harness parity
--candidate http:local`` PASSes against it on the default model, and FAILs against the same server
started on a copy whose ``output_norm`` is rescaled, naming prompt and position. The bad-server
catalogue (connection refused, timeout, HTTP error, malformed JSON, missing logprobs, another
model, another tokenization) runs against a tiny fake server in a thread; the response shapes of
the other server kinds (vLLM ``prompt_logprobs``, llama-server ``/completion``) are checked
against logits whose top-k is known.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest

from harness.cli import main as cli_main
from harness.measure import metrics, topk
from harness.runs import probes
from harness.config import HarnessConfig
from harness.engines import http_engine
from harness.engines.base import TopK
from harness.engines.http_engine import HttpEngine, HttpSpec, configured_servers, wait_until_up
from harness.errors import EngineError, InvalidInput, NotComparable, Verdict
from harness.fixtures.resolve import default_model, resolve_model
from harness.judge.thresholds import load_thresholds
from harness.judge.tiers import Row, Subject, find_topk_row

MODEL = resolve_model(default_model())
REPO = Path(__file__).resolve().parent.parent

pytest.importorskip("llama_cpp.server.app", reason="needs llama-cpp-python's server extra (pip install -e .[server])")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def llama_cpp_server(model: Path, alias: str = "trained-qwen35"):
    """llama-cpp-python's server on ``model`` at a free local port; yields its URL, stops it after."""
    port = free_port()
    cmd = [sys.executable, "-m", "llama_cpp.server", "--model", str(model), "--model_alias", alias, "--host", "127.0.0.1",
           "--port", str(port), "--n_threads", "1", "--n_threads_batch", "1", "--n_batch", "7", "--n_ubatch", "7",
           "--n_ctx", "2048", "--verbose", "false"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        if not wait_until_up(url, 120):
            proc.kill()
            raise RuntimeError(f"llama-cpp-python server did not start: {proc.stderr.read().decode()[-2000:]}")
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="module")
def server_url():
    with llama_cpp_server(MODEL) as url:
        yield url


def _parity(tmp_path: Path, url: str, *extra: str) -> tuple[int, dict[str, Any]]:
    os.environ["HARNESS_LOCAL_URL"] = url
    try:
        rc = cli_main(["parity", "--candidate", "http:local", "--ledger", str(tmp_path / "ledger.jsonl"), "--no-localize", *extra])
    finally:
        del os.environ["HARNESS_LOCAL_URL"]
    receipts = sorted((tmp_path / "receipts").glob("*/*.json"))
    return rc, json.loads(receipts[-1].read_text()) if receipts else {}


@pytest.fixture
def in_repo(monkeypatch):
    """Run from the repository root so its pyproject.toml ([tool.harness.http.local]) is the config."""
    monkeypatch.chdir(REPO)
    monkeypatch.delenv("HARNESS_CONFIG", raising=False)


# ------------------------------------------------------------------------------ the real server
def test_parity_passes_against_llama_cpp_python_server(server_url, tmp_path, in_repo, capsys):
    rc, rec = _parity(tmp_path, server_url)
    out = capsys.readouterr()
    assert rc == 0, out.err + out.out
    g = rec["gated"]
    assert g["verdict"] == "PASS"
    assert g["topk"]["status"] == "ok" and g["topk"]["k"] == 20
    # the cosine release gate is never computed for a top-k candidate, and never reported as passed
    assert g["cosine_computed"] is False and g["release"]["status"] == "unmeasured"
    assert "NOT COMPUTED" in g["release"]["line"] and g["min_cosine_observed"] is None
    assert all(c["ok"] for c in g["topk"]["checks"]) and len(g["topk"]["checks"]) == 2
    assert rec["report_only"]["kld"]["mean"] < rec["thresholds"]["topk"]["gates"]["max_topk_kld_mean"]["value"]
    assert rec["report_only"]["compared_positions"] == rec["prompts"]["positions"]  # position 0 too
    s = rec["engines"]["candidate"]["settings"]
    assert s["url"] == server_url and s["kind"] == "llama-cpp-python" and s["served_model"] == "trained-qwen35"
    fr = rec["report_only"]["free_running"]  # the server generates at temperature 0 beside the reference
    assert "unmeasured" not in fr and len(fr["prompts"]) == len(rec["prompts"]["items"]) and fr["hard"] == 0
    # the console shows the tier that judged, and never calls the verdict the release gate's (it was not computed)
    assert g["topk"]["line"] in out.out and "PASS: top-k tier ok" in out.out
    assert "verdict is the release gate's" not in out.out


def _rescaled_copy(tmp_path: Path, factor: float) -> Path:
    import gguf

    dst = tmp_path / "rescaled-output-norm.gguf"
    shutil.copyfile(MODEL, dst)
    reader = gguf.GGUFReader(dst, "r+")
    t = next(t for t in reader.tensors if t.name == "output_norm.weight")
    t.data[...] = t.data * factor
    reader.data.flush()
    del reader
    return dst


def test_parity_fails_against_server_on_rescaled_output_norm(tmp_path, in_repo, capsys):
    with llama_cpp_server(_rescaled_copy(tmp_path, 1.25)) as url:
        rc, rec = _parity(tmp_path, url)
    err = capsys.readouterr().err
    assert rc == 1
    g = rec["gated"]
    assert g["verdict"] == "FAIL" and g["topk"]["status"] == "fail"
    where = g["max_kld_where"]
    assert where["prompt"] in {p["id"] for p in rec["prompts"]["items"]}
    assert f"prompt {where['prompt']!r} position {where['position']}" in g["message"]
    assert "top-k KLD mean" in g["message"] and "FAIL" in g["message"]
    assert g["cosine_computed"] is False
    report = next((tmp_path / "reports").glob("*/report.md")).read_text()
    assert "| top-k tier: top-k KLD mean |" in report and "**FAILED**" in report
    assert "not computed: the candidate gives top-k logprobs" in report


def test_generate_is_greedy(server_url):
    from harness.engines.base import gather
    from harness.engines.llamacpp import LlamaCppEngine

    eng = HttpEngine(HttpSpec("local", server_url, "trained-qwen35"), MODEL)
    ref = LlamaCppEngine(MODEL)
    prompt = ref.tokenize("def main():\n    ")
    got = eng.generate(prompt, 6)
    assert 1 <= len(got) <= 6
    seq = list(prompt)
    for t in got:  # each generated id is the reference's argmax (or a near-tie) after the tokens before it
        row = gather(ref.logits(seq), len(seq))[-1]
        top2 = np.sort(row)[-2:]
        assert t == int(np.argmax(row)) or top2[1] - top2[0] < metrics.NEAR_TIE_MARGIN
        seq.append(t)


def test_probes_multiseq_and_ubatch_are_unmeasured_for_a_server(server_url):
    eng = HttpEngine(HttpSpec("local", server_url, "trained-qwen35"), MODEL)
    assert "multi_seq" not in eng.info.capabilities and "n_ubatch" not in eng.info.capabilities
    tol = probes.ProbeTolerance()
    assert probes.probe_multiseq(eng, [[1, 2, 3]], tol).verdict is Verdict.UNMEASURED
    assert probes.probe_ubatch(eng, [1, 2, 3], tol).verdict is Verdict.UNMEASURED


def test_probe_run_on_a_server_is_unmeasured_never_pass(server_url, tmp_path, in_repo, monkeypatch, capsys):
    monkeypatch.setenv("HARNESS_LOCAL_URL", server_url)
    rc = cli_main(["probe", "--candidate", "http:local", "--only", "multiseq", "--only", "ubatch", "--only", "determinism",
                   "--ledger", str(tmp_path / "ledger.jsonl"), "--no-localize", "--json"])
    rec = json.loads(capsys.readouterr().out)
    assert rc == 5 and rec["verdict"] == "UNMEASURED"
    assert {p["name"]: p["verdict"] for p in rec["probes"]} == {"multiseq": "UNMEASURED", "ubatch": "UNMEASURED", "determinism": "UNMEASURED"}


# ------------------------------------------------------------------------------ a fake server
class FakeServer:
    """http.server in a thread: ``handler(path, body) -> (status, bytes)``; records requests."""

    def __init__(self, handler: Callable[[str, dict], tuple[int, bytes]]):
        self.handler, self.requests = handler, []
        outer = self

        class H(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 (http.server's name)
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                outer.requests.append((self.path, body, dict(self.headers)))
                status, data = outer.handler(self.path, body)
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *a):
                pass

        class Quiet(ThreadingHTTPServer):
            def handle_error(self, request, client_address):  # a client that hung up (the timeout case)
                pass

        self.httpd = Quiet(("127.0.0.1", 0), H)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def fake():
    servers = []

    def make(handler, **spec):
        s = FakeServer(handler)
        servers.append(s)
        return s, HttpEngine(HttpSpec("fake", s.url, "m", **spec), MODEL)

    yield make
    for s in servers:
        s.close()


def _known_logits(n: int, v: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, v)) * 3


def _id_entries(row: np.ndarray, k: int, style: str) -> Any:
    top = topk.cut_topk(row[None, :], k)
    pairs = list(zip(top.ids[0].tolist(), top.logprobs[0].tolist()))
    if style == "vllm-prompt":
        return {str(i): {"logprob": lp, "rank": r + 1, "decoded_token": "x"} for r, (i, lp) in enumerate(pairs)}
    if style == "vllm-top":
        return {f"token_id:{i}": lp for i, lp in pairs}
    return [{"id": i, "token": "x", "logprob": lp} for i, lp in pairs]


def test_vllm_prompt_logprobs_shape_lines_up(fake):
    """vLLM: prompt_logprobs[i] predicted token i (row i-1); the generated token's top logprobs are row T-1."""
    tokens = [5, 9, 13, 200, 7]
    L = _known_logits(len(tokens), 515)

    def handler(path, body):
        assert path == "/v1/completions" and body["prompt"] == tokens and body["return_tokens_as_token_ids"] is True
        k = body["prompt_logprobs"]
        pl = [None] + [_id_entries(L[i - 1], k, "vllm-prompt") for i in range(1, len(tokens))]
        return 200, json.dumps({"model": "m", "choices": [{"text": "", "prompt_logprobs": pl,
                                "logprobs": {"top_logprobs": [_id_entries(L[-1], k, "vllm-top")]}}]}).encode()

    srv, eng = fake(handler, kind="vllm", max_logprobs=5)
    got = eng.topk(tokens)
    want = topk.cut_topk(L, 5)
    assert np.array_equal(got.ids, want.ids) and np.allclose(got.logprobs, want.logprobs)
    assert len(srv.requests) == 1  # every position in one request


def test_llama_server_per_position_shape_lines_up(fake):
    """llama-server: one /completion request per position, the prompt cut after it, ids as keys."""
    tokens = [5, 9, 13, 200]
    L = _known_logits(len(tokens), 515, 1)

    def handler(path, body):
        assert path == "/completion" and body["temperature"] == 0
        row = L[len(body["prompt"]) - 1]
        return 200, json.dumps({"completion_probabilities": [{"id": 1, "logprob": -1.0,
                                "top_logprobs": _id_entries(row, body["n_probs"], "llama-server")}]}).encode()

    srv, eng = fake(handler, kind="llama-server", max_logprobs=4)
    got = eng.topk(tokens)
    want = topk.cut_topk(L, 4)
    assert np.array_equal(got.ids, want.ids) and np.allclose(got.logprobs, want.logprobs)
    assert [len(b["prompt"]) for _, b, _ in srv.requests] == [1, 2, 3, 4]


def _withholding_llama_server(L: np.ndarray, eng_bytes: Callable[[int], bytes]):
    """A llama-server-shaped fake that withholds, as the real one does (``process_token``), a
    greedy pick whose text ends in a cut UTF-8 character: with ``n_predict`` 1 it then answers
    with the token id and no ``completion_probabilities``. ``logit_bias`` false bans an id from
    sampling and leaves the probabilities of the raw logits as they are."""

    def handler(path, body):
        row = L[len(body["prompt"]) - 1].copy()
        banned = [t for t, b in body.get("logit_bias", []) if b is False]
        sampled = max((i for i in range(len(row)) if i not in banned), key=lambda i: row[i])
        if http_engine.ends_in_cut_utf8(eng_bytes(sampled)):
            return 200, json.dumps({"content": "", "tokens": [sampled], "stop_type": "limit"}).encode()
        return 200, json.dumps({"tokens": [sampled], "completion_probabilities": [{"id": sampled, "logprob": -1.0,
                                "top_logprobs": _id_entries(row, body["n_probs"], "llama-server")}]}).encode()

    return handler


def test_llama_server_withheld_cut_utf8_picks_are_banned_and_the_row_is_the_raw_one(fake):
    """llama-server answered the MoE-256 fixtures without completion_probabilities where the
    greedy pick was a token ending in a cut UTF-8 character (``' \\xe2'``): it waits for the bytes
    that complete it, and n_predict 1 gives none. Banning that pick moves the sampler, not the
    probabilities: the row is the full top-k, the banned ids in it at their own logprobs."""
    tokens = [5, 9, 13, 200]
    L = _known_logits(len(tokens), 515, 2)
    L[:, 7] = 30.0  # id 7 (b'\x07', whole) the greedy pick elsewhere
    L[1, 194], L[1, 226] = 40.0, 39.0  # b'\xc2' then b'\xe2': two withheld picks at position 1
    srv, eng = fake(lambda p, b: (0, b""), kind="llama-server", max_logprobs=4)
    srv.handler = _withholding_llama_server(L, eng._token_bytes)
    got = eng.topk(tokens)
    want = topk.cut_topk(L, 4)
    assert np.array_equal(got.ids, want.ids) and np.allclose(got.logprobs, want.logprobs)
    assert got.ids[1, :2].tolist() == [194, 226]
    asked = [(len(b["prompt"]), b.get("logit_bias")) for _, b, _ in srv.requests]
    assert asked == [(1, None), (2, None), (2, [[194, False]]), (2, [[194, False], [226, False]]), (3, None), (4, None)]


def test_llama_server_missing_probabilities_for_another_cause_or_too_many_withheld_is_a_precise_error(fake):
    tokens = [5, 9]
    L = _known_logits(len(tokens), 515, 3)
    L[1, 192:192 + http_engine.MAX_WITHHELD + 1] = 50.0 - np.arange(http_engine.MAX_WITHHELD + 1)  # every pick a lead byte
    srv, eng = fake(lambda p, b: (0, b""), kind="llama-server", max_logprobs=4)
    srv.handler = _withholding_llama_server(L, eng._token_bytes)
    with pytest.raises(EngineError, match=r"at position 1: every greedy pick ends in a cut UTF-8 character.*8 at most"):
        eng.topk(tokens)
    srv.handler = lambda p, b: (200, json.dumps({"content": "a", "tokens": [97], "stop_type": "eos"}).encode())
    with pytest.raises(EngineError, match=r"at position 0: it sampled \[97\] \(stop_type eos\), not a token it withholds"):
        eng.topk(tokens)


def test_ends_in_cut_utf8_is_llama_servers_rule():
    cut = [b"\xc2", b" \xe2", b"\xe2\x82", b"\xf0\x9f\x98", b"ab\xf0"]
    whole = [b"", b"a", "é".encode(), "€".encode(), "😀".encode(), b"\x82", b"\xff", b"\xe2\x82\xac\x82"]
    assert [http_engine.ends_in_cut_utf8(b) for b in cut] == [True] * len(cut)
    assert [http_engine.ends_in_cut_utf8(b) for b in whole] == [False] * len(whole)


def _echo_server(tokens, L, keys, text_of, model="m"):
    """A llama-cpp-python-shaped fake: echo entry i = row i keyed by text, entry 0 null; a
    non-echo request's first entry is the last prompt row; /extras/tokenize gives back the prefix
    of ``tokens`` whose text (``text_of``) is the input."""
    def entries(row, k):
        top = topk.cut_topk(row[None, :], k)
        return {keys[i]: lp for i, lp in zip(top.ids[0].tolist(), top.logprobs[0].tolist())}

    def handler(path, body):
        if path == "/extras/tokenize":
            j = next(j for j in range(1, len(tokens) + 1) if text_of(tokens[:j]) == body["input"])
            return 200, json.dumps({"tokens": tokens[:j]}).encode()
        n = len(tokens) if body.get("echo") else 1
        k = body["logprobs"]
        tops = [None] + [entries(L[i], k) for i in range(1, n)] if body.get("echo") else [entries(L[0], k)]
        return 200, json.dumps({"model": model, "choices": [{"text": "", "logprobs": {"top_logprobs": tops}}]}).encode()
    return handler


def test_llama_cpp_python_echo_shape_lines_up_and_ambiguous_keys_go_to_the_tail(fake):
    """echo entry i is the distribution after tokens[:i+1] (entry 0 null, fetched alone); text keys
    map to ids through the reference vocabulary, and a text several ids decode to is dropped."""
    srv, eng = fake(lambda p, b: (200, b"{}"), kind="llama-cpp-python", max_logprobs=6)
    keys_by_id = {i: key for key, i in eng._keys.items() if i is not None}
    ambiguous = [key for key, i in eng._keys.items() if i is None]
    assert "" in ambiguous  # control tokens (and undecodable bytes) render empty: never one id
    tokens = [t for t in sorted(keys_by_id)[40:46]]
    L = _known_logits(len(tokens), 515, 2)
    keys = {i: keys_by_id.get(i, ambiguous[0]) for i in range(515)}
    srv.handler = _echo_server(tokens, L, keys, eng._prompt_text)
    got = eng.topk(tokens)
    want = topk.cut_topk(L, 6)
    for t in range(len(tokens)):
        exp = [(i, lp) for i, lp in zip(want.ids[t], want.logprobs[t]) if i in keys_by_id]
        row = [(i, lp) for i, lp in zip(got.ids[t], got.logprobs[t]) if i >= 0]
        assert [i for i, _ in row] == [i for i, _ in exp] and np.allclose([lp for _, lp in row], [lp for _, lp in exp])
    assert [b.get("echo", False) for p, b, _ in srv.requests if p == "/v1/completions"] == [True, False]


def test_topk_kld_sees_the_ambiguous_mass_as_tail():
    r = np.log(np.array([[0.5, 0.3, 0.2]], np.float32))
    full = TopK(np.array([[0, 1, 2]]), np.log(np.array([[0.5, 0.3, 0.2]])))
    assert topk.topk_position_metrics(r, full)["kld"][0] == pytest.approx(0.0, abs=1e-7)
    # id 1 ambiguous: dropped; the tail (ids 1, 2) holds 0.5 on both sides
    tail = TopK(np.array([[0, -1, 2]]), np.array([[np.log(0.5), np.nan, np.log(0.2)]]))
    assert topk.topk_position_metrics(r, tail)["kld"][0] == pytest.approx(0.0, abs=1e-7)
    # the dropped entry (0.5) outweighs every mapped one: the candidate's top-1 is unknown, left out of greedy agreement
    hidden = TopK(np.array([[0, 2]]), np.log(np.array([[0.2, 0.3]])), np.log(np.array([0.5])))
    r2 = np.log(np.array([[0.2, 0.5, 0.3]], np.float32))
    pm = topk.topk_position_metrics(r2, hidden)
    assert not pm["top1_known"][0] and pm["kld"][0] == pytest.approx(0.0, abs=1e-7)
    pm["prompt_index"] = np.zeros(1, np.int32)
    s = topk.summarize_topk(pm)
    assert s["topk"]["top1_unknown"] == 1 and s["argmax_agreement"]["n"] == 0 and s["compared_positions"] == 1
    wrong = TopK(np.array([[0, 2]]), np.log(np.array([[0.7, 0.1]])))
    p = np.array([0.5, 0.2, 0.3])
    q = np.array([0.7, 0.1, 0.2])
    assert topk.topk_position_metrics(r, wrong)["kld"][0] == pytest.approx(float(np.sum(p * np.log(p / q))), rel=1e-5)


@pytest.mark.parametrize("seed", range(4))
def test_topk_kld_is_below_the_full_kld_and_equals_it_at_k_equal_v(seed):
    rng = np.random.default_rng(seed)
    ref = rng.standard_normal((8, 64)).astype(np.float32) * 2
    cand = (ref + rng.standard_normal(ref.shape).astype(np.float32) * 0.3).astype(np.float32)
    full = metrics.kl_divergence(ref, cand)
    for k in (1, 5, 20):
        assert np.all(topk.topk_position_metrics(ref, topk.cut_topk(cand, k))["kld"] <= full + 1e-6)
    assert np.allclose(topk.topk_position_metrics(ref, topk.cut_topk(cand, 64))["kld"], full, rtol=1e-4, atol=1e-7)
    same = topk.topk_position_metrics(ref, topk.cut_topk(ref, 5))
    assert same["argmax_agree"].all() and (same["cand_rank"] == 0).all() and np.allclose(same["top5_overlap"], 1.0)


# ------------------------------------------------------------------------------ bad servers
def _completion(body: dict) -> bytes:
    return json.dumps({"model": "m", "choices": [{"text": "", "logprobs": {"top_logprobs": [None, {"a": -0.1}]}}]}).encode()


BAD_SERVERS = {
    "http-error": (lambda p, b: (500, b"internal error \x1b[31m"), EngineError, "answered HTTP 500"),
    "malformed-json": (lambda p, b: (200, b"{not json"), EngineError, "malformed JSON"),
    "missing-logprobs": (lambda p, b: (200, json.dumps({"tokens": [5, 9]}).encode()) if p == "/extras/tokenize"
                         else (200, json.dumps({"model": "m", "choices": [{"text": "x", "logprobs": None}]}).encode()),
                         EngineError, "missing logprobs"),
    "another-model": (lambda p, b: (200, json.dumps({"tokens": [5, 9]}).encode()) if p == "/extras/tokenize"
                      else (200, json.dumps({"model": "other-model", "choices": []}).encode()), NotComparable, "answered for model 'other-model'"),
    "another-tokenization": (lambda p, b: (200, json.dumps({"tokens": [5, 8]}).encode()), NotComparable, "first difference at position 1"),
}


@pytest.mark.parametrize("case", sorted(BAD_SERVERS))
def test_bad_server_is_one_line_engine_error_or_not_comparable(fake, case):
    handler, exc, text = BAD_SERVERS[case]
    _, eng = fake(handler)
    with pytest.raises(exc) as e:
        eng.topk([5, 9])
    msg = str(e.value)
    assert text in msg and "\n" not in msg and "\x1b" not in msg
    assert e.value.verdict in (Verdict.ENGINE_ERROR, Verdict.NOT_COMPARABLE)


def test_connection_refused_and_timeout_are_engine_errors(fake):
    eng = HttpEngine(HttpSpec("gone", f"http://127.0.0.1:{free_port()}", "m"), MODEL)
    with pytest.raises(EngineError, match="connection refused"):
        eng.topk([5, 9])

    def slow(p, b):
        time.sleep(1.5)
        return 200, b"{}"
    _, eng = fake(slow, timeout_s=0.3)
    with pytest.raises(EngineError, match=r"timed out after 0\.3 s"):
        eng.topk([5, 9])


def test_bad_server_through_the_cli_is_one_line_and_its_exit_code(fake, tmp_path, monkeypatch, capsys):
    srv, _ = fake(BAD_SERVERS["another-model"][0])
    cfg = tmp_path / "harness.toml"
    cfg.write_text(f'[http.bad]\nurl = "{srv.url}"\nmodel = "m"\n')
    monkeypatch.setenv("HARNESS_CONFIG", str(cfg))
    rc = cli_main(["parity", "--candidate", "http:bad", "--no-evidence", "--prompts", str(_one_prompt(tmp_path))])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 4 and len(err) == 1 and err[0].startswith("harness: NOT-COMPARABLE:") and "other-model" in err[0]


def _one_prompt(tmp_path: Path) -> Path:
    p = tmp_path / "p.jsonl"
    p.write_text(json.dumps({"id": "one", "tokens": [5, 9]}) + "\n")
    return p


# ------------------------------------------------------------------------------ configuration
def test_config_validation_and_no_secret_in_info(fake, monkeypatch, tmp_path):
    cfg = HarnessConfig({"http": {"x": {"url": "http://127.0.0.1:1/v1?key=SECRET", "model": "m", "api_key_env": "MY_KEY",
                                        "url_env": "X_URL"}}}, tmp_path / "pyproject.toml")
    monkeypatch.delenv("X_URL", raising=False)
    spec = configured_servers(cfg)["x"]
    assert spec.safe_url == "http://127.0.0.1:1/v1"
    monkeypatch.setenv("X_URL", "http://127.0.0.1:2")
    assert configured_servers(cfg)["x"].url == "http://127.0.0.1:2"
    for bad, field in (({"url": "ftp://x", "model": "m"}, "url"), ({"url": "http://h", "model": "m", "kind": "ollama"}, "kind"),
                       ({"url": "http://h", "model": "m", "max_logprobs": 0}, "max_logprobs"),
                       ({"url": "http://h", "model": "m", "api_key": "s"}, "unknown key")):
        with pytest.raises(InvalidInput, match=field):
            configured_servers(HarnessConfig({"http": {"b": bad}}, tmp_path / "pyproject.toml"))
    tokens = [5, 9]
    L = _known_logits(2, 515, 3)
    srv, eng = fake(None, api_key_env="MY_KEY", max_logprobs=3)
    keys = {i: k for k, i in eng._keys.items() if i is not None}
    srv.handler = _echo_server(tokens, L, {i: keys.get(i, "") for i in range(515)}, eng._prompt_text)
    monkeypatch.setenv("MY_KEY", "s3cr3t-token")
    eng.topk(tokens)
    assert all(h.get("Authorization") == "Bearer s3cr3t-token" for _, _, h in srv.requests)
    assert "s3cr3t-token" not in json.dumps(eng.info.to_dict())
    monkeypatch.delenv("MY_KEY")
    with pytest.raises(EngineError, match="MY_KEY is not set"):
        eng.topk(tokens)


def test_topk_rows_fit_by_weights_class_and_k():
    th = load_thresholds(REPO / "thresholds.yaml")
    rows = th.topk_rows
    assert {(r.weights, r.compute_class) for r in rows} >= {("F32", "f32"), ("F32", "f64")}
    subj = Subject("F32", "ALL_F32", "f32", True, 8, 96)
    row, _ = find_topk_row(rows, subj, 50)
    assert row is not None and row.k <= 50 and row.gates["max_topk_kld_mean"]["basis"]["kind"] == "measured"
    none, why = find_topk_row(rows, subj, 1)
    assert none is None and "k" in why
    other, why = find_topk_row(rows, Subject("F32+Q4_K", "Q4_K_M", "f32", True, 8, 96), 20)
    assert other is None and "no top-k row" in why
    r = Row("F32", "f32", ({"name": "m", "n_layer": 8, "n_embd": 96},), {}, {}, "x", k=10)
    assert find_topk_row([r], subj, 9)[0] is None and find_topk_row([r], subj, 10)[0] is r


def test_calibrate_topk_derives_a_row_from_cut_known_good_pairs(tmp_path):
    from harness.runs.calibrate import calibrate_topk, merge_topk_rows

    rows = calibrate_topk(5, ("f64",), ("fixture:trained-qwen35",), ("dt-bias-dropped",), max_tokens=24, log=lambda m: None,
                          command="harness calibrate --topk 5 --classes f64")
    (row,) = rows
    assert (row["weights"], row["class"], row["k"]) == ("F32", "f64", 5)
    g = row["gates"]["max_topk_kld_mean"]
    assert g["basis"]["kind"] == "measured" and g["basis"]["known_good_floor"] <= g["value"]
    assert g["basis"]["known_bad"][0]["what"] == "mutant:dt-bias-dropped" and g["basis"]["known_bad"][0]["value"] > g["value"]
    dst = tmp_path / "thresholds.yaml"
    shutil.copyfile(REPO / "thresholds.yaml", dst)
    before = load_thresholds(dst).data
    merge_topk_rows(dst, rows)
    after = load_thresholds(dst).data
    assert after["calibrated"] == before["calibrated"] and after["release"] == before["release"]
    assert [r for r in after["topk"] if r["k"] == 5] == rows and len(after["topk"]) == len(before.get("topk", [])) + 1


def _json_values():
    from hypothesis import strategies as st

    leaf = st.one_of(st.none(), st.booleans(), st.integers(-5, 600), st.floats(allow_nan=False, allow_infinity=False),
                     st.text(max_size=4), st.sampled_from(["token_id:5", "5", "a", ""]))
    return st.recursive(leaf, lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(
        st.sampled_from(["model", "choices", "logprobs", "top_logprobs", "prompt_logprobs", "tokens", "text", "logprob", "id",
                         "completion_probabilities", "m", "5", "token_id:9"]), inner, max_size=5)), max_leaves=20)


@pytest.mark.parametrize("kind", sorted(http_engine.KINDS))
def test_any_json_answer_is_a_result_or_a_harness_error(fake, kind):
    """Whatever JSON a server answers, the engine gives top-k rows or raises EngineError /
    NotComparable: never another exception (hypothesis, a fixed-seed budget as tests/test_fuzz.py)."""
    from hypothesis import given, settings

    answer: list[Any] = [None]
    srv, eng = fake(lambda p, b: (200, json.dumps(answer[0]).encode()), kind=kind, max_logprobs=3)

    @settings(max_examples=int(os.environ.get("HARNESS_FUZZ_EXAMPLES", "60")), deadline=None, derandomize=True, database=None)
    @given(_json_values())
    def check(value):
        answer[0] = value
        try:
            top = eng.topk([5, 9])
        except (EngineError, NotComparable):
            return
        assert top.ids.shape == (2, 3) and np.all((top.ids >= -1) & (top.ids < eng.n_vocab))

    check()


def test_a_full_calibration_keeps_the_top_k_rows(tmp_path):
    from harness.runs.calibrate.document import kept_rows

    kept = kept_rows(REPO / "thresholds.yaml", "topk")
    assert kept == load_thresholds(REPO / "thresholds.yaml").data["topk"] and {r["k"] for r in kept} == {20}
    assert kept_rows(tmp_path / "absent.yaml", "topk") == []
