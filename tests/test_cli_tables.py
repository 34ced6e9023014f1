"""Tables people can copy from (issue 32): names in the CLI's rich tables are never wrapped, and
a terminal too narrow for them gets a list instead."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from harness.cli import cli
from harness.engines.mutants import mutant_rows


@pytest.mark.parametrize("columns", [80, 120, 200])
def test_mutants_list_prints_every_name_whole_on_one_line(columns):
    out = CliRunner().invoke(cli, ["mutants", "list"], env={"COLUMNS": str(columns)})
    assert out.exit_code == 0, out.output
    lines = out.output.splitlines()
    names = [r["name"] for r in mutant_rows()]
    assert len(names) > 20
    for name in names:
        assert any(name in ln for ln in lines), f"{name} is not whole on any line at COLUMNS={columns}"
    assert all(len(ln) <= columns for ln in lines if "│" in ln or "┃" in ln)  # a table fits its width
    table = any("┃ name" in ln for ln in lines)
    assert table == (columns >= 120)  # at 80 the names leave too little room: a list


def test_long_names_stay_whole_in_a_table_and_other_columns_fold(monkeypatch, capsys):
    from harness import cli as cli_mod

    name = "mutant:" + "x" * 60
    monkeypatch.setenv("COLUMNS", "140")
    cli_mod._render_table("t", ("name", "detail"), [(name, "word " * 60)])
    lines = capsys.readouterr().out.splitlines()
    assert any(name in ln and "│" in ln for ln in lines)  # whole, inside the table
    assert sum("word" in ln for ln in lines) > 1  # the other column folds instead
