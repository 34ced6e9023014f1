"""The external command protocol: the example engine works; broken engines are ENGINE-ERROR or
NOT-COMPARABLE with the engine's stderr tail, never a crash of the harness."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import command_table_refused, fake_engines_config

from harness.measure.metrics import cosine
from harness.engines.base import gather
from harness.engines.command import load_command_engine
from harness.engines.llamacpp import LlamaCppEngine
from harness.errors import EngineError, InvalidInput, NotComparable
from harness.fixtures import synthetic as fx

TOKENS = list(range(30, 90))

# Each fake engine: a Python body run with (request_path, out_dir) in sys.argv.
FAKES = {
    "crash": "import sys; sys.stderr.write('segfault in kernel foo\\n'); sys.exit(3)",
    "hang": "import time; time.sleep(60)",
    "nothing": "pass",
    "garbage": "open(out + '/logits.npy', 'wb').write(b'not a numpy file')",
    "pickle": "np.save(out + '/logits.npy', np.array([object()] * 4, dtype=object), allow_pickle=True)",
    "wrong-rows": "np.save(out + '/logits.npy', np.zeros((len(req['tokens']) - 1, V), np.float32))",
    "float64": "np.save(out + '/logits.npy', np.zeros((len(req['tokens']), V), np.float64))",
    "wrong-vocab": "np.save(out + '/logits.npy', np.zeros((len(req['tokens']), V + 1), np.float32))",
    "nan": "a = np.ones((len(req['tokens']), V), np.float32); a[7, 3] = np.nan; np.save(out + '/logits.npy', a)",
    "abort": "import os; os.abort()",
}


@pytest.fixture()
def fake_config(tmp_path, monkeypatch):
    return fake_engines_config(tmp_path, monkeypatch, FAKES, 515, 3)


def _run(name):
    eng = load_command_engine(name, fx.build("tiny-qwen35"))
    return gather(eng.logits(TOKENS), len(TOKENS))


def test_example_engine_matches_llama_cpp():
    eng = load_command_engine("example", fx.build("tiny-qwen35"))
    got = gather(eng.logits(TOKENS))
    ref = gather(LlamaCppEngine(fx.build("tiny-qwen35")).logits(TOKENS))
    assert got.shape == ref.shape
    assert cosine(ref, got).min() > 0.9999
    assert eng.info.build["reported_name"] == "example-llamacpp"
    pieces = gather(eng.logits(TOKENS, chunks=[13, 47]))
    assert cosine(got, pieces).min() > 0.99999


def test_example_engine_imports_nothing_from_the_harness():
    import ast

    src = (fx.DATA_DIR.parent.parent / "examples" / "llamacpp_engine.py").read_text()
    mods = set()
    for node in ast.walk(ast.parse(src)):
        if isinstance(node, ast.Import):
            mods |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            mods.add((node.module or "").split(".")[0])
    assert "llama_cpp" in mods and "harness" not in mods


@pytest.mark.parametrize(
    "name, match",
    [
        ("crash", "exited 3"),
        ("hang", "timed out after 3 s"),
        ("nothing", "wrote no logits.npy"),
        ("garbage", "unreadable logits.npy"),
        ("pickle", "unreadable logits.npy"),
        ("wrong-rows", r"shape \(59, 515\)"),
        ("float64", "dtype float64"),
        ("abort", "died with SIGABRT"),
    ],
)
def test_broken_engines_are_engine_errors(fake_config, name, match):
    with pytest.raises(EngineError, match=match) as ei:
        _run(name)
    assert ei.value.exit_code == 3
    if name == "crash":
        assert "segfault in kernel foo" in ei.value.stderr_tail


def test_vocab_mismatch_is_not_comparable(fake_config):
    with pytest.raises(NotComparable, match="516 columns"):
        _run("wrong-vocab")


def test_nan_logits_pass_through_to_the_gate(fake_config):
    arr = _run("nan")
    assert np.isnan(arr[7, 3]) and np.isfinite(np.delete(arr, 7, axis=0)).all()


def test_unknown_command_engine_names_the_configured_ones(fake_config):
    with pytest.raises(InvalidInput, match="command:crash"):
        load_command_engine("missing", fx.build("tiny-qwen35"))


def test_command_must_be_an_argument_list(tmp_path, monkeypatch):
    command_table_refused(tmp_path, monkeypatch, '[engines.bad]\ncommand = "python engine.py {request}"\n', "list of strings")


def test_placeholders_are_whole_arguments_only(tmp_path, monkeypatch):
    """A token or file name can't inject arguments: only whole-argument placeholders expand."""
    script = tmp_path / "echo.py"
    script.write_text(
        "import json, sys, numpy as np\n"
        "json.dump(sys.argv[1:], open(sys.argv[-1] + '/args.json', 'w'))\n"
        "req = json.load(open(sys.argv[-2]))\n"
        "np.save(sys.argv[-1] + '/logits.npy', np.zeros((len(req['tokens']), 515), np.float32))\n"
        "import shutil; shutil.copy(sys.argv[-1] + '/args.json', sys.argv[1])\n"
    )
    seen = tmp_path / "seen.json"
    cfg = tmp_path / "h.toml"
    cfg.write_text(f'[engines.echo]\ncommand = ["{{python}}", "{script}", "{seen}", "x{{request}}", "{{request}}", "{{out_dir}}"]\n')
    monkeypatch.setenv("HARNESS_CONFIG", str(cfg))
    eng = load_command_engine("echo", fx.build("tiny-qwen35"))
    gather(eng.logits([1, 2, 3]))
    import json

    args = json.loads(seen.read_text())
    assert args[1] == "x{request}"  # embedded placeholder left alone
    assert args[2].endswith("request.json") and len(args) == 4


def test_exit_status_names_the_signal_or_the_code():
    from harness.engines.process import exit_status

    assert exit_status(3) == "exited 3"
    assert exit_status(-6) == "died with SIGABRT" and exit_status(-9) == "died with SIGKILL"
    assert exit_status(-1000) == "died with signal 1000"  # no such signal: the number
