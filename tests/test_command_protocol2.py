"""Command protocol 2 (docs/engine-protocol.md, "Protocol 2"): one persistent engine process per
model spoken to in JSON lines. A test for each message against the example engine
(examples/llamacpp_engine.py, real llama.cpp), and the misbehaving-engine catalogue against fakes:
each is one clear ENGINE-ERROR, never a hang or a crash of the harness."""

from __future__ import annotations

import textwrap

import numpy as np
import pytest
from helpers import command_table_refused, engine_starts, fresh_engine_processes  # noqa: F401 (a fixture)

from harness.measure.metrics import cosine
from harness.runs.probes import ProbeTolerance, probe_multiseq, probe_prefix, probe_ubatch
from harness.engines import persistent
from harness.engines.base import gather
from harness.engines.command import load_command_engine
from harness.engines.llamacpp import LlamaCppEngine
from harness.errors import EngineError, Verdict
from harness.fixtures import synthetic as fx

TOKENS = list(range(30, 130))
TOL = ProbeTolerance(min_cosine=0.99999, max_kld=1e-4)


pytestmark = pytest.mark.usefixtures("fresh_engine_processes")


@pytest.fixture(scope="module")
def ref():
    return LlamaCppEngine(fx.build("tiny-qwen35"))


def test_logits_message_and_one_process_for_many_requests(ref):
    eng = load_command_engine("example", fx.build("tiny-qwen35"))
    assert eng.spec.protocol == 2
    got = gather(eng.logits(TOKENS), len(TOKENS))
    assert cosine(gather(ref.logits(TOKENS)), got).min() > 0.9999
    pieces = gather(eng.logits(TOKENS, chunks=[13, 87]), len(TOKENS))
    assert cosine(got, pieces).min() > 0.99999
    again = load_command_engine("example", fx.build("tiny-qwen35"))  # another engine object, same model
    assert np.array_equal(gather(again.logits(TOKENS)), got)
    assert engine_starts() == 1
    assert eng.info.build["reported_name"] == "example-llamacpp" and eng.info.settings["protocol"] == 2
    load_command_engine("example", fx.build("tiny-qwen35moe")).logits(TOKENS[:20]).__next__()
    assert engine_starts() == 2  # one per model


def test_sequences_message_each_with_its_own_chunks():
    eng = load_command_engine("example", fx.build("tiny-qwen35"))
    a, b, c = TOKENS[:40], TOKENS[40:70], TOKENS[70:]
    together = gather(eng.logits_multi([a, b, c], chunks=[[10, 30], None, [5, 25]]), 100)
    for q, rows in ((a, together[:40]), (b, together[40:70]), (c, together[70:])):
        assert cosine(gather(eng.logits(q)), rows).min() > 0.99999
    assert probe_multiseq(eng, [a, b, c], TOL).verdict is Verdict.PASS


def test_n_ubatch_setting_reaches_the_engine():
    eng = load_command_engine("example", fx.build("tiny-qwen35"))
    base = gather(eng.logits(TOKENS))
    small = eng.with_settings(n_ubatch=7)
    assert cosine(base, gather(small.logits(TOKENS))).min() > 0.99999
    assert small.info.settings["reported"]["n_ubatch"] == 7 and small.info.settings["n_ubatch"] == 7
    assert probe_ubatch(eng, TOKENS, TOL, sizes=(1, 7)).verdict is Verdict.PASS
    with pytest.raises(EngineError, match="no setting 'n_batch'"):
        eng.with_settings(n_batch=3)
    assert engine_starts() == 1


def test_generate_message_matches_llama_cpp(ref):
    eng = load_command_engine("example", fx.build("tiny-qwen35"))
    assert eng.generate(TOKENS[:30], 12) == ref.generate(TOKENS[:30], 12)


