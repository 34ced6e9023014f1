"""GGUF lint: good fixtures are clean, each defect is flagged with exactly its code, the MTP
remedy flags work, and the memory line has the hand-computed byte counts."""

from __future__ import annotations

import json

import pytest

from harness.errors import InvalidInput
from harness.fixtures.defects import DEFECTS, build_defect
from harness.fixtures.resolve import resolve_model
from harness.model.lint import CODES, SEVERITY, lint_path

GOOD = ["tiny-qwen35", "tiny-qwen35moe", "small-qwen35", "tiny-qwen35-mtp", "tiny-qwen35moe-mtp", "tiny-qwen35-mtp-own-head"]
REMEDY = ["qwen35.block_count=int:8", "qwen35.nextn_predict_layers=int:0"]


@pytest.mark.parametrize("name", GOOD)
def test_good_fixtures_lint_clean(name):
    report = lint_path(resolve_model(f"fixture:{name}"), [])
    assert report.findings == [], report.render()
    assert report.exit_code == 0
    d = json.loads(json.dumps(report.to_dict()))
    assert d["findings"] == [] and d["exit_code"] == 0 and d["model"]["arch"] in ("qwen35", "qwen35moe")


def test_mtp_declared_absent_is_flagged_with_remedy():
    report = lint_path(resolve_model("fixture:mtp-declared-absent"), [])
    assert report.exit_code == 1
    assert {f.code for f in report.findings} == {"QL201"}
    (f,) = report.findings
    assert f.severity == "error" and "blk.8" in f.message
    assert f.remedy == "--override-kv qwen35.block_count=int:8 --override-kv qwen35.nextn_predict_layers=int:0"
    assert "declared-but-absent" in "\n".join(report.info)
    assert "--override-kv qwen35.block_count=int:8" in report.render()


def test_mtp_declared_absent_is_clean_with_the_remedy():
    report = lint_path(resolve_model("fixture:mtp-declared-absent"), REMEDY)
    assert report.findings == [], report.render()
    assert report.exit_code == 0
    assert report.model["overrides"] == REMEDY


def test_every_code_has_a_defective_fixture():
    assert {code for _, _, code in DEFECTS.values()} == set(CODES)


@pytest.fixture(scope="module")
def defect(tmp_path_factory):
    """``defect(name)`` -> path of that defective fixture, built once per module."""
    directory, built = tmp_path_factory.mktemp("defects"), {}

    def get(name: str) -> str:
        if name not in built:
            built[name] = str(build_defect(name, directory))
        return built[name]

    return get


@pytest.mark.parametrize("name", sorted(DEFECTS))
def test_defect_flagged_with_exactly_its_code(name, defect):
    expected = DEFECTS[name][2]
    report = lint_path(defect(name), [])
    assert {f.code for f in report.findings} == {expected}, report.render()
    assert {f.code for f in report.errors} == ({expected} if SEVERITY[expected] == "error" else set())
    assert report.exit_code == (1 if SEVERITY[expected] == "error" else 0)
    for f in report.findings:
        assert f.message and f.severity == SEVERITY[f.code]


def test_findings_name_their_layer_and_tensor(defect):
    (f,) = lint_path(defect("schedule-mismatch"), []).findings
    assert f.where["layer"] == 2 and "blk.2" in f.message and "attn_q" in f.message
    (f,) = lint_path(defect("ssm-a-f16"), []).findings
    assert f.where["tensor"] == "blk.0.ssm_a" and f.where["found"] == "F16"
    (f,) = lint_path(defect("vocab-rows-mismatch"), []).findings
    assert f.where["tensor"] == "output.weight" and f.where["found"] == f.where["expected"] - 1
    (f,) = lint_path(defect("key-wrong-type"), []).findings
    assert f.where == {"key": "qwen35.ssm.conv_kernel", "expected": "UINT32", "found": "INT32"}


def test_undeclared_mtp_remedy_makes_it_clean(defect):
    path = defect("mtp-undeclared")
    (f,) = lint_path(path, []).findings
    assert f.remedy == "--override-kv qwen35.block_count=int:9 --override-kv qwen35.nextn_predict_layers=int:1"
    report = lint_path(path, ["qwen35.block_count=int:9", "qwen35.nextn_predict_layers=int:1"])
    assert report.findings == [], report.render()


def test_mistyped_override_is_flagged():
    report = lint_path(resolve_model("fixture:mtp-declared-absent"), ["qwen35.block_count=float:8", "qwen35.nextn_predict_layers=int:0"])
    assert "QL102" in {f.code for f in report.findings}


def test_memory_line_tiny_qwen35():
    # tiny-qwen35: layers 3 and 7 full attention, 2 KV heads × head_dim 32, f16 K and V:
    #   2 layers × 2 (K, V) × 2 × 32 × 2 B = 512 B/token.
    # 6 Gated DeltaNet layers, f32: conv state (4 − 1) × (2·2·32 + 4·32) = 3 × 256 = 768,
    #   delta-rule state n_v × d_v × d_k = 4 × 32 × 32 = 4096; 6 × (768 + 4096) × 4 B = 116,736 B/seq.
    report = lint_path(resolve_model("fixture:tiny-qwen35"), [])
    m = report.memory
    assert (m["n_attention_layers"], m["n_recurrent_layers"]) == (2, 6)
    assert m["kv_bytes_per_token"] == 512
    assert (m["conv_state_elements_per_layer"], m["ssm_state_elements_per_layer"]) == (768, 4096)
    assert m["recurrent_bytes_per_sequence"] == 116_736
    line = next(s for s in report.info if s.startswith("memory:"))
    assert "512 bytes/token" in line and "116,736 bytes/sequence" in line


