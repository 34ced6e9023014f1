"""GGUF lint: good fixtures are clean, each defect is flagged with exactly its code, the MTP
remedy flags work, and the memory line has the hand-computed byte counts."""

from __future__ import annotations

import json

import pytest

from harness.errors import InvalidInput
from harness.fixtures.defects import DEFECTS, build_defect
from harness.fixtures.resolve import resolve_model
from harness.model.lint import CODES, SEVERITY, lint_path

GOOD = ["tiny-qwen35", "tiny-qwen35moe", "small-qwen35", "tiny-qwen35-mtp"]
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
