"""llama.cpp's extra buffer types (weight repacking, ``use_extra_bufts``): off in the reference by
default, on in ``llama.cpp-repack``; the buffers its load log names and its CPU feature line in
every receipt; a crash after repacking names the cause and the setting that avoids it
(issue 43: the AMX path segfaults on Intel Xeon, llama.cpp #20824)."""

from __future__ import annotations

import json
import platform
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from harness.engines.base import gather
from harness.engines.llamacpp import EXTRA_BUFFERS, REPACK_ENGINE, LlamaCppEngine, crash_cause, model_buffers
from harness.engines.registry import engine_build_id, resolve_engine
from harness.errors import EngineError
from harness.fixtures.resolve import resolve_model

X86 = platform.machine().lower() in ("x86_64", "amd64")
Q4_0 = "fixture:trained-qwen35-256-Q4_0"
Q8_0 = "fixture:trained-qwen35-256-Q8_0"

AMX_LOG = """load_tensors: loading model tensors, this can take a while... (load_mode = mmap)
done_getting_tensors: tensor 'token_embd.weight' (q8_0) (and 30 others) cannot be used with preferred buffer type AMX, using CPU instead
load_tensors:          AMX model buffer size =     2.97 MiB
load_tensors:   CPU_Mapped model buffer size =     2.96 MiB
ggml_backend_amx_buffer_set_tensor: amx repack tensor blk.0.attn_qkv.weight of type q8_0
sched_reserve:        CPU compute buffer size =     5.03 MiB
"""
"""The load log of llama-cpp-python 0.3.36 on ``trained-qwen35-256-Q8_0`` on an Intel Xeon with
AMX_INT8, extra buffer types on (cut to its buffer lines), before the SIGSEGV."""


def _needs_x86_repack(engine: LlamaCppEngine) -> None:
    """Skip, naming why, where llama.cpp's CPU backend has no extra buffer type for Q4_0."""
    if not X86:
        pytest.skip(f"extra buffer types checked on x86 only (this machine: {platform.machine()})")
    features = engine.info.build["cpu_features"]
    if "AMX_INT8 = 1" not in features and not ("REPACK = 1" in features and "AVX2 = 1" in features):
        pytest.skip(f"llama.cpp here has neither AMX_INT8 nor REPACK with AVX2 ({features})")


def test_model_buffers_reads_the_load_log():
    assert model_buffers(AMX_LOG.splitlines()) == {"AMX": 2.97, "CPU_Mapped": 2.96}
    assert model_buffers(["load_tensors:   CPU_REPACK model buffer size =     1.50 MiB"]) == {"CPU_REPACK": 1.5}
    assert model_buffers(["sched_reserve:        CPU compute buffer size =     5.03 MiB"]) == {}


def test_reference_makes_no_extra_buffer_and_the_opt_in_makes_one():
    """The acceptance of issue 43: llama.cpp's own load log on a Q4_0 file names no AMX or
    CPU_REPACK model buffer by default, and one with the opt-in (``llama.cpp-repack``)."""
    path = resolve_model(Q4_0)
    ref = resolve_engine("llama.cpp", path)
    _needs_x86_repack(ref)
    info = ref.info
    assert info.settings["use_extra_bufts"] is False
    assert "CPU_Mapped" in info.build["model_buffers"]
    assert not set(EXTRA_BUFFERS) & set(info.build["model_buffers"]), info.build["model_buffers"]
    on = resolve_engine(REPACK_ENGINE, path).info
    assert on.settings["use_extra_bufts"] is True
    made = set(EXTRA_BUFFERS) & set(on.build["model_buffers"])
    assert made, on.build["model_buffers"]
    assert all(on.build["model_buffers"][b] > 0 for b in made)
    # one engine's code: the same build id; the setting is what tells the two apart
    assert engine_build_id(REPACK_ENGINE) == engine_build_id("llama.cpp")


def test_repack_keeps_the_other_settings():
    eng = resolve_engine(REPACK_ENGINE, resolve_model("fixture:tiny-qwen35"), n_threads=1)
    assert eng.settings.use_extra_bufts is True and eng.settings.n_threads == 1
    assert eng.with_settings(n_ubatch=7).settings.use_extra_bufts is True