def test_session_messages_fork_continue_and_drop():
    eng = load_command_engine("example", fx.build("tiny-qwen35"))
    A, B, C = TOKENS[:50], TOKENS[50:80], TOKENS[80:]
    gather(eng.session_logits(A + B, session="s", checkpoints=[50]))
    forked = gather(eng.session_logits(C, session="t", parent="s", after=50))
    assert cosine(gather(eng.logits(A + C))[50:], forked).min() > 0.99999
    cont = gather(eng.session_logits(C, session="s", parent="s", after=80))
    assert cosine(gather(eng.logits(A + B + C))[80:], cont).min() > 0.99999
    assert probe_prefix(eng, TOKENS, TOL).verdict is Verdict.PASS
    eng.drop_sessions()
    with pytest.raises(EngineError, match="refused request .*no state after 50 tokens"):
        gather(eng.session_logits(C, session="t", parent="s", after=50))
    assert gather(eng.logits(A)).shape == (50, eng.n_vocab)  # a refusal keeps the process
    assert engine_starts() == 1


def test_undeclared_capabilities_are_unmeasured_never_pass(tmp_path, monkeypatch):
    cfg = tmp_path / "harness.toml"
    example = fx.DATA_DIR.parent.parent / "examples" / "llamacpp_engine.py"
    cfg.write_text(f'[engines.plain]\ncommand = ["{{python}}", "{example}", "--serve"]\nprotocol = 2\ncapabilities = ["chunks"]\n')
    monkeypatch.setenv("HARNESS_CONFIG", str(cfg))
    eng = load_command_engine("plain", fx.build("tiny-qwen35"))
    for r in (probe_multiseq(eng, [TOKENS[:20]] * 3, TOL), probe_ubatch(eng, TOKENS, TOL), probe_prefix(eng, TOKENS, TOL)):
        assert r.verdict is Verdict.UNMEASURED and not r.comparisons, r.name
    with pytest.raises(EngineError, match="does not declare the 'generate' capability"):
        eng.generate(TOKENS, 3)
    assert engine_starts() == 0  # nothing was sent


# ---------------------------------------------------------------------------------------------
# misbehaving protocol-2 engines
# ---------------------------------------------------------------------------------------------
SERVE = """
import json, sys, os, time
import numpy as np
V = 515
for line in sys.stdin:
    req = json.loads(line)
    out = req["out_dir"]
{body}
"""

FAKES = {
    "good": "    np.save(out + '/logits.npy', np.zeros((len(req['tokens']), V), np.float32)); print(json.dumps({'id': req['id'], 'ok': True, 'files': ['logits.npy']}), flush=True)",
    "not-json": "    print('hello there', flush=True)",
    "wrong-id": "    print(json.dumps({'id': req['id'] + 1, 'ok': True}), flush=True)",
    "refuses": "    print(json.dumps({'id': req['id'], 'ok': False, 'error': 'out of \\x1b[31mmemory'}), flush=True)",
    "hangs": "    time.sleep(60)",
    "exits": "    sys.stderr.write('CUDA error: illegal address\\n'); sys.exit(7)",
    "odd-file": "    print(json.dumps({'id': req['id'], 'ok': True, 'files': ['../../etc/passwd']}), flush=True)",
    "huge-line": "    sys.stdout.write('x' * (3 << 20)); sys.stdout.flush(); time.sleep(60)",
}


@pytest.fixture()
def fakes(tmp_path, monkeypatch):
    tables = []
    for name, body in FAKES.items():
        script = tmp_path / f"fake2_{name}.py"
        script.write_text(textwrap.dedent(SERVE).format(body=body))
        tables.append(f'[engines.{name}]\ncommand = ["{{python}}", "{script}"]\nprotocol = 2\ntimeout_s = 3\n')
    cfg = tmp_path / "harness.toml"
    cfg.write_text("\n".join(tables))
    monkeypatch.setenv("HARNESS_CONFIG", str(cfg))


def _logits(name):
    return gather(load_command_engine(name, fx.build("tiny-qwen35")).logits(TOKENS[:10]))


def test_a_good_fake_serves_many_requests_from_one_process(fakes):
    for _ in range(3):
        assert _logits("good").shape == (10, 515)
    assert engine_starts() == 1


