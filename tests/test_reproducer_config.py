"""Reproducers that reproduce (issue 32): a receipt of a ``command:`` engine configured through
``$HARNESS_CONFIG`` records the config file's path and sha256, the report's reproduce line carries
them, the line run as printed from another directory gives the same verdict, and a config whose
sha256 differs is refused with a one-line reason."""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

from harness.config import EXPECTED_SHA256_ENV, config_record, load_config, reproduce_env
from harness.errors import InvalidInput
from harness.judge.reproducer import Reproducer

ENGINE = """
import json, sys
import numpy as np
req = json.load(open(sys.argv[1])); out = sys.argv[2]
rows = np.stack([np.random.default_rng(t).standard_normal(515).astype(np.float32) for t in req["tokens"]])
np.save(out + "/logits.npy", rows)
"""


def _project(d: Path) -> Path:
    d.mkdir()
    (d / "engine.py").write_text(ENGINE)
    (d / "harness.toml").write_text('[engines.mlx]\ncommand = ["{python}", "engine.py", "{request}", "{out_dir}"]\n'
                                    '[engines.twin]\ncommand = ["{python}", "engine.py", "{request}", "{out_dir}"]\n')
    (d / "p.jsonl").write_text(json.dumps({"id": "p", "tokens": list(range(1, 201))}) + "\n")
    return d / "harness.toml"


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("HARNESS_CONFIG", EXPECTED_SHA256_ENV)}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"  # the `harness` script
    return env | extra


def test_reproduce_line_carries_the_config_and_reproduces_from_elsewhere(tmp_path):
    cfg = _project(tmp_path / "a")
    sha = hashlib.sha256(cfg.read_bytes()).hexdigest()
    ledger = tmp_path / "ev" / "ledger.jsonl"
    # relative config, prompts: as a user in their project would type them
    r = subprocess.run([sys.executable, "-m", "harness", "parity", "--model", "fixture:tiny-qwen35", "--candidate", "command:mlx",
                        "--reference", "command:twin", "--prompts", "p.jsonl", "--ledger", str(ledger)],
                       cwd=cfg.parent, env=_env(HARNESS_CONFIG="harness.toml"), capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    receipt = json.loads(next((ledger.parent / "receipts").rglob("*.json")).read_text())
    assert receipt["engines"]["candidate"]["config"] == {"path": str(cfg), "sha256": sha}
    report = next((ledger.parent / "reports").glob("*/report.md")).read_text()
    line = re.search(r"\| reproduce \| `([^`]*)` \|", report).group(1)
    assert line.startswith(f"HARNESS_CONFIG={cfg} {EXPECTED_SHA256_ENV}={sha} harness parity ")
    assert f"--prompts {cfg.parent / 'p.jsonl'}" in line  # absolute: the line runs from anywhere
    elsewhere = tmp_path / "b"
    elsewhere.mkdir()
    again = subprocess.run(["bash", "-c", line], cwd=elsewhere, env=_env(), capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stdout + again.stderr
    assert re.search(r"^PASS: ", again.stdout, re.M) and re.search(r"^PASS: ", r.stdout, re.M)
    # the config changed since: refused, one line, exit 2 (INVALID), before any engine runs
    cfg.write_text(cfg.read_text() + "# edited\n")
    changed = subprocess.run(["bash", "-c", line], cwd=elsewhere, env=_env(), capture_output=True, text=True, timeout=600)
    assert changed.returncode == 2, changed.stdout + changed.stderr
    err = changed.stderr.strip()
    assert "\n" not in err and err.startswith(f"harness: INVALID: config {cfg} has sha256 ")
    assert f"asks for {sha[:12]}" in err


def test_config_record_and_the_failure_lines_reproducer(tmp_path, monkeypatch):
    cfg = tmp_path / "my config.toml"
    cfg.write_text('[engines.x]\ncommand = ["x"]\n')
    sha = hashlib.sha256(cfg.read_bytes()).hexdigest()
    monkeypatch.setenv("HARNESS_CONFIG", str(cfg))
    monkeypatch.delenv(EXPECTED_SHA256_ENV, raising=False)
    assert config_record("command:x") == {"path": str(cfg), "sha256": sha}
    assert config_record("http:x") == {"path": str(cfg), "sha256": sha}
    assert config_record("oracle") is None and config_record("mutant:conv-state-dropped") is None
    assert reproduce_env(None, None) == []
    case = Reproducer("command:x", "fixture:tiny-qwen35", "0" * 64, config=config_record("command:x"))
    assert case.harness("probe", "--only", "split") == (f"HARNESS_CONFIG='{cfg}' {EXPECTED_SHA256_ENV}={sha} harness probe "
                                                        "--candidate command:x --model fixture:tiny-qwen35 --only split")
    assert Reproducer("oracle", "fixture:tiny-qwen35", "0" * 64).harness("probe").startswith("harness probe")
    monkeypatch.setenv(EXPECTED_SHA256_ENV, sha)
    assert load_config().sha256 == sha
    monkeypatch.setenv(EXPECTED_SHA256_ENV, "f" * 64)
    try:
        load_config()
    except InvalidInput as e:
        assert str(e).startswith(f"config {cfg} has sha256 {sha[:12]}, but ${EXPECTED_SHA256_ENV} asks for ffffffffffff")
    else:
        raise AssertionError("a config with another sha256 was accepted")
