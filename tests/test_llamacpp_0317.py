"""A second real llama.cpp build as a candidate: llama-cpp-python 0.3.17 (llama.cpp 49bfddeca18e)
through examples/llamacpp_engine.py, table ``[tool.harness.engines.llamacpp-0317]``.

The slow test needs the environment ``scripts/llamacpp_0317_venv.sh`` makes (a compile of about
4-8 minutes); without it the test skips and says so. Run it with

    scripts/llamacpp_0317_venv.sh && .venv/bin/python -m pytest -q -m slow tests/test_llamacpp_0317.py

The fast tests check what needs no second build: the engine declares ``mtp``/``speculative`` by what
its bindings have, and the engines page shows the 0.3.17 build as an engine of its own.
"""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from harness.engines.base import gather
from harness.engines.command import configured_commands, load_command_engine
from harness.engines.llamacpp import LlamaCppEngine
from harness.evidence import engines_page
from harness.fixtures import synthetic as fx
from harness.measure.metrics import cosine
from harness.paths import SOURCE_ROOT

EXAMPLE = SOURCE_ROOT / "examples" / "llamacpp_engine.py"
VENV_PYTHON = SOURCE_ROOT / ".venv-llamacpp-0317" / "bin" / "python"
TOKENS = list(range(30, 90))


def _capabilities(python) -> dict:
    out = subprocess.run([str(python), str(EXAMPLE), "--capabilities"], capture_output=True, text=True, timeout=120, check=True)
    return json.loads(out.stdout)


def _ask(python, model, request: dict, tmp_path) -> dict:
    """One protocol-2 request to the example engine run by ``python``; its reply."""
    line = json.dumps({"id": 1, "model": str(model), "out_dir": str(tmp_path), **request})
    shut = json.dumps({"id": 2, "op": "shutdown", "model": str(model), "out_dir": str(tmp_path)})
    out = subprocess.run([str(python), str(EXAMPLE), "--serve"], input=line + "\n" + shut + "\n", capture_output=True,
                         text=True, timeout=300, check=True)
    return json.loads(out.stdout.splitlines()[0])


def test_the_reference_bindings_give_the_mtp_ops_and_the_example_table_declares_exactly_them():
    got = _capabilities(sys.executable)  # the repo's .venv: llama-cpp-python 0.3.36
    assert got["version"] == "0.3.36"
    assert {"mtp", "speculative"} <= set(got["capabilities"])
    assert configured_commands()["example"].capabilities == got["capabilities"]


def test_the_0317_table_declares_no_mtp_op():
    caps = configured_commands()["llamacpp-0317"].capabilities
    assert "mtp" not in caps and "speculative" not in caps
    assert set(caps) == set(configured_commands()["example"].capabilities) - {"mtp", "mtp_chain", "speculative"}


def test_the_engines_page_shows_the_0317_build_as_its_own_engine_and_counts_only_its_version(tmp_path):
    (tmp_path / "ledger.jsonl").write_text("")
    text = engines_page.render(tmp_path / "ledger.jsonl", shown_ledger="L.jsonl")
    assert "## llama.cpp 49bfddec via llama-cpp-python 0.3.17 (`command:llamacpp-0317`)" in text
    # no --dtype for a command engine (the CLI refuses it there)
    assert "`harness parity --candidate command:llamacpp-0317 --model fixture:trained-qwen35 --ledger L.jsonl`" in text
    assert "command:llamacpp-0317 × `fixture:trained-qwen35` × bf16: not applicable" in text
    assert "PR #28068" not in text  # the explanation of its rows comes only with its rows
    assert "PR #28068" in (SOURCE_ROOT / engines_page.DEFAULT_OUT).read_text()


def test_a_receipt_of_another_version_does_not_fill_the_0317_cells(tmp_path):
    rec = {"engines": {"candidate": {"name": "command:llamacpp-0317", "version": "0.3.36", "compute_class": "f32"}}}
    (tmp_path / "receipts").mkdir()
    (tmp_path / "receipts" / "r1.json").write_text(json.dumps(rec))
    row = {"seq": 1, "kind": "parity", "model": "fixture:trained-qwen35", "receipt_id": "r1", "verdict": "PASS",
           "min_cosine": 1.0, "kld_mean": 0.0, "positions": 3}
    (tmp_path / "ledger.jsonl").write_text(json.dumps(row) + "\n")
    assert ("command:llamacpp-0317", "fixture:trained-qwen35", "f32", "parity") not in engines_page.collect(tmp_path / "ledger.jsonl")
    rec["engines"]["candidate"]["version"] = "0.3.17"
    (tmp_path / "receipts" / "r1.json").write_text(json.dumps(rec))
    hit = engines_page.collect(tmp_path / "ledger.jsonl")[("command:llamacpp-0317", "fixture:trained-qwen35", "f32", "parity")]
    assert hit["row"]["verdict"] == "PASS"


