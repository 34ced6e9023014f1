"""Unreadable, truncated, corrupted and foreign GGUF files: exit 2 with one line, no traceback."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from harness.errors import InvalidInput
from harness.fixtures import synthetic as fx
from harness.model.gguf_model import GGUFModel


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "harness", *args], capture_output=True, text=True, timeout=300)


def _truncated(tmp_path: Path, frac: float) -> Path:
    data = fx.build("tiny-qwen35").read_bytes()
    p = tmp_path / f"trunc-{frac}.gguf"
    p.write_bytes(data[: int(len(data) * frac)])
    return p


@pytest.mark.parametrize("frac", [0.0001, 0.002, 0.01, 0.05, 0.5, 0.9, 0.999])
def test_truncated_file_is_invalid_input(tmp_path, frac):
    with pytest.raises(InvalidInput):
        GGUFModel(_truncated(tmp_path, frac))


def test_lint_truncated_mid_tensor_exits_2_with_one_line(tmp_path):
    p = _truncated(tmp_path, 0.6)
    r = run_cli("lint", str(p))
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "truncated" in lines[0], r.stderr
    assert "Traceback" not in r.stderr + r.stdout


def test_wrong_magic_exits_2(tmp_path):
    data = bytearray(fx.build("tiny-qwen35").read_bytes())
    data[:4] = b"GGUX"
    p = tmp_path / "magic.gguf"
    p.write_bytes(bytes(data))
    r = run_cli("lint", str(p))
    assert r.returncode == 2
    assert len(r.stderr.strip().splitlines()) == 1 and "not a readable GGUF" in r.stderr


def test_missing_file_exits_2(tmp_path):
    r = run_cli("lint", str(tmp_path / "nope.gguf"))
    assert r.returncode == 2 and "no such" in r.stderr


def test_other_architecture_exits_2_naming_supported(tmp_path):
    import gguf

    p = tmp_path / "llama.gguf"
    w = gguf.GGUFWriter(str(p), "llama")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((8, 4), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    r = run_cli("lint", str(p))
    assert r.returncode == 2
    line = r.stderr.strip()
    assert "unsupported architecture 'llama'" in line and "qwen35, qwen35moe" in line
    assert len(line.splitlines()) == 1


def test_bad_override_syntax_exits_2():
    r = run_cli("lint", "fixture:tiny-qwen35", "--override-kv", "qwen35.block_count=8")
    assert r.returncode == 2 and "KEY=TYPE:VALUE" in r.stderr
