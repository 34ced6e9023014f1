"""Helpers shared by several test modules (fixtures live in conftest.py): a scratch copy of the
repository to edit contracts in, and a ``$HARNESS_CONFIG`` of fake command engines."""

from __future__ import annotations

import shutil
import textwrap
from pathlib import Path
from typing import Iterable, Mapping

import pytest

REPO = Path(__file__).resolve().parent.parent


def repo_copy(tmp_path: Path, contracts: Iterable[str] = ()) -> Path:
    """A minimal copy of the repository under ``tmp_path/repo`` (pyproject, thresholds,
    tests/conftest.py, the bound tests and the named contract files) to edit without touching the
    real one."""
    root = tmp_path / "repo"
    (root / "contracts").mkdir(parents=True)
    for f in ("pyproject.toml", "thresholds.yaml", "tests/conftest.py"):
        (root / f).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(REPO / f, root / f)
    shutil.copytree(REPO / "tests" / "contracts", root / "tests" / "contracts", ignore=shutil.ignore_patterns("__pycache__"))
    for c in contracts:
        shutil.copy(REPO / "contracts" / c, root / "contracts" / c)
    return root


def fake_engines_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, bodies: Mapping[str, str], n_vocab: int,
                        timeout_s: float, preamble: str = "") -> Path:
    """Write one fake command engine per ``bodies`` entry (``[engines.NAME]``) and point
    ``$HARNESS_CONFIG`` at them. Each body runs with ``req`` (the request), ``out`` (the output
    dir), ``V`` = ``n_vocab``, ``np``, ``sys`` and whatever ``preamble`` defines."""
    tables = []
    for name, body in bodies.items():
        script = tmp_path / f"fake_engine_{name}.py"  # prefixed: a script named pickle.py would shadow the stdlib
        script.write_text(textwrap.dedent("""
            import json, sys
            import numpy as np
            req = json.load(open(sys.argv[1])); out = sys.argv[2]; V = {V}
        """).format(V=n_vocab) + textwrap.dedent(preamble) + textwrap.dedent(body) + "\n")
        tables.append(f'[engines.{name}]\ncommand = ["{{python}}", "{script}", "{{request}}", "{{out_dir}}"]\ntimeout_s = {timeout_s}\n')
    cfg = tmp_path / "harness.toml"
    cfg.write_text("\n".join(tables))
    monkeypatch.setenv("HARNESS_CONFIG", str(cfg))
    return cfg


def command_table_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, toml: str, match: str) -> None:
    """With ``toml`` as the harness config, reading the command engines raises ``InvalidInput``
    whose message matches ``match``."""
    from harness.engines.command import configured_commands
    from harness.errors import InvalidInput

    cfg = tmp_path / "harness.toml"
    cfg.write_text(toml)
    monkeypatch.setenv("HARNESS_CONFIG", str(cfg))
    with pytest.raises(InvalidInput, match=match):
        configured_commands()
