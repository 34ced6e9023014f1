"""docs/engines.md is the regeneration of the committed engine evidence (harness ledger engines-page)."""

from __future__ import annotations

from pathlib import Path

from harness.evidence import engines_page
from harness.paths import SOURCE_ROOT

LEDGER = SOURCE_ROOT / engines_page.DEFAULT_LEDGER


def test_committed_engines_page_equals_its_regeneration_from_the_committed_evidence():
    committed = (SOURCE_ROOT / engines_page.DEFAULT_OUT).read_text()
    assert committed == engines_page.render(LEDGER), "run: harness ledger engines-page (docs/engines.md is stale)"


def test_the_committed_evidence_holds_mlx_passes_on_dense_and_moe_f32():
    found = engines_page.collect(LEDGER)
    for model in ("fixture:trained-qwen35", "fixture:trained-qwen35moe"):
        hit = found[("mlx", model, "f32", "parity")]
        assert hit["row"]["verdict"] == "PASS" and hit["row"]["min_cosine"] > 0.99999


def test_an_empty_ledger_gives_every_cell_unmeasured_with_the_command_that_fills_it(tmp_path: Path):
    (tmp_path / "ledger.jsonl").write_text("")
    text = engines_page.render(tmp_path / "ledger.jsonl", shown_ledger="L.jsonl")
    assert "PASS" not in text
    n_cells = len(engines_page.ENGINES) * len(engines_page.MODELS) * len(engines_page.CLASSES)
    assert text.count("UNMEASURED ¹") == n_cells
    assert "harness parity --candidate mlx --model fixture:trained-qwen35-256-Q4_K_M --dtype bfloat16 --ledger L.jsonl" in text
    assert ("mlx × `fixture:trained-qwen35-256-Q8_0` × bf16: not run yet: `harness parity --candidate mlx "
            "--model fixture:trained-qwen35-256-Q8_0 --dtype bfloat16 --ledger L.jsonl`") in text
    assert ("mlx × `fixture:trained-qwen35moe-256-Q4_K_M` × bf16: not run yet: `harness parity --candidate mlx "
            "--model fixture:trained-qwen35moe-256-Q4_K_M --dtype bfloat16 --ledger L.jsonl`") in text


def test_the_committed_evidence_holds_mlx_moe_bf16_judged_as_bf16():
    """MoE below float32 runs through ExpertMatmul (harness/engines/mlx_engine.py) and is judged
    by a bf16 row of thresholds.yaml, not an f32 one."""
    hit = engines_page.collect(LEDGER)[("mlx", "fixture:trained-qwen35moe", "bf16", "parity")]
    rc = hit["receipt"]
    assert hit["row"]["verdict"] == "PASS" and 0.98 < hit["row"]["min_cosine"] < 0.9999
    assert rc["engines"]["candidate"]["compute_class"] == "bf16"
    assert "class bf16" in rc["gated"]["calibrated"]["line"] and rc["gated"]["calibrated"]["status"] == "ok"
    assert "rounded to bfloat16" in rc["engines"]["candidate"]["settings"]["expert_matmul"]
