"""docs/engines.md is the regeneration of the committed engine evidence (harness ledger engines-page)."""

from __future__ import annotations

import pytest

from pathlib import Path

from harness.evidence import engines_page
from harness.release import engines_refresh
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


def test_no_thresholds_row_the_committed_page_cites_has_changed_since_it_was_rendered():
    """Each cell names the thresholds.yaml row that judged it with the sha256 of that row as its
    receipt recorded it; a re-calibration that changes one makes the page stale until fresh rows
    are made (a plain re-render cannot hide it: the sha256 comes from the receipts)."""
    stale = engines_refresh.stale_rows(SOURCE_ROOT / engines_page.DEFAULT_OUT, SOURCE_ROOT / "thresholds.yaml")
    assert not stale, f"docs/engines.md is stale, run: {engines_page.REFRESH_COMMAND} ({'; '.join(stale)})"


def _thresholds_copy(tmp_path: Path) -> Path:
    path = tmp_path / "thresholds.yaml"
    path.write_text((SOURCE_ROOT / "thresholds.yaml").read_text())
    return path


def test_a_receipts_row_hashes_as_the_row_in_thresholds_yaml(tmp_path: Path):
    """The sha256 a receipt's recorded row gives equals the sha256 of that row read from the file
    (the row a parity run resolves for the dense f32 fixture), and a changed value changes it."""
    from harness.judge.thresholds import load_thresholds
    from harness.model.gguf_model import GGUFModel
    from harness.runs.inputs import subject_of

    th = load_thresholds(SOURCE_ROOT / "thresholds.yaml")
    model = GGUFModel(SOURCE_ROOT / "harness" / "data" / "fixtures" / "trained-qwen35.gguf")
    recorded = th.resolve(subject_of(model, {"compute_class": "f32"}), "fixture:trained-qwen35").to_receipt()
    label, sha = engines_page.cited_row({"thresholds": recorded})
    assert label.startswith("calibrated[") and sha == engines_page.current_row_sha256(label, th)
    page = tmp_path / "engines.md"
    page.write_text(f"{engines_page.CITED_HEADING}\n\n| row | sha256 |\n|---|---|\n| `{label}` | `{sha}` |\n")
    path = _thresholds_copy(tmp_path)
    assert engines_refresh.stale_rows(page, path) == [] and engines_refresh.stale_notice(page, path) is None
    i = int(label[:-1].split("[")[1])
    data = __import__("yaml").safe_load(path.read_text())
    data["calibrated"][i]["gates"]["min_cosine"]["value"] = 0.999
    path.write_text(__import__("yaml").safe_dump(data, sort_keys=False))
    (line,) = engines_refresh.stale_rows(page, path)
    assert line.startswith(f"{label}: judged as sha256 {sha[:12]}, now ") and not line.endswith(sha[:12])
    notice = engines_refresh.stale_notice(page, path)
    assert "is stale: 1 of the" in notice and notice.endswith(f"refresh it: {engines_page.REFRESH_COMMAND}")


def test_serving_column_lists_each_scenarios_verdict():
    receipt = {"probes": [{"name": "split", "verdict": "PASS"},
                          {"name": "serving", "verdict": "UNMEASURED", "details": {"scenarios": [
                              {"scenario": "multi-turn", "verdict": "PASS"}, {"scenario": "join-running", "verdict": "UNMEASURED"}]}}]}
    assert engines_page.serving_scenarios(receipt) == [("multi-turn", "PASS"), ("join-running", "UNMEASURED")]
    assert engines_page._serving_cell({"receipt": receipt}) == "multi-turn PASS<br>join-running UNMEASURED"
    assert engines_page._serving_cell(None) == "—"


def test_refresh_plans_a_run_per_cell_of_the_engines_here_and_names_the_rest():
    from harness.errors import InvalidInput
    from harness.release import engines_refresh

    runs, skipped = engines_refresh.plan("L.jsonl", engines=["llama-cpp-python-server"], models=["fixture:trained-qwen35"])
    assert [r.argv for r in runs] == [
        ("parity", "--candidate", "llama-cpp-python-server", "--model", "fixture:trained-qwen35", "--ledger", "L.jsonl"),
        ("probe", "--candidate", "llama-cpp-python-server", "--model", "fixture:trained-qwen35", "--only", "serving", "--ledger", "L.jsonl")]
    assert skipped == []
    runs, _ = engines_refresh.plan("L.jsonl", engines=["mlx"], models=["fixture:trained-qwen35moe"])
    assert [r.argv[r.argv.index("--dtype") + 1] for r in runs] == ["float32", "bfloat16"]  # MoE: no probe run planned
    try:
        engines_refresh.plan("L.jsonl", engines=["vllm"])
    except InvalidInput as e:
        assert "no engine vllm" in str(e)
    else:
        raise AssertionError("an unknown engine was planned")


def test_refresh_plans_transformers_parity_cells_when_torch_imports_and_names_why_not_when_it_does_not(monkeypatch):
    """The transformers group used to carry a fixed 'no torch' reason for both classes, so the
    refresh planned its probe run but never a parity cell, even where torch imports."""
    monkeypatch.setattr(engines_refresh, "_imports", lambda *modules: None)
    runs, skipped = engines_refresh.plan("L.jsonl", engines=["transformers"])
    parity = [r.argv for r in runs if r.argv[0] == "parity"]
    assert len(parity) == len(engines_page.MODELS) * 2 and skipped == []
    assert ("parity", "--candidate", "transformers", "--model", "fixture:trained-qwen35moe-256-Q4_K_M", "--dtype", "bfloat16",
            "--ledger", "L.jsonl") in parity
    assert [r.argv[0] for r in runs].count("probe") == 1
    monkeypatch.setattr(engines_refresh, "_imports", lambda *modules: "ModuleNotFoundError: No module named 'torch'")
    runs, skipped = engines_refresh.plan("L.jsonl", engines=["transformers"])
    assert runs == [] and skipped == [
        "transformers: torch and transformers do not import here (the `hf` extra; ModuleNotFoundError: No module named 'torch')"]


def test_imports_names_the_first_module_that_does_not_import():
    assert engines_refresh._imports("json", "harness") is None
    assert engines_refresh._imports("json", "no_such_module_52") == "ModuleNotFoundError: No module named 'no_such_module_52'"


def test_a_transformers_cell_without_a_row_says_what_it_needs_not_what_a_machine_lacked(tmp_path: Path):
    (tmp_path / "ledger.jsonl").write_text("")
    text = engines_page.render(tmp_path / "ledger.jsonl", shown_ledger="L.jsonl")
    assert "has no torch" not in text
    assert ("transformers × `fixture:trained-qwen35moe` × bf16: not run yet (no row in the ledger; it needs the `hf` extra "
            "(torch and transformers), and the refresh runs it only where they import): `harness parity --candidate transformers "
            "--model fixture:trained-qwen35moe --dtype bfloat16 --ledger L.jsonl`") in text
