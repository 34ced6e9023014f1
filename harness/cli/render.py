"""Rendering shared by every verb: consoles, JSON, tables that stay whole, progress bars, status colours,
and the verdict page written after a run. Untrusted strings go through ``harness.display``."""

from __future__ import annotations

import json
import os
import sys
from typing import Any, Iterable, Sequence

import click
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from harness.display import markup as _m
from harness.display import plain as _p


def _console(stderr: bool = False, width: int | None = None) -> Console:
    """A rich console; wide enough for the tables when output is not a terminal (160 columns, or
    ``width``); on a terminal at most ``width`` columns when given."""
    import shutil

    stream = sys.stderr if stderr else sys.stdout
    # emoji off: ``:smile:`` in a prompt id is text, like everything else that is shown
    if stream.isatty():
        return Console(stderr=stderr, width=min(shutil.get_terminal_size().columns, width) if width else None, emoji=False)
    return Console(stderr=stderr, width=width or 160, emoji=False)


def _echo_json(obj: Any) -> None:
    click.echo(json.dumps(obj, indent=2, sort_keys=False, default=str))


TABLE_MIN_COLUMN = 12
"""A table whose names (``_render_table`` ``keys``) leave less than this many characters to each
other column is printed as a list instead."""


def _table_width() -> int:
    """Characters a table may use: ``$COLUMNS`` when set, else the terminal's width on a
    terminal, else 120 (output captured by a program)."""
    try:
        cols = int(os.environ.get("COLUMNS", "0") or 0)
    except ValueError:
        cols = 0
    if cols > 0:
        return cols
    return os.get_terminal_size(sys.stdout.fileno()).columns if sys.stdout.isatty() else 120


def _render_table(title: str, columns: Sequence[str], rows: Iterable[Sequence[str]], styles: dict[str, str] | None = None,
                  keys: int = 1) -> None:
    """Print a rich table (``styles`` maps a cell value to a style, e.g. DISCHARGED → green);
    every other cell and the title shown literally (``display.markup``). The first ``keys``
    columns hold names and ids people copy: never wrapped (``no_wrap``, as wide as their longest
    value); when that leaves the other columns less than ``TABLE_MIN_COLUMN`` characters each at
    ``_table_width``, the rows are printed as a list instead (each row's names on one line, then
    ``column: value`` lines)."""
    rows = [[str(v) for v in r] for r in rows]
    width = _table_width()
    key_w = [max([len(_p(c)), *(len(_p(r[i])) for r in rows)]) for i, c in enumerate(columns[:keys])]
    rest = len(columns) - keys
    borders = 3 * len(columns) + 1
    if rest and width - sum(key_w) - borders < TABLE_MIN_COLUMN * rest:
        click.echo(_p(title))
        for r in rows:
            click.echo("  ".join(_p(v) for v in r[:keys]))
            for col, v in zip(columns[keys:], r[keys:]):
                click.echo(f"    {_p(col)}: {_p(v)}")
        return
    t = Table(title=_m(title))
    for i, col in enumerate(columns):
        if i < keys:
            t.add_column(col, no_wrap=True, min_width=key_w[i])
        else:
            t.add_column(col, overflow="fold")
    for r in rows:
        t.add_row(*[f"[{styles[v]}]{v}[/]" if styles and v in styles else _m(v) for v in r])
    Console(width=width, emoji=False).print(t)


def _short(msg: str, n: int = 140) -> str:
    line = " ".join(str(msg).split())
    return line if len(line) <= n else line[: n - 1] + "…"


GREEN_CELLS = ("DISCHARGED", "RED", "GREEN")


YELLOW_CELLS = ("RED-SEEN", "BOUND", "SKIPPED")


STATUS_STYLES = {**{v: "green" for v in GREEN_CELLS}, **{v: "yellow" for v in YELLOW_CELLS},
                 **{v: "red" for v in ("UNBOUND", "STALE", "VACUOUS", "NOT-RED", "GREEN-FAILED", "FAIL", "ERROR")}, "NOT-APPLICABLE": "dim"}
"""Colours of discharge outcomes and obligation statuses (``harness.contracts.discharge``)."""


def _stderr_log(quiet: bool):
    con = _console(stderr=True)
    return (lambda m: None) if quiet else (lambda m: con.print(m, markup=False))


def _with_progress(fn, quiet: bool = False):
    """Run ``fn(progress_callback)`` under a rich progress bar on stderr (positions compared)."""
    if quiet:
        return fn(None)
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=Console(stderr=True, emoji=False), transient=True) as bar:
        task = bar.add_task("engines running", total=None)

        def cb(prompt_id: str, done: int, total: int) -> None:
            bar.update(task, description=f"prompt {_m(prompt_id)}", completed=done, total=total)

        return fn(cb)


SIGNOFF_STYLES = {"ok": "green", "n/a": "dim", "missing": "yellow", "unmeasured": "yellow", "stale": "red", "failed": "red",
                  "SIGNED": "green", "BLOCKED": "red"}
