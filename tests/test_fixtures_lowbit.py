"""Low-bit i-quant fixtures (issue 59): made by llama-imatrix + llama-quantize --imatrix from the
reference's own llama.cpp build; a missing tool is one line naming the make target."""

from __future__ import annotations

import subprocess
import sys
from collections import Counter

import gguf
import pytest

from harness.fixtures import lowbit
from harness.paths import llama_tool
from harness.fixtures import synthetic as fx

pytestmark = pytest.mark.skipif(llama_tool("llama-quantize") is None,
                                reason=f"llama.cpp's tools are not built: {lowbit.BUILD_HINT}")


def test_missing_tools_are_one_line_naming_the_make_target(tmp_path):
    env = {"HARNESS_LLAMA_BIN": str(tmp_path / "nothing"), "HARNESS_CACHE_DIR": str(tmp_path / "cache"), "PATH": "/usr/bin:/bin"}
    import os
    proc = subprocess.run([sys.executable, "-m", "harness", "fixtures", "build", "trained-qwen35-256-IQ2_M"],
                          capture_output=True, text=True, env={**os.environ, **env})
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr
    assert "llama-quantize is not built" in lines[0] and 'make llama-server LLAMA_TARGETS="llama-quantize llama-imatrix"' in lines[0]
    assert "PASS" not in proc.stdout


def _types(path):
    r = gguf.GGUFReader(path)
    return r, {t.name: t.tensor_type.name for t in r.tensors}


@pytest.mark.parametrize("q, expect", [("IQ2_M", {"IQ2_S", "IQ3_S"}), ("IQ1_S", {"IQ1_S"}), ("IQ2_XXS", {"IQ2_XXS"})])
def test_lowbit_files_use_their_i_quants_and_say_an_imatrix_made_them(q, expect):
    r, types = _types(fx.build(f"trained-qwen35-256-{q}"))
    assert expect <= set(types.values()), Counter(types.values())
    assert int(r.get_field("quantize.imatrix.chunks_count").contents()) == lowbit.IMATRIX_CHUNKS


def test_ud_mix_keeps_attention_recurrent_and_output_high():
    _, types = _types(fx.build("trained-qwen35-256-UD-IQ2_XXS"))
    assert types["output.weight"] == "Q6_K"
    assert types["blk.0.attn_qkv.weight"] == "Q8_0" and types["blk.0.ssm_out.weight"] == types["blk.0.attn_gate.weight"] == "Q8_0"
    assert types["blk.3.attn_q.weight"] == "Q5_K" and types["blk.3.attn_k.weight"] == "Q6_K"
    assert types["blk.0.ffn_down.weight"] != "Q8_0" and "IQ2_XXS" in set(types.values())
