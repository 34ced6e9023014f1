"""Security (issue 9): no unsafe loaders or shells in the harness, and names and token data
cannot inject arguments into engines.

- A scan of every Python file of the ``harness`` package and ``examples/`` (the AST, so comments
  and docstrings do not count and aliases do) for ``yaml.load`` without a safe loader,
  ``yaml.unsafe_load``/``full_load``, ``shell=True``, ``os.system``/``os.popen``,
  ``pickle``/``marshal``/``shelve`` loads, ``np.load`` without an explicit
  ``allow_pickle=False``, ``torch.load`` without ``weights_only=True``, and ``eval``/``exec``.
  A planted file proves the scanner sees each pattern.
- ``harness parity`` with a model, a prompt file and a temp directory whose names hold spaces,
  ``;``, ``$(...)``, backticks and a leading ``-``, and a text prompt full of shell syntax: the
  command engine receives exactly its configured argument list, each placeholder one whole
  argument (the model an absolute path, so never an option), token data only inside the request
  file, and nothing is executed. (tests/test_command_engine.py checks the placeholder rule itself.)

- Paths named in contracts stay inside the repository: a contract citing
  ``tests/../../outside/test_x.py::test_x`` is refused without pytest importing that file.
  Currently it is imported (code outside the repository runs during ``harness contracts
  validate``): refused by ``harness/contracts/loader.py`` (the file is never collected).
"""

from __future__ import annotations

import ast
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

from helpers import repo_copy

from harness.fixtures import synthetic as fx

REPO = Path(__file__).resolve().parents[1]
SCANNED = [REPO / "harness", REPO / "examples"]

SAFE_YAML_LOADERS = {"SafeLoader", "CSafeLoader", "BaseLoader", "CBaseLoader"}
ALWAYS_UNSAFE = {
    ("yaml", "unsafe_load"), ("yaml", "unsafe_load_all"), ("yaml", "full_load"), ("yaml", "full_load_all"),
    ("os", "system"), ("os", "popen"), ("subprocess", "getoutput"), ("subprocess", "getstatusoutput"),
    ("pickle", "load"), ("pickle", "loads"), ("pickle", "Unpickler"), ("cPickle", "load"), ("cPickle", "loads"),
    ("dill", "load"), ("dill", "loads"), ("marshal", "load"), ("marshal", "loads"), ("shelve", "open"), ("joblib", "load"),
}


def _dotted(node: ast.AST) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    return "?"


def _kw(call: ast.Call, name: str) -> ast.AST | None:
    return next((k.value for k in call.keywords if k.arg == name), None)


def _is_const(node: ast.AST | None, value) -> bool:
    return isinstance(node, ast.Constant) and node.value is value


def unsafe_calls(source: str, filename: str = "<src>") -> list[str]:
    """``file:line: what`` for every unsafe call in ``source`` (see module docstring)."""
    tree = ast.parse(source, filename)
    aliases: dict[str, str] = {}  # local name -> module.attr, from imports
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                aliases[a.asname or a.name] = a.name
        elif isinstance(node, ast.ImportFrom) and node.module:
            for a in node.names:
                aliases[a.asname or a.name] = f"{node.module}.{a.name}"
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        name = _dotted(node.func)
        head, _, rest = name.partition(".")
        full = f"{aliases.get(head, head)}.{rest}" if rest else aliases.get(head, head)
        full = full.replace("numpy.", "np.", 1) if full.startswith("numpy.") else full
        mod, _, attr = full.rpartition(".")
        where = f"{filename}:{node.lineno}"
        if (mod.split(".")[-1], attr) in ALWAYS_UNSAFE:
            found.append(f"{where}: {full}")
        elif full in ("yaml.load", "yaml.load_all"):
            loader = _kw(node, "Loader") or (node.args[1] if len(node.args) > 1 else None)
            if loader is None or _dotted(loader).split(".")[-1] not in SAFE_YAML_LOADERS:
                found.append(f"{where}: {full} without a safe Loader")
        elif full == "np.load" and not _is_const(_kw(node, "allow_pickle"), False):
            found.append(f"{where}: np.load without allow_pickle=False")
        elif full == "torch.load" and not _is_const(_kw(node, "weights_only"), True):
            found.append(f"{where}: torch.load without weights_only=True")
        elif name in ("eval", "exec", "compile", "__import__") and isinstance(node.func, ast.Name):
            found.append(f"{where}: {name}()")
        if _is_const(_kw(node, "shell"), True) or (_kw(node, "shell") is not None and not _is_const(_kw(node, "shell"), False)):
            found.append(f"{where}: {name}(shell=...)")
    return found


