"""Contexts of 8K to 32K positions (issue 56, part 3): fixtures that declare a context_length of
32,768 and lint clean, the long probe's length (8,192 by default, capped at the file's declared
context), and logits compared block by block, never held as [T, V], in the long probe and in
parity. The probe at 8,192 and 32,768 positions on real engines is slow (minutes):
``pytest -m slow tests/test_long_context.py`` (``make test-slow`` runs it with the rest)."""

from __future__ import annotations

import subprocess
import sys
import tracemalloc
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import yaml

from harness.engines.base import EngineInfo, gather
from harness.errors import EngineError, Verdict
from harness.fixtures import synthetic as fx
from harness.model.gguf_model import GGUFModel
from harness.model.lint import lint_path
from harness.provenance import sha256_file
from harness.runs import probes
from harness.runs.parity import compare_prompt
from harness.runs.probe_types import ProbeTolerance, compare

REPO = Path(__file__).resolve().parents[1]
T, V, BLOCK = 8192, 1024, 256  # [T, V] float32 is 32 MiB a side; a block 1 MiB


class BlockEngine:
    """Logits computed one block at a time from a seed (nothing [T, V] kept): block b is a fixed
    random block plus ``fault`` × noise from position ``fault_from`` on."""

    def __init__(self, name: str, fault: float = 0.0, fault_from: int = 0, nan_at: int | None = None):
        self.info = EngineInfo(name=name, version="0")
        self.n_vocab, self.fault, self.fault_from, self.nan_at = V, fault, fault_from, nan_at

    def logits(self, tokens, chunks=None):
        for start in range(0, len(tokens), BLOCK):
            rows = np.arange(start, min(start + BLOCK, len(tokens)))
            block = np.random.default_rng(start).standard_normal((len(rows), V), dtype=np.float32)
            noisy = rows >= self.fault_from
            if self.fault and noisy.any():
                block[noisy] += self.fault * np.random.default_rng(start + 7).standard_normal((int(noisy.sum()), V), dtype=np.float32)
            if self.nan_at is not None and start <= self.nan_at < start + len(rows):
                block[self.nan_at - start, 3] = np.nan
            yield start, block


def _peak(fn):
    tracemalloc.start()
    try:
        out = fn()
        return out, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


@pytest.mark.parametrize("name, base", list(zip(fx.LONG_CONTEXT_FIXTURES, ("tiny-qwen35", "tiny-qwen35moe"))))
def test_a_long_context_fixture_declares_32k_lints_clean_and_keeps_its_twins_tensors(name, base):
    path, twin = fx.build(name), fx.build(base)
    m, t = GGUFModel(path), GGUFModel(twin)
    arch = m.hparams.arch
    assert m.metadata(f"{arch}.context_length") == 32_768 and t.metadata(f"{arch}.context_length") == 4096
    assert not lint_path(path).errors
    names = sorted(m.tensor_names)
    assert names == sorted(t.tensor_names)
    for n in names:
        assert np.array_equal(m.tensor(n, np.float32), t.tensor(n, np.float32)), n


def test_the_pinned_fixtures_keep_their_bytes():
    """Calibrated rows pin tiny-qwen35's and tiny-qwen35moe's sha256: the long-context fixtures are
    new files, the originals unchanged."""
    doc = yaml.safe_load((REPO / "thresholds.yaml").read_text())
    pinned = {m["name"]: m["sha256"] for row in doc["calibrated"] for m in row.get("basis_models", [])}
    for base in ("tiny-qwen35", "tiny-qwen35moe"):
        assert sha256_file(fx.build(base)) == pinned[f"fixture:{base}"]
        assert sha256_file(fx.build(f"{base}-32k")) != pinned[f"fixture:{base}"]


def test_the_long_probe_length_is_8192_by_default_capped_at_the_declared_context():
    assert probes.LONG_TOKENS == 8192 and probes.ProbeRequest(model="m").long_tokens == 8192
    assert probes.long_length(8192, 32_768) == 8192 and probes.long_length(32_768, 32_768) == 32_768
    assert probes.long_length(8192, 4096) == 4096 and probes.long_length(8192, 0) == 8192


def test_the_long_probe_streams_and_never_holds_t_by_v():
    """8,192 positions × 1,024 logits: gathered, each side is 32 MiB; streamed, the probe's peak
    traced allocation (a few 256-row blocks and their float64 temporaries, ~9 MiB) stays under half
    of one side, and its values are the gathered comparison's."""
    toks = list(range(T))
    ref, cand = BlockEngine("ref"), BlockEngine("cand", fault=0.5, fault_from=6000)
    result, peak = _peak(lambda: probes.probe_long(cand, ref, toks, 0.98))
    assert peak < 16 << 20, peak
    assert result.verdict is Verdict.FAIL
    c = result.comparisons[0]
    want = compare("x", gather(ref.logits(toks)), gather(cand.logits(toks)), ProbeTolerance(min_cosine=0.98, max_kld=float("inf")))
    assert c.first_bad_position == want.first_bad_position == 6000
    assert (c.positions, c.min_cosine, c.max_kld, c.max_abs_diff) == (T, want.min_cosine, want.max_kld, want.max_abs_diff)
    ok = probes.probe_long(BlockEngine("cand"), ref, toks, 0.98)
    assert ok.verdict is Verdict.PASS and ok.comparisons[0].min_cosine == pytest.approx(1.0)


def test_the_long_probe_names_the_references_first_non_finite_position():
    with pytest.raises(EngineError, match="reference ref returned non-finite logits .* at position 2100"):
        probes.probe_long(BlockEngine("cand"), BlockEngine("ref", nan_at=2100), list(range(T)), 0.98)


