"""Calibration arithmetic on synthetic pairs: bootstrap by prompt, margins, the catch matrix,
refusals, and a thresholds document that validates."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from harness.runs.calibrate import (
    CalibrationResult,
    PairStats,
    bootstrap_by_prompt,
    caught,
    propose,
    thresholds_document,
    write_thresholds,
)
from harness.judge.thresholds import load_thresholds
from harness.judge.tiers import Subject


def pair(label, good, cos_mins, kld_level, n=50, seed=0, **extra):
    rng = np.random.default_rng(seed)
    klds = [np.abs(rng.normal(kld_level, kld_level / 3, n)) for _ in cos_mins]
    allk = np.concatenate(klds)
    return PairStats(label, good, "fixture:trained-qwen35", float(min(cos_mins)), float(allk.mean()), float(np.quantile(allk, 0.99)),
                     np.array(cos_mins, float), klds, dict(extra))


def test_bootstrap_is_by_prompt_and_brackets_the_point():
    p = pair("g", True, [0.9999990, 0.9999995, 0.9999999, 0.9999997, 0.9999993], 1e-7)
    lo, hi = bootstrap_by_prompt(p, "min_cosine")
    assert lo == pytest.approx(0.9999990) and hi <= 0.9999999  # a min over resampled prompts
    klo, khi = bootstrap_by_prompt(p, "kld_mean")
    assert klo <= p.kld_mean <= khi


def test_proposed_thresholds_sit_outside_the_good_floor_with_margin():
    goods = [pair("a", True, [0.99999] * 5, 1e-7, seed=1), pair("b", True, [0.999995] * 5, 2e-7, seed=2)]
    g = propose(goods)
    assert g["min_cosine"]["value"] == pytest.approx(1 - 2e-5)  # 1 - 2 x (1 - 0.99999)
    assert g["max_kld_mean"]["value"] >= 2 * max(x.kld_mean for x in goods)
    assert g["max_kld_p99"]["value"] >= 2 * max(x.kld_p99 for x in goods)
    for x in goods:
        assert not any(caught(x, g).values())


def test_catch_matrix_distinguishes_gates():
    goods = [pair("a", True, [0.999999] * 5, 1e-8)]
    g = propose(goods)
    scale = pair("scale", False, [0.9999995] * 5, 1.0)  # cosine blind, KLD sees it
    state = pair("state", False, [0.9999995] * 5, 1e-8, probe_split=True)
    m1, m2 = caught(scale, g), caught(state, g)
    assert not m1["cosine"] and m1["kld_mean"]
    assert not any(m2[k] for k in ("cosine", "kld_mean", "kld_p99")) and m2["probe_split"]


def _row(weights, cls, goods, file_type, name, n_layer=8, n_embd=96):
    for g in goods:
        g.compute_class, g.weights = cls, weights
        g.extra.update(file_type=file_type, dims={"name": name, "sha256": "0" * 64, "arch": "qwen35", "n_layer": n_layer, "n_embd": n_embd})
    return {"weights": weights, "class": cls, "goods": goods, "gates": propose(goods), "file_types": [file_type],
            "basis_models": [goods[0].extra["dims"]]}


def test_thresholds_document_validates_and_resolves_rows(tmp_path):
    good = pair("oracle vs llama.cpp", True, [0.9999999] * 6, 3e-8)
    q = pair("oracle vs llama.cpp", True, [0.998] * 6, 7e-4)
    q.model = "fixture:trained-qwen35-256-Q4_K_M"
    bads = [pair("mutant:x", False, [0.5] * 6, 2.0, localize=True, first_divergence="attn_gated-3")]
    rows = [_row("F32", "f64", [good], "ALL_F32", "fixture:trained-qwen35"),
            _row("F32+Q4_K+Q6_K", "f64", [q], "Q4_K_M", "fixture:trained-qwen35-256-Q4_K_M", 4, 256)]
    probes = {"f64": {"min_cosine": {"value": 0.999999, "floor": 0.99999999}, "max_kld": {"value": 1e-5, "floor": 2e-7}}}
    loc = {"localize_max_nmse": {"value": 1e-5, "floor": 8e-8, "n": 160}, "localize_min_cosine": {"value": 0.9999, "floor": 0.99999996, "n": 160}}
    res = CalibrationResult([good, q], bads, rows, probes, loc, {"mutant:x": caught(bads[0], rows[0]["gates"])}, {}, [], [])
    doc = thresholds_document(res, "harness calibrate", "abc123")
    assert doc["release"]["min_cosine"]["value"] == 0.98 and doc["release"]["min_cosine"]["basis"]["kind"] == "declared"
    th = load_thresholds(write_thresholds(doc, tmp_path / "thresholds.yaml"))
    r = th.resolve(Subject("F32+Q4_K+Q6_K", "Q4_K_M", "f64", True, 8, 512, "0" * 64), "fixture:other")
    assert r.row.gates["min_cosine"]["value"] == pytest.approx(1 - 2 * 2e-3)
    assert r.row.gates["min_cosine"]["basis"]["kind"] == "measured"
    d = th.resolve(Subject("F32", "ALL_F32", "f64", True, 8, 96, "0" * 64), "fixture:trained-qwen35")
    assert d.row.gates["max_kld_mean"]["basis"]["known_bad"][0]["what"] == "mutant:x"
    assert d.gate("min_cosine", "probes").value == 0.999999
    # the quantized row has no f32 twin: an f32 engine on that file is not judged by the f64 row
    assert th.resolve(Subject("F32+Q4_K+Q6_K", "Q4_K_M", "f32", True, 4, 256, "0" * 64)).row is None


def test_a_row_never_loosens_the_release_floor():
    noisy = pair("bf16 engine", True, [0.95] * 6, 1e-2)
    assert propose([noisy])["min_cosine"]["value"] == 0.98


def test_probe_floors_measure_the_decode_the_probe_makes():
    """The oracle (f64) fed one token per call over the probe's decode length equals itself fed
    whole, so its floor is exact and the f64 tolerance is the smallest step; ``n`` counts every
    split and decode comparison, ``decode_tokens`` says how long the decode was."""
    from harness.runs.probes import split_points
    from harness.fixtures import synthetic as fx
    from harness.runs.calibrate import PROBE_MIN_STEP, probe_floors

    out = probe_floors(fx.build("tiny-qwen35"), ["f64"], False, lambda m: None, decode_tokens=48)["f64"]
    assert out["min_cosine"]["floor"] == 1.0 and out["max_kld"]["floor"] == 0.0
    assert out["min_cosine"]["value"] == round(1 - PROBE_MIN_STEP["f64"][0], 10) and out["max_kld"]["value"] == PROBE_MIN_STEP["f64"][1]
    assert out["min_cosine"]["decode_tokens"] == 48 and out["min_cosine"]["n"] == len(split_points(160)) + 2


def test_merge_probe_rows_replaces_only_the_probe_numbers(tmp_path):
    """``harness calibrate --probes`` rewrites each row's probes of the measured classes and
    ``probes.moe_excursions`` (each with a measured basis) and keeps every gate as it was."""
    import shutil

    from harness.runs.calibrate import merge_probe_rows

    path = tmp_path / "thresholds.yaml"
    shutil.copy("thresholds.yaml", path)
    before = load_thresholds(path).data
    probes = {"bf16": {"min_cosine": {"value": 0.99, "floor": 0.9995, "n": 7, "decode_tokens": 640, "engines": {"e": (0.9995, 1e-3)}},
                       "max_kld": {"value": 0.05, "floor": 1e-3, "n": 7, "decode_tokens": 640}}}
    ex = {"value": 9, "floor": 3, "n": 11, "engines": {"e on m": 3}, "min_cosine": 0.998, "decode_tokens": 640, "model": "fixture:m"}
    merge_probe_rows(path, probes, ex, "harness calibrate --probes", "fixture:trained-qwen35", None)
    after = load_thresholds(path).data
    for a, b in zip(before["calibrated"], after["calibrated"]):
        assert a["gates"] == b["gates"]
        if b["class"] == "bf16":
            assert b["probes"]["min_cosine"]["value"] == 0.99 and b["probes"]["max_kld"]["value"] == 0.05
            assert "decode over 640 tokens" in b["probes"]["min_cosine"]["basis"]["note"]
            assert [k["what"] for k in b["probes"]["min_cosine"]["basis"]["known_bad"]] == \
                [k["what"] for k in a["probes"]["min_cosine"]["basis"]["known_bad"]]  # the mutants' side is kept
        else:
            assert a["probes"] == b["probes"]
    assert after["probes"]["moe_excursions"]["value"] == 9 and after["probes"]["moe_excursions"]["basis"]["known_good_floor"] == 3
    assert after["probes"]["localize_max_nmse"] == before["probes"]["localize_max_nmse"]


def test_an_optional_known_good_engine_runs_only_where_its_extra_is_installed_and_is_named_when_left_out(monkeypatch):
    """Every known-good engine names the module its extra provides (None: always there); one whose
    module is missing is not measured (``usable``) and its family is named with the extra to install
    (``optional_skips``), never silently dropped."""
    from harness.runs.calibrate import plan

    modules = {m for goods in plan.KNOWN_GOOD.values() for _, _, m in goods}
    assert None in modules and modules - {None} <= set(plan.OPTIONAL_EXTRAS) | {plan.REPACK_NEEDS}
    monkeypatch.setattr(plan, "have_module", lambda m: m in (None, plan.REPACK_NEEDS))
    assert plan.usable(None, True) and plan.usable(None, False)
    assert not plan.usable("torch", True) and not plan.usable("torch", False)
    assert not plan.usable("mlx_lm", True)
    assert plan.optional_skips(True) == ["transformers (every class): the hf extra (torch) is not installed",
                                         "mlx (every class): the mlx extra (mlx_lm) is not installed"]
    assert plan.optional_skips(False) == ["transformers (every class): optional engines were not asked for",
                                          "mlx (every class): optional engines were not asked for"]
    assert {label for goods in plan.KNOWN_GOOD.values() for label, _, m in goods if m == "mlx_lm"} == {
        "mlx float32", "mlx bfloat16", "mlx float16"}
    monkeypatch.setattr(plan, "have_module", lambda m: True)
    assert plan.usable("torch", True) and not plan.usable("torch", False) and plan.optional_skips(True) == []


def test_llama_cpp_with_extra_buffer_types_is_a_known_good_f32_engine_where_the_cpu_has_no_amx(monkeypatch, tmp_path):
    """The reference with llama.cpp's extra buffer types on (issue 43) is measured as an f32 engine,
    optional or not, except on a CPU with AMX, where llama.cpp's AMX path segfaults: there it is
    left out and named."""
    from harness.engines import llamacpp
    from harness.runs.calibrate import plan

    labels = {label: m for label, _, m in plan.KNOWN_GOOD["f32"]}
    assert labels["llama.cpp repack"] == plan.REPACK_NEEDS
    make = dict((label, mk) for label, mk, _ in plan.KNOWN_GOOD["f32"])["llama.cpp repack"]
    assert make(tmp_path / "m.gguf").settings.use_extra_bufts is True
    monkeypatch.setattr(llamacpp, "cpu_has_amx", lambda: False)
    assert plan.usable(plan.REPACK_NEEDS, False) and plan.usable(plan.REPACK_NEEDS, True)
    assert not any("repack" in line for line in plan.optional_skips(True))
    monkeypatch.setattr(llamacpp, "cpu_has_amx", lambda: True)
    assert not plan.usable(plan.REPACK_NEEDS, True)
    assert "llama.cpp repack (f32): this CPU has AMX (amx_int8), where llama.cpp's AMX path segfaults (llama.cpp #20824)" in plan.optional_skips(False)


def test_cpu_has_amx_reads_the_cpuinfo_flags(tmp_path):
    from harness.engines.llamacpp import cpu_has_amx

    (tmp_path / "amd").write_text("processor\t: 0\nmodel name\t: AMD EPYC 7B13\nflags\t\t: fpu avx2 avx512f\n")
    (tmp_path / "xeon").write_text("processor\t: 0\nflags\t\t: fpu avx2 amx_bf16 amx_tile amx_int8\n")
    assert not cpu_has_amx(tmp_path / "amd") and cpu_has_amx(tmp_path / "xeon") and not cpu_has_amx(tmp_path / "none")


def test_the_matrix_page_keeps_the_sections_calibration_does_not_write():
    """A full calibration rewrites the mutant × class table of docs/gates-matrix.md and keeps every
    section after it (the MTP, speculative and precision mutants', each measured by its own
    command) as it was; a page without such sections keeps nothing."""
    from harness.runs.calibrate.document import kept_matrix_sections

    page = (Path(__file__).resolve().parents[1] / "docs" / "gates-matrix.md").read_text(encoding="utf-8")
    kept = kept_matrix_sections(page)
    assert kept.startswith("\n## ") and "Precision mutants" in kept and "MTP draft-head mutants" in kept
    assert "| mutant | f64 |" not in kept
    assert kept_matrix_sections("# title\n\n| a | b |\n") == ""


def test_a_known_good_pair_below_the_release_floor_writes_no_row_and_says_so():
    """Issue 59: on IQ2_M the self-measured calibration set cosine 0.98 from a pair at 0.962, and
    the cell then FAILed its own calibration pair; such a group makes no row, with the reason."""
    from harness.runs.calibrate.fit import rows_from_goods
    dims = {"arch": "qwen35", "name": "fixture:x"}
    ok = pair("oracle-iq3", True, [0.9995, 0.9993], 1e-4, file_type="IQ3_S", dims=dims)
    low = pair("oracle-iq2m", True, [0.9995, 0.96213], 1e-3, file_type="IQ2_M", dims=dims)
    for p, w in ((ok, "IQ3_S"), (low, "IQ2_M")):
        p.compute_class, p.weights = "f64", w
    rows, skipped = rows_from_goods([ok, low], ["f64"], use_torch=False)
    assert [r["weights"] for r in rows] == ["IQ3_S"]
    assert any("oracle-iq2m measures cosine 0.96213, below the release floor 0.98; no row written" in s for s in skipped)


def test_a_full_calibration_keeps_the_speculative_acceptance_rows(tmp_path):
    """``harness calibrate`` rewrites the ``probes:`` section but does not measure the speculative
    probe's acceptance gate (``harness calibrate --speculative`` does): write_calibration carries
    ``probes.spec_max_acceptance_drop`` and ``probes.spec_min_reference_accepted`` over from the file
    it replaces, basis and all, and writes none where that file has none."""
    import yaml

    from harness.runs.calibrate.document import write_calibration

    good = pair("oracle vs llama.cpp", True, [0.9999999] * 6, 3e-8)
    rows = [_row("F32", "f64", [good], "ALL_F32", "fixture:trained-qwen35")]
    loc = {"localize_max_nmse": {"value": 1e-5, "floor": 8e-8, "n": 160}, "localize_min_cosine": {"value": 0.9999, "floor": 0.99999996, "n": 160}}
    probes = {"f64": {"min_cosine": {"value": 0.999999, "floor": 0.99999999}, "max_kld": {"value": 1e-5, "floor": 2e-7}}}
    res = CalibrationResult([good], [], rows, probes, loc, {}, {}, [], [])
    shipped = yaml.safe_load((Path(__file__).parents[1] / "thresholds.yaml").read_text())["probes"]
    out = tmp_path / "thresholds.yaml"
    write_calibration(res, out, tmp_path / "matrix.md", "harness calibrate", None)
    assert "spec_max_acceptance_drop" not in yaml.safe_load(out.read_text())["probes"]  # none to keep: none written
    old = yaml.safe_load(out.read_text())
    old["probes"]["spec_max_acceptance_drop"] = dict(shipped["spec_max_acceptance_drop"], value=0.37)
    old["probes"]["spec_min_reference_accepted"] = shipped["spec_min_reference_accepted"]
    write_thresholds(old, out)
    write_calibration(res, out, tmp_path / "matrix.md", "harness calibrate", None)
    kept = yaml.safe_load(out.read_text())["probes"]
    assert kept["spec_max_acceptance_drop"]["value"] == 0.37
    assert kept["spec_max_acceptance_drop"]["basis"] == shipped["spec_max_acceptance_drop"]["basis"]
    assert kept["spec_min_reference_accepted"] == shipped["spec_min_reference_accepted"]
    assert kept["localize_max_nmse"]["value"] == 1e-5 and kept["moe_router_max_gap"] is not None  # the rest is the new calibration's
    assert load_thresholds(out).data["probes"]["spec_max_acceptance_drop"]["value"] == 0.37


def test_a_top_k_row_is_never_tighter_than_the_calibrated_rows_smallest_step():
    """A top-k KLD is at most the full KLD, so a top-k row below MIN_STEP would fail float32 noise the
    calibrated tier allows: llama-server on fixture:trained-qwen35 measured top-20 KLD mean 7.8e-7 and
    p99 8.2e-6 against a row floored at 1e-7 (1.2e-7 / 8.6e-7), a FAIL of a correct engine."""
    from harness.runs.calibrate.document import _topk_row
    from harness.runs.calibrate.plan import MIN_STEP

    dims = {"name": "fixture:trained-qwen35", "sha256": "0" * 64, "arch": "qwen35", "n_layer": 8, "n_embd": 96}
    goods = [pair("llama.cpp n_ubatch=7 vs llama.cpp", True, [0.9999999] * 5, 3e-9, seed=s, file_type="ALL_F32", dims=dims)
             for s in (1, 2)]
    for g in goods:
        g.compute_class, g.weights = "f32", "F32"
    bads = [pair("mutant:gdn-chunk-state-not-carried", False, [0.99] * 5, 7.8e-4, seed=3)]
    row, passing, late = _topk_row(20, "f32", goods, bads, "harness calibrate --topk", "fixture:trained-qwen35", "")
    gates = row["gates"]
    assert gates["max_topk_kld_mean"]["value"] == MIN_STEP["max_kld_mean"] == 1e-6
    assert gates["max_topk_kld_p99"]["value"] == MIN_STEP["max_kld_p99"] == 1e-5
    assert 7.8e-7 <= gates["max_topk_kld_mean"]["value"] and 8.2e-6 <= gates["max_topk_kld_p99"]["value"]
    assert passing == [] and late == []


def test_each_quantized_weights_key_takes_its_probe_floor_from_a_dense_file_of_that_key():
    """``weights_probe_files``: float-only keys keep the base floors (none listed); a quantized key
    names the dense (qwen35) basis model even when an MoE row of the key comes first."""
    from harness.runs.calibrate import quantized_weights, weights_probe_files

    rows = [{"weights": "F32", "basis_models": [{"name": "fixture:a", "arch": "qwen35"}]},
            {"weights": "BF16+F32", "basis_models": [{"name": "fixture:b", "arch": "qwen35"}]},
            {"weights": "F32+Q4_K+Q6_K", "basis_models": [{"name": "fixture:moe-q4", "arch": "qwen35moe"}]},
            {"weights": "F32+Q4_K+Q6_K", "basis_models": [{"name": "fixture:dense-q4", "arch": "qwen35"}]},
            {"weights": "F32+Q8_0", "basis_models": [{"name": "fixture:moe-q8", "arch": "qwen35moe"}]}]
    assert weights_probe_files(rows) == {"F32+Q4_K+Q6_K": "fixture:dense-q4", "F32+Q8_0": "fixture:moe-q8"}
    assert not quantized_weights("F16+F32") and quantized_weights("F32+IQ2_XXS+Q5_K")


def test_a_quantized_file_loosens_the_f32_probe_floor_by_llama_cpps_own_batch_dependence():
    """On Q4_K_M weights llama.cpp's quantized kernels depend on the batch: fed in pieces, it leaves
    itself fed whole by more than on F32 (the serving probe's false FAIL of the reference, docs/gates.md).
    ``weights_probe_floors`` joins that floor to the base's for the classes with f32 members only,
    and names the file and engines in the basis."""
    from harness.runs.calibrate import weights_probe_floors

    exact = {"min_cosine": {"value": 0.9999999, "floor": 1.0, "n": 3, "models": ["base"], "engines": {"oracle": (1.0, 0.0)}},
             "max_kld": {"value": 1e-7, "floor": 0.0, "n": 3, "models": ["base"], "engines": {"oracle": (1.0, 0.0)}}}
    spec = "fixture:trained-qwen35-256-Q4_K_M"
    out = weights_probe_floors({"F32+Q4_K+Q6_K": spec}, {"f64": exact, "f32": exact, "mixed": exact}, lambda m: None, decode_tokens=48)
    per = out["F32+Q4_K+Q6_K"]
    assert sorted(per) == ["f32", "mixed"]  # the f64 class (the oracle) dequantizes: its base floor stands
    cos = per["f32"]["min_cosine"]
    assert cos["floor"] < 0.999999  # llama.cpp split/decode vs whole on Q4_K_M (the base here is exact: 1.0)
    assert cos["value"] <= 1 - 20 * (1 - cos["floor"]) + 1e-12  # 20x in 1 - cosine
    assert cos["floor"] == min(c for c, _ in cos["engines"].values())
    assert f"llama.cpp on {spec}" in cos["engines"] and "oracle" in cos["engines"]
    assert cos["models"] == ["base", spec] and cos["n"] > 3 and cos["decode_tokens"] == 48
    assert per["f32"]["max_kld"]["floor"] > 0


def test_merge_probe_rows_gives_a_quantized_key_its_own_probe_floor(tmp_path):
    import shutil

    from harness.runs.calibrate import merge_probe_rows

    path = tmp_path / "thresholds.yaml"
    shutil.copy("thresholds.yaml", path)
    base = {"min_cosine": {"value": 0.99999, "floor": 0.9999995, "n": 7, "decode_tokens": 640}, "max_kld": {"value": 1e-5, "floor": 1e-7, "n": 7}}
    q4 = {"min_cosine": {"value": 0.999, "floor": 0.99995, "n": 9, "decode_tokens": 640, "models": ["x", "fixture:q4"],
                         "engines": {"llama.cpp on fixture:q4": (0.99995, 4e-4)}},
          "max_kld": {"value": 0.03, "floor": 4e-4, "n": 9}}
    merge_probe_rows(path, {"f32": base}, None, "harness calibrate --probes", "fixture:trained-qwen35", None, {"F32+Q4_K+Q6_K": {"f32": q4}})
    rows = [r for r in load_thresholds(path).data["calibrated"] if r["class"] == "f32"]
    assert {r["probes"]["min_cosine"]["value"] for r in rows if r["weights"] == "F32+Q4_K+Q6_K"} == {0.999}
    assert {r["probes"]["min_cosine"]["value"] for r in rows if r["weights"] != "F32+Q4_K+Q6_K"} == {0.99999}
    note = next(r for r in rows if r["weights"] == "F32+Q4_K+Q6_K")["probes"]["min_cosine"]["basis"]
    assert "llama.cpp on fixture:q4" in note["note"] and "fixture:q4" in note["model"]