def _python_files() -> list[Path]:
    return sorted(p for d in SCANNED if d.exists() for p in d.rglob("*.py"))


def test_no_unsafe_loaders_shells_or_eval_in_the_harness():
    files = _python_files()
    assert len(files) > 20
    found = [f for p in files for f in unsafe_calls(p.read_text(), str(p.relative_to(REPO)))]
    assert found == [], "\n".join(found)


def test_plain_text_grep_agrees():
    """The same rule as plain text, for the patterns named in issue 9 (comments included)."""
    bad = []
    for p in _python_files():
        for i, line in enumerate(p.read_text().splitlines(), 1):
            code = line.split("#", 1)[0]
            if ("yaml.load(" in code and "SafeLoader" not in code) or any(
                    s in code for s in ("allow_pickle=True", "shell=True", "os.system(", "pickle.load")):
                bad.append(f"{p.relative_to(REPO)}:{i}: {line.strip()}")
    assert bad == [], "\n".join(bad)


PLANTED = textwrap.dedent("""
    import yaml, os, pickle, subprocess, numpy
    import numpy as np
    from yaml import load as yl
    from pickle import loads
    import torch
    yaml.load(s)
    yaml.load(s, Loader=yaml.Loader)
    yl(s, yaml.FullLoader)
    yaml.unsafe_load(s)
    os.system("ls")
    subprocess.run("ls", shell=True)
    subprocess.Popen(["ls"], shell=flag)
    pickle.load(f)
    loads(b)
    np.load(p)
    numpy.load(p, allow_pickle=True)
    torch.load(p)
    eval("1")
    exec("x = 1")
    # fine:
    yaml.load(s, Loader=yaml.SafeLoader)
    yaml.safe_load(s)
    np.load(p, allow_pickle=False, mmap_mode="r")
    torch.load(p, weights_only=True)
    subprocess.run(["ls"], shell=False)
    model.eval()
""")


def test_scanner_sees_every_planted_pattern():
    found = unsafe_calls(PLANTED, "planted.py")
    lines = sorted({int(f.split(":")[1]) for f in found})
    assert lines == list(range(7, 21)), found  # every line of the unsafe block, none of the safe one


# ---------------------------------------------------------------------------------------------
# Names and token data cannot inject arguments
# ---------------------------------------------------------------------------------------------
NASTY = "-rf --help; $(touch PWNED) `touch PWNED` 'q' \"qq\" | cat > PWNED &"
ECHO_ENGINE = textwrap.dedent("""
    import json, sys
    import numpy as np
    log = sys.argv[1]
    req = json.load(open(sys.argv[-2]))
    with open(log, "a") as f:
        f.write(json.dumps({"argv": sys.argv[1:], "tokens": req["tokens"], "model": req["model"]}) + "\\n")
    np.save(sys.argv[-1] + "/logits.npy",
            np.stack([np.random.default_rng(t).standard_normal(515).astype(np.float32) for t in req["tokens"]]))
""")