def test_unsupported_arch_and_bad_override_raise(tmp_path):
    from harness.fixtures.synthetic import (
        SPECS,
        build_vocab,
        make_metadata,
        make_tensors,
        write_gguf,
    )

    spec = SPECS["tiny-qwen35"]
    tokens, types, merges = build_vocab(0)
    meta = {k.replace("qwen35.", "llama.", 1): v for k, v in make_metadata(spec, tokens, types, merges).items()}
    path = tmp_path / "llama.gguf"
    write_gguf(path, "llama", meta, make_tensors(spec, len(tokens)))
    with pytest.raises(InvalidInput, match="qwen35, qwen35moe"):
        lint_path(str(path), [])
    with pytest.raises(InvalidInput, match="KEY=TYPE:VALUE"):
        lint_path(resolve_model("fixture:tiny-qwen35"), ["qwen35.block_count"])


def _shape_line(report) -> str:
    return next(s for s in report.info if s.startswith("file shape:"))


def test_unshifted_shared_head_norm_is_flagged_with_the_remedy(defect):
    """The +1 shift rule covers the head norm (HF mtp.norm) as it covers enorm and hnorm."""
    (f,) = lint_path(defect("shared-head-norm-unshifted"), []).findings
    assert (f.code, f.severity, f.where["tensor"], f.where["layer"]) == ("QL402", "error", "blk.8.nextn.shared_head_norm.weight", 8)
    assert abs(f.where["found"]) < 0.1  # the unshifted weight's mean is ≈ 0
    assert f.remedy.startswith("add 1 to the weight (HF mtp.norm)")
    (f,) = lint_path(defect("nextn-enorm-double-shift"), []).findings
    assert f.code == "QL403" and "HF mtp.pre_fc_norm_embedding" in f.remedy and f.where["found"] > 1.5


def test_nextn_shapes_and_types_are_checked(defect):
    (f,) = lint_path(defect("nextn-eh-proj-wrong-shape"), []).findings
    assert f.code == "QL302" and f.where["expected"] == [128, 64] and f.where["found"] == [64, 64]  # eh_proj maps 2·n_embd → n_embd
    (f,) = lint_path(defect("nextn-hnorm-f16"), []).findings
    assert f.code == "QL405" and (f.where["tensor"], f.where["found"]) == ("blk.8.nextn.hnorm.weight", "F16")
    (f,) = lint_path(defect("nextn-embed-tokens-vocab-rows"), []).findings
    assert f.code == "QL303" and f.where["tensor"] == "blk.8.nextn.embed_tokens.weight" and f.where["found"] == f.where["expected"] - 1
    (f,) = lint_path(defect("nextn-eh-proj-missing"), []).findings
    assert f.code == "QL301" and f.where["tensor"] == "blk.8.nextn.eh_proj.weight"


def test_info_lines_name_the_legal_file_shapes(defect):
    legal = "(legal shapes: trunk only, trunk + MTP, MTP only)"
    assert _shape_line(lint_path(resolve_model("fixture:tiny-qwen35"), [])) == f"file shape: trunk only {legal}"
    line = _shape_line(lint_path(resolve_model("fixture:tiny-qwen35-mtp"), []))
    assert line.startswith(f"file shape: trunk + MTP {legal}; blk.8 is the nextn block (draft head, load_mtp)")
    assert line.endswith("E = token_embd.weight (fallback), W = output.weight (fallback), head norm = blk.8.nextn.shared_head_norm.weight")
    line = _shape_line(lint_path(resolve_model("fixture:tiny-qwen35-mtp-own-head"), []))
    assert line.endswith("E = blk.8.nextn.embed_tokens.weight, W = blk.8.nextn.shared_head_head.weight, "
                         "head norm = blk.8.nextn.shared_head_norm.weight")
    only = lint_path(defect("mtp-only"), [])
    assert [(f.code, f.severity) for f in only.findings] == [("QL202", "info")] and only.exit_code == 0 and not only.warnings
    assert _shape_line(only).startswith(f"file shape: MTP only {legal}; blk.8 is the nextn block (draft model for -md)")
    absent = lint_path(resolve_model("fixture:mtp-declared-absent"), [])
    assert _shape_line(absent).startswith("file shape: not one of the legal ones") and "QL201" in _shape_line(absent)
    # with the two --override-kv remedies it is a legal trunk-only file
    assert _shape_line(lint_path(resolve_model("fixture:mtp-declared-absent"), REMEDY)).startswith("file shape: trunk only")


def test_head_without_shared_head_norm_is_legal_and_named_as_the_fallback(tmp_path):
    """llama.cpp's graph_mtp falls back to output_norm when nextn.shared_head_norm is absent:
    legal, and the info line says which norm the head uses."""
    from dataclasses import replace

    from harness.fixtures.synthetic import SPECS, build_fixture

    path = build_fixture(replace(SPECS["tiny-qwen35-mtp"], nextn_optional=()), tmp_path / "no-head-norm.gguf")
    report = lint_path(str(path), [])
    assert report.findings == [], report.render()
    assert _shape_line(report).endswith("head norm = output_norm.weight (fallback)")


def test_lowbit_iquant_made_with_an_imatrix_is_clean_and_the_finding_names_the_type(defect):
    """QL501 fires on the keys alone: an IQ2_M file made by llama-quantize --imatrix carries
    quantize.imatrix.* and lints clean of it; the planted one (no imatrix keys) names IQ2_M."""
    report = lint_path(defect("iquant-without-imatrix"), [])
    (f,) = [f for f in report.findings if f.code == "QL501"]
    assert f.severity == "warning" and "IQ2_M" in f.message and "--imatrix" in f.remedy
    made = lint_path(resolve_model("fixture:trained-qwen35-256-IQ2_M"), [])
    assert "QL501" not in {x.code for x in made.findings}
