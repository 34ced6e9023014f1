"""harness report: Markdown + PNG plots for a receipt (a FAIL receipt included)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from harness.compare.inputs import resolve_inputs
from harness.compare.parity import ParityRequest, build_receipt, run_cell
from harness.compare.prompts import load_prompt_set, tokenize_prompts
from harness.engines.registry import resolve_engine
from harness.evidence.receipts import write_receipt
from harness.evidence.report import write_report
from harness.fixtures import synthetic as fx
from harness.model.gguf_model import GGUFModel


@pytest.fixture(scope="module")
def fail_receipt(tmp_path_factory):
    """A FAIL receipt: the oracle with one position's logits reversed."""
    path = fx.build("tiny-qwen35")
    ref, oracle = resolve_engine("llama.cpp", path), resolve_engine("oracle", path)
    pset = load_prompt_set(None)
    pset.prompts = pset.prompts[1:3]
    prompts = tokenize_prompts(pset, ref)

    class Broken:
        info = oracle.info
        n_vocab = oracle.n_vocab

        def logits(self, toks, chunks=None):
            for s, b in oracle.logits(toks, chunks):
                b = b.copy()
                if s == 0:
                    b[10] = -b[10]
                yield s, b

    model = GGUFModel(path)
    res = run_cell(model, ref, Broken(), prompts, 0.98, 64)
    inputs = resolve_inputs("fixture:tiny-qwen35")
    inputs.prompt_set = pset
    rec = build_receipt(ParityRequest(model="fixture:tiny-qwen35"), inputs, res)
    d = tmp_path_factory.mktemp("ev")
    jp, _ = write_receipt(rec, res.per_position, d / "receipts")
    return jp


def test_report_on_fail_receipt_writes_markdown_and_plots(fail_receipt, tmp_path):
    md = write_report(fail_receipt, tmp_path / "rep")
    text = md.read_text()
    assert "**Verdict: FAIL**" in text and "position 10" in text
    for png in ("positions.png", "margins.png"):
        data = (tmp_path / "rep" / png).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
        assert f"]({png})" in text


def test_report_with_localization_plots_layers(fail_receipt, tmp_path):
    loc = {"per_layer": [{"layer": 0, "type": "recurrent", "max_nmse": 1e-9, "min_cosine": 0.9999999},
                         {"layer": -1, "type": "model", "max_nmse": 0.3, "min_cosine": 0.8}],
           "bounds": {"max_nmse": 1e-4, "min_cosine": 0.999},
           "first_divergence": {"name": "result_norm", "layer": -1, "layer_type": "model", "position": 10, "nmse": 0.3, "cosine": 0.8}}
    md = write_report(fail_receipt, tmp_path / "rep", loc)
    assert (tmp_path / "rep" / "layers.png").stat().st_size > 5_000
    assert "First divergence" in md.read_text()


def test_cli_report(fail_receipt, tmp_path):
    r = subprocess.run([sys.executable, "-m", "harness", "report", str(fail_receipt), "--out", str(tmp_path / "r")], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "r" / "report.md").exists()


def test_report_reads_old_receipts_flip_fields(fail_receipt, tmp_path):
    """Receipts written before the flip counts took the ledger's names (``near_tie_flips``,
    ``hard_flips``) say ``flips_near_tie`` / ``flips_hard``; the report reads both."""
    import json

    from harness.evidence.receipts import load_receipt, per_prompt_rows

    rec = load_receipt(fail_receipt).receipt
    old = {**rec, "per_prompt": [{("flips_near_tie" if k == "near_tie_flips" else "flips_hard" if k == "hard_flips" else k): v
                                  for k, v in p.items()} for p in rec["per_prompt"]]}
    assert per_prompt_rows(old) == per_prompt_rows(rec) == rec["per_prompt"]
    assert all("near_tie_flips" in p and "flips_near_tie" not in p for p in per_prompt_rows(old))
    assert json.dumps(old) != json.dumps(rec)