def test_names_and_token_data_cannot_inject_arguments(tmp_path):
    weird = tmp_path / f"dir {NASTY}"
    weird.mkdir()
    model = weird / f"{NASTY}.gguf"
    shutil.copy(fx.build("tiny-qwen35"), model)
    prompts = weird / f"--prompts=x; {NASTY}.jsonl"
    tokens = [(11 * i + 5) % 515 for i in range(70)]
    prompts.write_text(json.dumps({"id": f"ids {NASTY}", "tokens": tokens}) + "\n"
                       + json.dumps({"id": "text", "text": f"echo {NASTY} $(rm -rf ~) ${{IFS}}"}) + "\n")
    tmpdir = tmp_path / f"tmp {NASTY}"
    tmpdir.mkdir()
    script = weird / "echo engine.py"
    script.write_text(ECHO_ENGINE)
    log = tmp_path / "argv.jsonl"
    cfg = tmp_path / "harness.toml"
    cfg.write_text(f"[engines.echo]\ncommand = {json.dumps(['{python}', str(script), str(log), '--model', '{model}', '{request}', '{out_dir}'])}\n")
    gates = tmp_path / "gates.yaml"  # a fixed gate: the repository's thresholds.yaml is calibrated and moves
    gates.write_text("schema: harness-thresholds/v2\nrelease:\n"
                     "  min_positions: {value: 64, basis: {kind: declared, who: tests, why: fixed}}\n"
                     "  min_cosine: {value: 0.98, basis: {kind: declared, who: tests, why: fixed}}\n")
    env = {**os.environ, "HARNESS_CONFIG": str(cfg), "TMPDIR": str(tmpdir)}
    # relative names from inside the weird directory; --model=VALUE so the leading '-' is a value
    p = subprocess.run([sys.executable, "-m", "harness", "parity", f"--model={model.name}", "--prompts", prompts.name,
                        "--candidate", "command:echo", "--reference", "command:echo", "--no-evidence", "--json",
                        "--thresholds", str(gates)],
                       cwd=weird, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "Traceback" not in p.stderr
    calls = [json.loads(ln) for ln in log.read_text().splitlines()]
    assert len(calls) == 4  # two prompts x (reference, candidate)
    for c in calls:
        argv = c["argv"]
        assert len(argv) == 5 and argv[0] == str(log) and argv[1] == "--model"
        assert argv[2] == str(model.resolve()) and argv[2].startswith("/")  # one whole, absolute argument
        req = Path(argv[3])  # TMPDIR/qwen35-harness-UID/run-PID-*/cmd-*/request.json: the run's own folder
        assert req.name == "request.json" and req.parents[3] == tmpdir and req.parents[1].name.startswith("run-")
        assert Path(argv[4]) == Path(argv[3]).parent / "out"
        assert c["model"] == str(model.resolve())
    assert calls[0]["tokens"] == tokens  # token data travels only inside the request file
    rec = json.loads(p.stdout)
    assert rec["prompts"]["items"][0]["id"] == f"ids {NASTY}"
    assert len(rec["prompts"]["items"][1]["tokens"]) > 20  # the shell-syntax text was tokenized, not run
    assert not list(tmp_path.rglob("PWNED")) and not (Path.home() / "PWNED").exists()
    assert not list(tmpdir.rglob("request.json"))  # the run's temporary folder is gone


# ---------------------------------------------------------------------------------------------
# Paths named in contracts stay inside the repository
# ---------------------------------------------------------------------------------------------
def test_contract_test_paths_cannot_leave_the_repository(tmp_path):
    root = repo_copy(tmp_path)
    outside = tmp_path / "outside"
    outside.mkdir()
    marker = tmp_path / "EXECUTED"
    (outside / "test_evil.py").write_text(f"open({str(marker)!r}, 'w').write('imported')\n"
                                          "import pytest\n\n@pytest.mark.contract\ndef test_x():\n    pass\n")
    text = (REPO / "contracts" / "qwen35-shapes-v1.yaml").read_text()
    escaped = text.replace("tests: [tests/contracts/test_qwen35_shapes.py::test_required_keys]",
                           "tests: [tests/../../outside/test_evil.py::test_x]", 1)
    assert escaped != text
    (root / "contracts" / "qwen35-shapes-v1.yaml").write_text(escaped)
    p = subprocess.run([sys.executable, "-m", "harness", "contracts", "validate", str(root / "contracts")],
                       capture_output=True, text=True, timeout=300, cwd=root)
    assert p.returncode == 2 and "Traceback" not in p.stderr
    assert not marker.exists(), "validating a contract imported a test file outside the repository"
    assert "outside the repository" in p.stderr