@pytest.mark.parametrize("name, message", [
    ("not-json", "line that is not JSON"),
    ("wrong-id", "expected a JSON object with \"id\": 1"),
    ("refuses", "refused request 1: out of"),
    ("hangs", "timed out after 3 s"),
    ("exits", "closed its stdout before replying .exited 7."),
    ("odd-file", "named '../../etc/passwd' among its files"),
    ("huge-line", "reply line longer than"),
])
def test_misbehaving_engines_are_one_engine_error(fakes, name, message):
    with pytest.raises(EngineError, match=message) as e:
        _logits(name)
    if name == "exits":
        assert "CUDA error: illegal address" in e.value.stderr_tail
    server = next(iter(persistent._SERVERS.values()))
    kept = name in ("refuses", "odd-file")  # a well-formed reply: the process is kept for the next request
    if kept:
        assert server.proc is not None and server.proc.poll() is None
    else:
        assert server.proc is None  # killed: the next request starts a fresh one
    with pytest.raises(EngineError):
        _logits(name)
    assert engine_starts() == (1 if kept else 2)


def test_protocol_tables_are_checked(tmp_path, monkeypatch):
    for toml, match in (
        ('[engines.v1]\ncommand = ["x", "{request}", "{out_dir}"]\ncapabilities = ["multi_seq"]\n', "capability 'multi_seq' needs protocol = 2"),
        ('[engines.v2]\ncommand = ["x", "{request}"]\nprotocol = 2\n', "protocol 1 placeholders"),
        ('[engines.v3]\ncommand = ["x"]\nprotocol = 3\n', "protocol must be 1"),
    ):
        command_table_refused(tmp_path, monkeypatch, toml, match)


def test_parity_and_a_full_probe_run_start_the_example_engine_once(tmp_path):
    """Acceptance: on the default model, a parity run (free-running greedy included) and every
    probe start the persistent example engine once; each probe it declares is measured and
    passes; the receipt, the ledger row and the report carry the free-running comparison."""
    from harness.runs.parity import ParityRequest, run_parity
    from harness.runs.probes import ProbeRequest, run_probes
    from harness.evidence.report import write_report
    from harness.fixtures.resolve import default_model

    ledger = tmp_path / "ledger.jsonl"
    out = run_parity(ParityRequest(model=default_model(), candidate="command:example", ledger=str(ledger)))
    assert out.result.verdict is Verdict.PASS, out.result.message
    fr = out.receipt["report_only"]["free_running"]
    assert fr["n_tokens"] == 64 and fr["identical"] == out.receipt["prompts"]["count"], fr  # llama.cpp against itself
    assert out.ledger_row["free_running"] == f"identical {fr['identical']}/{fr['identical']}, diverged 0 (near-tie 0, hard 0) over 64 tokens"
    assert "## Free-running greedy (report-only)" in write_report(out.receipt_path, tmp_path / "report").read_text()
    # the serving probe on two shipped scenarios (the whole set is tests/test_example_serve.py's slow test: minutes)
    import yaml
    from harness.measure.scenarios import shipped_scenarios_path

    doc = yaml.safe_load(shipped_scenarios_path().read_text())
    doc["scenarios"] = [s for s in doc["scenarios"] if s["name"] in ("slot-reuse-finished", "concurrency-2")]
    (tmp_path / "serving.yaml").write_text(yaml.safe_dump(doc))
    run = run_probes(ProbeRequest(model=default_model(), candidate="command:example", ledger=str(ledger),
                                  scenarios=str(tmp_path / "serving.yaml")))
    # the speculative probe has no MTP head to draft with on this trunk-only fixture: UNMEASURED, never PASS
    assert run.verdict is Verdict.PASS and run.receipt["unmeasured"] == ["speculative"], run.message
    assert next(r for r in run.results if r.name == "serving").verdict is Verdict.PASS  # op serve, its solo runs restarted
    spec = next(p for p in run.receipt["probes"] if p["name"] == "speculative")
    assert "no MTP" in spec["reason"]
    assert {r.name for r in run.results} == {"split", "decode", "ubatch", "multiseq", "prefix", "determinism", "long", "state", "serving", "speculative"}
    assert next(r for r in run.results if r.name == "state").verdict is Verdict.PASS  # llama.cpp on the state fixture: f32
    # one process for the model, for both runs, started afresh once per served scenario for its solo runs; one for the
    # state probe's fixture
    assert sorted(persistent.STARTS.values()) == [1, 1 + 2] and sum("state-qwen35" in str(k) for k in persistent.STARTS) == 1
    from harness.evidence.ledger import verify_ledger

    assert verify_ledger(ledger, tmp_path / "receipts") == []  # the row's free_running is re-derived from its receipt