def _dies_with(tmp_path, sig: int, stderr: str) -> EngineError:
    """``LlamaCppEngine._finish`` on a real process that writes ``stderr`` to the worker's stderr
    file and kills itself with ``sig``: the error the harness reports."""
    (tmp_path / "stderr.txt").write_text("")
    code = f"import os, sys; sys.stderr.write({stderr!r}); sys.stderr.flush(); os.kill(os.getpid(), {int(sig)})"
    with open(tmp_path / "stderr.txt", "wb") as err:
        proc = subprocess.Popen([sys.executable, "-c", code], stderr=err)
    with pytest.raises(EngineError) as ei:
        LlamaCppEngine(tmp_path / "m.gguf")._finish(proc, tmp_path, time.monotonic() + 60)
    return ei.value


@pytest.mark.parametrize("sig", [signal.SIGSEGV, signal.SIGILL], ids=["SIGSEGV", "SIGILL"])
def test_a_crash_after_an_amx_buffer_names_it_and_the_setting(tmp_path, sig):
    e = _dies_with(tmp_path, sig, AMX_LOG)
    msg = str(e)
    assert msg.startswith(f"llama.cpp died with {signal.Signals(sig).name} on m.gguf: ")
    assert "AMX model buffer" in msg and "llama.cpp #20824" in msg
    assert "use_extra_bufts false" in msg and REPACK_ENGINE in msg and "\n" not in msg
    assert e.exit_code == 3


def test_a_crash_after_a_cpu_repack_buffer_names_it(tmp_path):
    msg = str(_dies_with(tmp_path, signal.SIGSEGV, "load_tensors:   CPU_REPACK model buffer size =     1.41 MiB\n"))
    assert "CPU_REPACK model buffer" in msg and "use_extra_bufts false" in msg
    assert "AMX" not in msg and "#20824" not in msg


def test_other_crashes_are_not_blamed_on_repacking(tmp_path):
    plain = "load_tensors:   CPU_Mapped model buffer size =     2.96 MiB\n"
    assert str(_dies_with(tmp_path, signal.SIGSEGV, plain)) == "llama.cpp died with SIGSEGV on m.gguf"
    # an abort is ggml's own assert, whatever buffers were made
    assert "repacked" not in str(_dies_with(tmp_path, signal.SIGABRT, AMX_LOG))
    assert crash_cause(1, {"AMX": 1.0}) == "" and crash_cause(-signal.SIGSEGV, {"CPU_Mapped": 1.0}) == ""


def test_amx_crash_is_reported_where_the_cpu_has_amx():
    """On a CPU with AMX_INT8 (Intel Xeon Sapphire Rapids and later) llama.cpp 0.3.36 with extra
    buffer types segfaults on the Q8_0 fixture's first compute; the reference, without them, runs."""
    path = resolve_model(Q8_0)
    ref = resolve_engine("llama.cpp", path)
    if "AMX_INT8 = 1" not in ref.info.build["cpu_features"]:
        pytest.skip(f"no AMX_INT8 in llama.cpp's system info here ({ref.info.build['cpu_features']})")
    tokens = list(range(1, 65))
    assert np.isfinite(gather(ref.logits(tokens), len(tokens))).all()
    with pytest.raises(EngineError, match=r"died with SIG(SEGV|ILL) .*AMX model buffer.*use_extra_bufts false"):
        gather(resolve_engine(REPACK_ENGINE, path).logits(tokens), len(tokens))


def test_receipt_records_the_buffer_setting_and_cpu_feature_lines(tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"id": "one", "text": "def main(argv):\n    return sorted(set(argv)) " * 8}) + "\n")
    r = subprocess.run([sys.executable, "-m", "harness", "parity", "--model", "fixture:tiny-qwen35", "--prompts", str(prompts),
                        "--greedy-tokens", "0", "--no-evidence", "--json"], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    rec = json.loads(r.stdout)
    ref, cand = rec["engines"]["reference"], rec["engines"]["candidate"]
    assert ref["settings"]["use_extra_bufts"] is False
    assert ref["build"]["cpu_features"].startswith("CPU : ")  # llama_print_system_info(), every arch
    assert not set(EXTRA_BUFFERS) & set(ref["build"]["model_buffers"])
    assert "cpu_features" in cand["build"] and cand["build"]["cpu_features"] is None  # the oracle states none
    assert rec["host"]["cpu"]
