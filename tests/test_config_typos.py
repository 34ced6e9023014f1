"""Issue 48 (3): a typo in an engine table or the harness table is one INVALID line (exit 2) that
names the key or value and the one it was most likely meant to be; it is never accepted and left
for a probe to find missing, nor ignored."""

from __future__ import annotations

import subprocess
import sys

import pytest


def harness(tmp_path, toml: str, *args: str) -> subprocess.CompletedProcess:
    """``python -m harness ARGS`` in a project whose pyproject.toml is ``toml``."""
    (tmp_path / "pyproject.toml").write_text(toml)
    env = {k: v for k, v in __import__("os").environ.items() if k != "HARNESS_CONFIG"}
    return subprocess.run([sys.executable, "-m", "harness", *args], cwd=tmp_path, capture_output=True, text=True, env=env, timeout=120)


def one_line(r: subprocess.CompletedProcess) -> str:
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    return lines[0]


PARITY = ("parity", "--model", "fixture:tiny-qwen35", "--no-evidence")


@pytest.mark.parametrize("value, meant", [("chunk", "chunks"), ("multiseq", "multi_seq"), ("activation", "activations")])
def test_a_misspelt_capability_is_refused_naming_the_one_meant(tmp_path, value, meant):
    line = one_line(harness(tmp_path, f'[tool.harness.engines.mine]\ncommand = ["x"]\nprotocol = 2\ncapabilities = ["{value}"]\n',
                            *PARITY, "--candidate", "command:mine"))
    assert line == (f"harness: INVALID: {tmp_path / 'pyproject.toml'}: engines.mine.capabilities: unknown capability {value!r} "
                    f"(did you mean {meant!r}?); known: chunks, activations, dequantized_weights, multi_seq, n_ubatch, generate, prefix_reuse, "
                    "tokenize, "
                    "chat_template, mtp, mtp_chain, speculative, serve, logits_ring, first_row")


def test_every_documented_capability_is_accepted(tmp_path, monkeypatch):
    from harness.engines.command import CAPABILITIES, configured_commands

    (tmp_path / "h.toml").write_text(f'[engines.mine]\ncommand = ["x"]\nprotocol = 2\ncapabilities = {list(CAPABILITIES)!r}\n'.replace("'", '"'))
    monkeypatch.setenv("HARNESS_CONFIG", str(tmp_path / "h.toml"))
    assert configured_commands()["mine"].capabilities == list(CAPABILITIES)
    doc = (__import__("pathlib").Path(__file__).parents[1] / "docs" / "engine-protocol.md").read_text()
    assert all(f"`{c}`" in doc for c in CAPABILITIES)  # each one is documented


def test_engine_for_engines_is_refused_naming_engines(tmp_path):
    line = one_line(harness(tmp_path, '[tool.harness]\ncandidate = "command:mine"\n\n[tool.harness.engine.mine]\ncommand = ["x"]\n', *PARITY))
    assert line == (f"harness: INVALID: {tmp_path / 'pyproject.toml'}: unknown key 'engine' in the harness table (did you mean 'engines'?); "
                    "known: model, models, candidate, reference, prompts, thresholds, ledger, evidence, engines, http, pytest, probes, contracts")


def test_a_misspelt_top_level_key_is_refused_not_ignored(tmp_path):
    line = one_line(harness(tmp_path, '[tool.harness]\nthreshold = "mine.yaml"\n', *PARITY))
    assert "unknown key 'threshold' in the harness table (did you mean 'thresholds'?)" in line


def test_a_misspelt_key_of_an_engine_table_names_the_one_meant(tmp_path):
    line = one_line(harness(tmp_path, '[tool.harness.engines.mine]\ncommand = ["x"]\ncapabilites = ["chunks"]\n', *PARITY,
                            "--candidate", "command:mine"))
    assert line.endswith("engines.mine: unknown key 'capabilites' (did you mean 'capabilities'?); known: command, timeout_s, capabilities, "
                         "cwd, env, compute_class, protocol")


@pytest.mark.parametrize("typed, meant", [("oracel", "oracle"), ("mutant:qk-norm-skiped", None), ("qk-norm-skiped", "mutant:qk-norm-skipped"),
                                          ("mien", "command:mine"), ("command:mien", "command:mine")])
def test_a_misspelt_candidate_says_did_you_mean(tmp_path, typed, meant):
    line = one_line(harness(tmp_path, '[tool.harness.engines.mine]\ncommand = ["x"]\n', *PARITY, "--candidate", typed))
    if typed.startswith("mutant:"):
        assert "unknown mutant 'qk-norm-skiped' (did you mean 'qk-norm-skipped'?)" in line
    elif typed.startswith("command:"):
        assert line.endswith(f"(did you mean {meant!r}?); configured: command:mine")
    else:
        assert f"unknown engine {typed!r} (did you mean {meant!r}?); known: llama.cpp, " in line
        from harness.engines.mutants import ALL_MUTANTS

        assert line.endswith(f"mutant:NAME ({len(ALL_MUTANTS)} mutants: harness mutants list), configured: command:mine")
        assert line.count("mutant:") == 1 + meant.startswith("mutant:")  # the mutants are counted, not listed


def test_did_you_mean_only_when_a_choice_is_close():
    from harness.config import closest, did_you_mean

    assert did_you_mean("chunk", ["chunks", "activations"]) == " (did you mean 'chunks'?)"
    assert did_you_mean("zzz", ["chunks", "activations"]) == ""
    assert closest("engine", ["model", "engines", "http"]) == "engines"
