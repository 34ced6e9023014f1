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
from harness.display import markup as _m
from harness.display import plain as _p
from harness.display import print_table
from harness.errors import InvalidInput


def _console(stderr: bool = False, width: int | None = None) -> Console:
    """A rich console ``_table_width(stderr)`` characters wide, at most ``width`` when given (an
    explicit ``$COLUMNS`` counts on a terminal and off one alike)."""
    cols = _table_width(stderr)
    # emoji off: ``:smile:`` in a prompt id is text, like everything else that is shown
    return Console(stderr=stderr, width=min(cols, width) if width else cols, emoji=False)


def _echo_json(obj: Any) -> None:
    click.echo(json.dumps(obj, indent=2, sort_keys=False, default=str))


def _table_width(stderr: bool = False) -> int:
    """Characters a table may use: ``$COLUMNS`` when set, else the terminal's width on a
    terminal, else 160 (output captured by a program)."""
    try:
        cols = int(os.environ.get("COLUMNS", "0") or 0)
    except ValueError:
        cols = 0
    if cols > 0:
        return cols
    stream = sys.stderr if stderr else sys.stdout
    try:
        return os.get_terminal_size(stream.fileno()).columns if stream.isatty() else 160
    except (OSError, ValueError):
        return 160


def _render_table(title: str, columns: Sequence[str], rows: Iterable[Sequence[str]], styles: dict[str, str] | None = None,
                  keys: int = 1, fold: Sequence[str] | None = None, right: Sequence[str] = ()) -> None:
    """Print a table on stdout at ``_table_width`` (``display.print_table``: cells literal,
    ``styles`` maps a cell value to a style, e.g. DISCHARGED → green). Columns named in ``fold``
    (free text) fold; every other column (names, ids, numbers, commands) is never wrapped or cut;
    ``fold=None`` folds every column after the first ``keys``. When the whole columns leave the
    folding ones less than ``TABLE_MIN_FOLD`` characters each, the rows are printed as a list
    (each row's first ``keys`` values on one line, then ``column: value`` lines)."""
    fold = list(columns[keys:]) if fold is None else fold
    print_table(_console(), title, columns, rows, fold=fold, right=right, keys=keys, styles=styles)


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


PROGRESS_EVERY_S_ENV = "HARNESS_PROGRESS_SECONDS"
"""Off a terminal, the seconds between two progress lines (``_progress_lines``; default 30)."""


def _progress_lines(stream=None, every_s: float | None = None, clock=None):
    """A progress callback ``(prompt_id, done, total)`` for a stderr that is not a terminal (a CI
    log, a file), where a live bar shows nothing: a line once ``every_s`` seconds (default
    ``$HARNESS_PROGRESS_SECONDS``, else 30) have passed since the start or the last line, and a
    last one when every position is done if any was printed (a run shorter than ``every_s``
    prints none, so its stderr holds only what it says at the end):
    ``harness: parity: prompt ID, 512/1479 positions compared (34%), 31 s`` (positions over
    every prompt). Raises ``InvalidInput`` for a ``$HARNESS_PROGRESS_SECONDS`` that is not a
    positive number."""
    import time

    if every_s is None:
        raw = os.environ.get(PROGRESS_EVERY_S_ENV, "30")
        try:
            every_s = float(raw)
        except ValueError:
            every_s = -1.0
        if not every_s > 0 or every_s == float("inf"):
            raise InvalidInput(f"${PROGRESS_EVERY_S_ENV} {raw!r}: not a positive number of seconds")
    stream = stream or sys.stderr
    clock = clock or time.monotonic
    start = clock()
    state = {"at": start, "printed": False}

    def cb(prompt_id: str, done: int, total: int) -> None:
        now = clock()
        if now - state["at"] < every_s and not (done >= total and state["printed"]):
            return
        state.update(at=now, printed=True)
        pct = f" ({100 * done // total}%)" if total else ""
        print(_p(f"harness: parity: prompt {prompt_id}, {done}/{total} positions compared{pct}, {now - start:.0f} s"), file=stream, flush=True)

    return cb


def _with_progress(fn, quiet: bool = False):
    """Run ``fn(progress_callback)`` under a rich progress bar on stderr (positions compared);
    where stderr is not a terminal, under progress lines instead (``_progress_lines``)."""
    if quiet:
        return fn(None)
    if not sys.stderr.isatty():
        return fn(_progress_lines())
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=Console(stderr=True, emoji=False), transient=True) as bar:
        task = bar.add_task("engines running", total=None)

        def cb(prompt_id: str, done: int, total: int) -> None:
            bar.update(task, description=f"prompt {_m(prompt_id)}", completed=done, total=total)

        return fn(cb)


SIGNOFF_STYLES = {"ok": "green", "n/a": "dim", "missing": "yellow", "unmeasured": "yellow", "stale": "red", "failed": "red",
                  "SIGNED": "green", "BLOCKED": "red"}
