"""Bound tests of contracts/qwen35-shapes-v1.yaml: the model file's metadata, inventory, shapes
and values. Subject: the model file ``harness_model_path`` (no engine runs).

Each test asserts that the static check of its rule (``harness.model.lint``, one table-driven pass)
reports none of the rule's finding codes, and re-checks the rule's core directly where that is a
line of arithmetic on the file.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from harness.model.gguf_model import GGUFModel
from harness.model.lint import lint_model

pytestmark = pytest.mark.contract


@pytest.fixture(scope="session")
def lint_report(harness_model_path):
    """The lint report of the subject model (findings with codes, messages, remedies)."""
    return lint_model(GGUFModel(harness_model_path))


def _assert_no(report, codes: set[str], oid: str, cause: str) -> None:
    found = [f for f in report.findings if f.code in codes and f.severity == "error"]
    name = Path(report.model["path"]).name
    assert not found, (
        f"{oid}: {name} (sha256 {report.model['sha256'][:12]}) breaks the rule: "
        + "; ".join(f"{f.code} {f.message}" + (f" [remedy: {f.remedy}]" if f.remedy else "") for f in found[:5])
        + f"; likely cause: {cause}"
    )


def test_required_keys(lint_report):
    """Q35S-KEY-001: every metadata key llama.cpp's qwen35 loader requires is present with its GGUF type."""
    _assert_no(lint_report, {"QL101", "QL102"}, "Q35S-KEY-001", "a converter that predates qwen35 or writes keys under another arch prefix")


def test_hparams_usable(lint_report):
    """Q35S-HP-002: the hyperparameters define a trunk (block_count > nextn, interval > 0)."""
    _assert_no(lint_report, {"QL103"}, "Q35S-HP-002", "full_attention_interval written as 0 or block_count not counting the trunk")


def test_key_equals_value_length(lint_report):
    """Q35S-HP-003: attention.key_length == attention.value_length (both are head_dim)."""
    _assert_no(lint_report, {"QL104"}, "Q35S-HP-003", "head_dim written wrongly for K or V")


def test_heads_divide(lint_report):
    """Q35S-HP-004: head_count is a multiple of head_count_kv (GQA groups)."""
    _assert_no(lint_report, {"QL105"}, "Q35S-HP-004", "head_count_kv taken from another model size")


def test_value_heads_multiple_of_key_heads(lint_report):
    """Q35S-HP-005: ssm.time_step_rank (n_v) is a multiple of ssm.group_count (n_k)."""
    _assert_no(lint_report, {"QL106"}, "Q35S-HP-005", "n_k and n_v swapped")


def test_inner_size(lint_report, harness_model_path):
    """Q35S-HP-006: ssm.inner_size == n_v · ssm.state_size."""
    _assert_no(lint_report, {"QL107"}, "Q35S-HP-006", "inner_size computed from n_k instead of n_v")
    h = GGUFModel(harness_model_path).hparams
    assert h.ssm_d_inner == h.ssm_dt_rank * h.ssm_d_state, f"Q35S-HP-006: inner_size {h.ssm_d_inner} != {h.ssm_dt_rank}·{h.ssm_d_state}"


def test_rope_dims(lint_report):
    """Q35S-ROPE-007: rope.dimension_count is even and ≤ head_dim, and 2·Σ rope.dimension_sections equals it."""
    _assert_no(lint_report, {"QL108", "QL109"}, "Q35S-ROPE-007", "n_rot written as head_dim (partial rotary factor lost) or mRoPE sections not scaled with it")


def test_expert_counts(lint_report):
    """Q35S-MOE-008: 1 ≤ expert_used_count ≤ expert_count (qwen35moe)."""
    _assert_no(lint_report, {"QL110"}, "Q35S-MOE-008", "num_experts_per_tok and num_experts swapped or missing")


def test_mtp_inventory(lint_report):
    """Q35S-MTP-009: the MTP (nextn) blocks block_count counts are present, and no tensors lie beyond block_count."""
    _assert_no(lint_report, {"QL201", "QL203"}, "Q35S-MTP-009", "MTP tensors stripped while nextn_predict_layers kept (or the reverse)")


def test_schedule_matches_tensors(lint_report):
    """Q35S-SCH-010: each trunk layer holds the tensor set of the kind the schedule gives it."""
    _assert_no(lint_report, {"QL204"}, "Q35S-SCH-010", "full_attention_interval differs from the checkpoint's layer_types")


def test_tensor_shapes(lint_report):
    """Q35S-SHP-011: every tensor llama.cpp creates is present with the ggml shape the hyperparameters give, and nothing else is."""
    _assert_no(lint_report, {"QL301", "QL302", "QL304"}, "Q35S-SHP-011", "a converter mapping table that drops, reshapes or adds tensors")


def test_vocab_rows(lint_report):
    """Q35S-VOC-012: token_embd / output have one row per token of tokenizer.ggml.tokens."""
    _assert_no(lint_report, {"QL303"}, "Q35S-VOC-012", "vocab padded in the weights but not in the token list (or the reverse)")


def test_ssm_a_negative(lint_report, harness_model_path):
    """Q35S-VAL-013: ssm_a = −exp(A_log) is strictly negative in every Gated DeltaNet layer."""
    _assert_no(lint_report, {"QL401"}, "Q35S-VAL-013", "A_log written as is, or exp without the minus")
    m = GGUFModel(harness_model_path)
    h = m.hparams
    for il in [i for i in range(h.n_layer) if h.is_recurrent(i)]:
        a = m.tensor(f"blk.{il}.ssm_a")
        assert np.all(a < 0), f"Q35S-VAL-013: blk.{il}.ssm_a max {a.max():.4g} is not < 0"


def test_norm_shifts(lint_report):
    """Q35S-NRM-014: shifted norms (attn_norm, post_attention_norm, attn_q/k_norm, output_norm) have mean ≈ 1; ssm_norm is not shifted."""
    _assert_no(lint_report, {"QL402", "QL403", "QL404"}, "Q35S-NRM-014", "the converter's +1 skipped, applied twice, or applied to ssm_norm")


def test_storage_types(lint_report):
    """Q35S-TYP-015: SSM scalars, the conv kernel and norm weights are stored F32."""
    _assert_no(lint_report, {"QL405"}, "Q35S-TYP-015", "a quantizer that does not keep 1-D and SSM tensors in F32")
