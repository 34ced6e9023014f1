"""The KV-cache type as an option (issue 56): ``type_k`` / ``type_v`` / ``flash_attn`` of llama.cpp-based
engines, checked before any worker runs, recorded in the receipt (with whether flash attention
ran, from llama.cpp's log) and named in the parity title."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from harness.engines.base import gather
from harness.engines.llamacpp import KV_TYPES, LlamaCppEngine, LlamaCppSettings, flash_attn_ran
from harness.engines.options import candidate_flags, engine_label, kv_settings
from harness.errors import InvalidInput
from harness.fixtures import synthetic as fx

REPO = Path(__file__).resolve().parents[1]


def test_kv_types_are_the_issues_five():
    assert KV_TYPES == ("f32", "f16", "bf16", "q8_0", "q4_0")


@pytest.mark.parametrize("key", ["type_k", "type_v"])
def test_a_bad_kv_type_is_one_line_listing_the_allowed_ones(key):
    with pytest.raises(InvalidInput) as e:
        LlamaCppSettings(**{key: "q3_k"})
    msg = str(e.value)
    assert "\n" not in msg and f"{key} 'q3_k'" in msg and msg.endswith("allowed: f32, f16, bf16, q8_0, q4_0")


def test_a_quantized_v_cache_without_flash_attention_is_refused_before_llama_cpp_is():
    with pytest.raises(InvalidInput, match=r"needs flash attention for a quantized V cache \(type_v q4_0\)"):
        LlamaCppSettings(type_v="q4_0", flash_attn="off")
    LlamaCppSettings(type_k="q4_0", flash_attn="off")  # a quantized K alone runs without it
    with pytest.raises(InvalidInput, match="flash_attn 'yes' is not one of auto, on, off"):
        LlamaCppSettings(flash_attn="yes")


@pytest.mark.parametrize("lines, ran", [
    (["llama_context: flash_attn            = auto", "resolve_fused_ops: Flash Attention enabled"], "enabled"),
    (["llama_context: flash_attn            = auto", "sched: Flash Attention not supported, set to disabled"], "disabled"),
    (["llama_context: flash_attn            = disabled"], "disabled"),
    (["llama_context: flash_attn            = enabled"], "enabled"),
    (["llama_context: flash_attn            = auto"], None),
    (["load_tensors: CPU_Mapped model buffer size = 1.0 MiB"], None),
])
def test_flash_attn_ran_reads_llama_cpps_log(lines, ran):
    assert flash_attn_ran(lines) == ran


def test_kv_options_belong_to_llama_cpp_engines_only():
    assert kv_settings("llama.cpp", "q8_0", None, "on") == {"type_k": "q8_0", "flash_attn": "on"}
    assert kv_settings("llama.cpp-repack", None, "bf16", None) == {"type_v": "bf16"}
    assert kv_settings("oracle", None, None, None) == {}
    with pytest.raises(InvalidInput, match=r"^--reference-cache-type-v applies to the llama.cpp and llama.cpp-repack engines, not oracle$"):
        kv_settings("oracle", None, "f32", None, prefix="--reference-")
    with pytest.raises(InvalidInput, match="allowed: f32, f16, bf16, q8_0, q4_0"):
        kv_settings("llama.cpp", "f8", None, None)


def test_reproduce_lines_carry_the_kv_options():
    assert candidate_flags({"type_k": "q4_0", "type_v": "q4_0", "flash_attn": "on"}) == [
        "--cache-type-k", "q4_0", "--cache-type-v", "q4_0", "--flash-attn", "on"]


def test_engine_label_names_the_types_and_what_ran():
    rec = {"name": "llama.cpp", "settings": {"type_k": "q8_0", "type_v": "f16", "flash_attn": "auto", "flash_attn_ran": "disabled"}}
    assert engine_label(rec) == "llama.cpp (KV q8_0/f16, flash attention disabled)"
    rec["settings"].pop("flash_attn_ran")
    assert engine_label(rec) == "llama.cpp (KV q8_0/f16, flash_attn auto)"
    assert engine_label({"name": "oracle", "settings": {}}) == "oracle"


@pytest.mark.parametrize("settings, ran", [({"type_k": "q8_0", "type_v": "q8_0"}, "enabled"),
                                           ({"type_k": "f32", "type_v": "f32", "flash_attn": "off"}, "disabled")])
def test_the_engine_records_the_types_and_whether_flash_attention_ran(settings, ran):
    eng = LlamaCppEngine(fx.build("tiny-qwen35"), settings=LlamaCppSettings(**settings))
    assert "flash_attn_ran" not in eng.info.settings  # nothing decoded yet: not known, not guessed
    logits = gather(eng.logits(list(range(12))), 12)
    assert logits.shape[0] == 12
    info = eng.info.settings
    assert (info["type_k"], info["type_v"], info["flash_attn_ran"]) == (settings["type_k"], settings["type_v"], ran)


def _harness(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "harness", *args], capture_output=True, text=True, timeout=600, cwd=REPO)


def test_parity_refuses_a_bad_type_name_in_one_line_exit_2():
    r = _harness("parity", "--model", "fixture:tiny-qwen35", "--candidate", "llama.cpp", "--cache-type-v", "q2_k", "--no-evidence")
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip() == ("harness: INVALID: llama.cpp type_v 'q2_k' is not a KV-cache type the harness runs; "
                                "allowed: f32, f16, bf16, q8_0, q4_0")


def test_parity_mtp_refuses_kv_options_rather_than_ignoring_them():
    r = _harness("parity", "--mtp", "--model", "fixture:tiny-qwen35-mtp", "--candidate", "oracle", "--reference-cache-type-k", "q8_0",
                 "--no-evidence")
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip() == ("harness: INVALID: --reference-cache-type-k: not with --mtp (the MTP cells run llama.cpp's MTP "
                                "context at its default KV settings)")


def test_parity_receipt_and_title_name_the_kv_types(tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"id": "p", "tokens": [(7 * i + 3) % 500 for i in range(80)]}) + "\n")
    common = ("parity", "--model", "fixture:tiny-qwen35", "--candidate", "llama.cpp", "--cache-type-k", "q8_0", "--cache-type-v",
              "q8_0", "--reference-cache-type-k", "f32", "--reference-cache-type-v", "f32", "--prompts", str(prompts),
              "--greedy-tokens", "0", "--no-evidence")
    r = _harness(*common, "--json")
    assert r.returncode in (0, 1), r.stderr
    rec = json.loads(r.stdout)
    cand, ref = rec["engines"]["candidate"], rec["engines"]["reference"]
    assert (cand["settings"]["type_k"], cand["settings"]["type_v"], cand["settings"]["flash_attn_ran"]) == ("q8_0", "q8_0", "enabled")
    assert (ref["settings"]["type_k"], ref["settings"]["type_v"]) == ("f32", "f32")
    assert cand["requested"] == {"type_k": "q8_0", "type_v": "q8_0"}
    t = _harness(*common)
    assert "llama.cpp (KV q8_0/q8_0, flash attention enabled) vs llama.cpp (KV f32/f32" in " ".join(t.stdout.split())