def test_the_engines_page_shows_a_calibrated_rows_file_by_name_not_by_the_checkouts_place():
    assert engines_page._shown_source("/home/u/repo/thresholds.yaml calibrated[1]") == "thresholds.yaml calibrated[1]"
    assert engines_page._shown_source("thresholds.yaml calibrated[2]") == "thresholds.yaml calibrated[2]"
    assert "/work/" not in (SOURCE_ROOT / engines_page.DEFAULT_OUT).read_text()


def test_the_committed_evidence_holds_the_0317_rows_and_the_moe_difference_the_page_explains():
    found = engines_page.collect(SOURCE_ROOT / engines_page.DEFAULT_LEDGER)
    name = "command:llamacpp-0317"
    for model in ("fixture:trained-qwen35", "fixture:trained-qwen35moe", "fixture:trained-qwen35-256-Q4_K_M"):
        par, prb = found[(name, model, "f32", "parity")], found[(name, model, "f32", "probe")]
        assert par["row"]["verdict"] == "PASS" and par["receipt"]["engines"]["candidate"]["version"] == "0.3.17"
        verdicts = {p["name"]: p["verdict"] for p in prb["receipt"]["probes"]}
        # on Q4_K_M this was a false FAIL of the serving probe until the probe tolerances were measured per weights key
        # (docs/gates.md "Probe tolerances"): the f32 tolerance from F32 weights failed the reference itself there
        assert prb["row"]["verdict"] == "PASS", (model, verdicts)
        assert all(v == "PASS" for n, v in verdicts.items() if n != "speculative"), (model, verdicts)
        if model.endswith("Q4_K_M"):
            assert prb["receipt"]["thresholds"]["calibrated"]["probes"]["min_cosine"]["value"] < 0.9999  # the Q4_K_M key's own floor
        assert {p["name"]: p["verdict"] for p in prb["receipt"]["probes"]}["speculative"] == "UNMEASURED"  # no MTP op
    dense = found[(name, "fixture:trained-qwen35", "f32", "parity")]["row"]
    moe = found[(name, "fixture:trained-qwen35moe", "f32", "parity")]["row"]
    assert 0 < dense["kld_mean"] < 1e-8 and dense["min_cosine"] > 0.9999999  # not the same bytes, but close
    assert moe["min_cosine"] < 0.999 and moe["hard_flips"] >= 1  # the router near-tie flipped (docs/engines.md)


@pytest.mark.slow
def test_the_0317_build_runs_as_a_command_engine_without_mtp(tmp_path):
    if not VENV_PYTHON.exists():
        pytest.skip(f"no {VENV_PYTHON.relative_to(SOURCE_ROOT)}: make it with scripts/llamacpp_0317_venv.sh (compiles llama.cpp, 4-8 min)")
    got = _capabilities(VENV_PYTHON)
    assert got["version"] == "0.3.17"
    assert got["capabilities"] == configured_commands()["llamacpp-0317"].capabilities  # the table declares what it has
    model = fx.build("tiny-qwen35")
    eng = load_command_engine("llamacpp-0317", model)
    out = gather(eng.logits(TOKENS))
    ref = gather(LlamaCppEngine(model).logits(TOKENS))
    assert out.shape == ref.shape == (len(TOKENS), eng.n_vocab)
    assert cosine(ref, out).min() > 0.9999  # two llama.cpp builds, f32 on CPU: the same model
    assert np.array_equal(out.argmax(-1), ref.argmax(-1))
    assert eng.info.version == "0.3.17" and "mtp" not in eng.info.capabilities
    reply = _ask(VENV_PYTHON, model, {"op": "draft", "tokens": TOKENS[:8]}, tmp_path)  # asked anyway: refused, by name
    assert reply["ok"] is False and "no MTP (nextn) API" in reply["error"] and "0.3.17" in reply["error"]
