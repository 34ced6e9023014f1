"""The CLI's surface is a contract (issue 47): ``harness --help`` and every command's options
are compared with a snapshot committed in tests/data/cli_help_snapshot.json. A change to the
CLI that adds, removes or renames an option updates the snapshot in the same commit
(``HARNESS_UPDATE_HELP_SNAPSHOT=1 pytest tests/test_cli_help_snapshot.py``)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import click
from click.testing import CliRunner

from harness.cli import cli

SNAPSHOT = Path(__file__).parent / "data" / "cli_help_snapshot.json"
ENV = {"COLUMNS": "100", "NO_COLOR": "1", "TERM": "dumb"}


def _commands(group: click.Group, prefix: tuple[str, ...] = ()):
    """Every command path under ``group``, the group itself first: tuples of names."""
    yield prefix
    ctx = click.Context(group)
    for name in group.list_commands(ctx):
        sub = group.get_command(ctx, name)
        if isinstance(sub, click.Group):
            yield from _commands(sub, prefix + (name,))
        else:
            yield prefix + (name,)


def _command(path: tuple[str, ...]) -> click.Command:
    cmd: click.Command = cli
    for name in path:
        cmd = cmd.get_command(click.Context(cmd), name)  # type: ignore[attr-defined]
    return cmd


def _type(t: click.ParamType) -> str:
    """A parameter type as stable text (its name and declared settings, no object address)."""
    info = {k: v for k, v in t.to_info_dict().items() if k != "param_type"}
    return json.dumps(info, sort_keys=True, default=str)


def _options(cmd: click.Command) -> list[dict]:
    """Each parameter's declared surface: names, kind, type, default, flags."""
    out = []
    for p in cmd.params:
        out.append({
            "name": p.name, "opts": list(p.opts) + list(p.secondary_opts),
            "kind": type(p).__name__, "type": _type(p.type), "required": p.required,
            "multiple": p.multiple, "nargs": p.nargs,
            "is_flag": bool(getattr(p, "is_flag", False)),
            "default": repr(p.default) if not callable(p.default) else "<callable>",
        })
    return out


def snapshot() -> dict:
    """The help text and options of ``harness`` and of every command, keyed by ``harness …``."""
    runner = CliRunner()
    snap = {}
    for path in _commands(cli):
        res = runner.invoke(cli, [*path, "--help"], env=ENV, prog_name="harness")
        assert res.exit_code == 0, (path, res.output)
        key = " ".join(("harness", *path))
        snap[key] = {"help": res.output.splitlines(), "options": _options(_command(path))}
    return snap


def test_help_and_every_commands_options_match_the_committed_snapshot():
    now = snapshot()
    if os.environ.get("HARNESS_UPDATE_HELP_SNAPSHOT"):
        SNAPSHOT.write_text(json.dumps(now, indent=1, sort_keys=True) + "\n")
    committed = json.loads(SNAPSHOT.read_text())
    assert sorted(now) == sorted(committed), "commands added or removed"
    assert len(now) > 25
    for key in committed:
        assert now[key]["options"] == committed[key]["options"], key
        assert now[key]["help"] == committed[key]["help"], key