def test_the_long_probe_needs_1024_positions():
    r = probes.probe_long(BlockEngine("c"), BlockEngine("r"), list(range(1023)), 0.98)
    assert r.verdict is Verdict.UNMEASURED and ">= 1024" in r.reason


def test_parity_compares_a_long_prompt_without_holding_t_by_v():
    """compare_prompt (a parity cell's per-prompt measurement) on 8,192 positions × 1,024 logits:
    peak traced allocation under 16 MiB (one [T, V] side is 32 MiB), every position measured."""
    toks = [t % V for t in range(T)]
    pm, peak = _peak(lambda: compare_prompt(BlockEngine("ref"), BlockEngine("cand", fault=0.5, fault_from=6000), toks, V))
    assert peak < 16 << 20, peak
    assert pm["cosine"].shape == (T,)
    assert (pm["cosine"][:6000] > 0.999999).all() and (pm["cosine"][6000:] < 0.98).all()


def _probe_long(model: str, candidate: str, reference: str, n: int | None = None) -> subprocess.CompletedProcess:
    extra = ["--long-tokens", str(n)] if n else []
    return subprocess.run([sys.executable, "-m", "harness", "probe", "--only", "long", "--model", f"fixture:{model}", "--candidate",
                           candidate, "--reference", reference, "--no-evidence", *extra], capture_output=True, text=True, timeout=1800, cwd=REPO)


@pytest.mark.slow
@pytest.mark.parametrize("candidate, reference", [("llama.cpp", "oracle"), ("oracle", "llama.cpp")])
def test_the_long_probe_passes_at_8192_positions(candidate, reference):
    """The default length on a 32K fixture: 8,192 positions (about 1 min per run on 2 cores, docs/benchmarks.md section 13)."""
    r = _probe_long("tiny-qwen35-32k", candidate, reference)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert "PASS" in r.stdout


@pytest.mark.slow
def test_the_long_probe_passes_at_32768_positions_on_request():
    """``--long-tokens 32768``: llama.cpp against the oracle (the oracle's attention in query
    chunks: memory bounded; an extrapolated 10 to 15 min of oracle on 2 cores, not run here)."""
    r = _probe_long("tiny-qwen35-32k", "llama.cpp", "oracle", 32_768)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]


def test_the_long_probe_on_a_4096_context_file_feeds_4096():
    """The requested 8,192 capped at the file's declared 4,096, said in the result's details."""
    inputs = SimpleNamespace(model=SimpleNamespace(hparams=SimpleNamespace(context_length=4096)))
    r = probes._with_length(probes.ProbeResult("long", Verdict.PASS), 8192, inputs)  # type: ignore[arg-type]
    assert r.details == {"requested_positions": 8192, "default_positions": probes.LONG_TOKENS, "context_length": 4096, "positions": 4096}


# ------------------------------------------------------------------------------ engines without their extras
@pytest.mark.parametrize("model", [*fx.LONG_CONTEXT_FIXTURES, *fx.REAL_HEAD_FIXTURES])
@pytest.mark.parametrize("candidate, hidden, extra", [("transformers", ("torch", "transformers"), "hf"),
                                                       ("mlx", ("mlx", "mlx.core", "mlx_lm"), "mlx")])
def test_an_engine_without_its_extra_is_unmeasured_and_named_never_pass(model, candidate, hidden, extra, monkeypatch, capsys, tmp_path):
    """mlx and transformers with their packages missing (hidden from import here, whether installed
    or not) on the new fixtures: exit 5, UNMEASURED naming the engine and its install command."""
    from harness.cli import main as cli_main

    for mod in hidden:
        monkeypatch.setitem(sys.modules, mod, None)  # import raises ImportError, as without the extra
    p = tmp_path / "p.jsonl"
    p.write_text('{"id": "p", "tokens": [' + ", ".join(str((37 * i + 11) % 500) for i in range(80)) + "]}\n")
    rc = cli_main(["parity", "--model", f"fixture:{model}", "--candidate", candidate, "--prompts", str(p), "--greedy-tokens", "0",
                   "--no-evidence"])
    captured = capsys.readouterr()
    out = captured.out + captured.err
    assert rc == Verdict.UNMEASURED.exit_code == 5, out
    assert f"UNMEASURED: the {candidate} engine needs" in out and f"pip install -e .[{extra}]" in out and "PASS" not in out


def test_a_top_k_cell_streams_the_reference_and_never_holds_t_by_v():
    """measure_topk_prompts (a top-k parity cell, an ``http:`` server as candidate): the reference's
    blocks against the candidate's [T, k] rows, peak traced allocation under half of one [T, V]
    side, each position's values those of the reference's own top-k (KLD 0 where k = V's top 8)."""
    from harness.engines.base import TopK
    from harness.measure.topk import cut_topk
    from harness.runs.topk import measure_topk_prompts

    ref = BlockEngine("ref")
    toks = [t % V for t in range(T)]
    whole = cut_topk(gather(ref.logits(toks)), 8)

    class Server:
        info = EngineInfo(name="server", version="0")

        def topk(self, tokens):
            return TopK(whole.ids.copy(), whole.logprobs.copy())

    prompt = SimpleNamespace(id="p", tokens=toks)
    pm, peak = _peak(lambda: measure_topk_prompts(ref, Server(), [prompt], V))
    assert peak < 16 << 20, peak
    assert pm["position"].tolist() == list(range(T)) and np.nanmax(np.abs(pm["kld"])) < 1e-6
