"""The ``harness`` command: a thin layer over the library (no logic of its own) and the one
place that renders tables for a terminal. One module per verb family, each an adapter (options
in, a run of the library out, its outcome rendered): ``runs`` (parity and MTP, probes, tokenizer,
localize, report), ``calibrate``, ``release`` (ledger, sign-off, sweep), ``contracts`` (mutants,
contracts, discharge, status), ``fixtures`` (fixtures, lint, init); ``app`` holds the click
group and shared options, ``render`` the rendering every verb shares.

Every command maps errors to the verdict exit codes of docs/design.md (see
``harness.errors``): a ``HarnessError`` prints one line ``harness: VERDICT: message`` to stderr
and exits with its code; nothing prints a traceback unless ``HARNESS_DEBUG=1``. Every string that
did not come from the harness itself is shown through ``harness.display`` (``_p`` for plain
lines, ``_m`` for rich markup, ``_lines`` for multi-line text): no prompt id, file name, engine
output or metadata can reach the terminal as control sequences or be read as rich markup.

Each command imports the library modules it runs inside its own body, marked ``# deferred:
startup``: together they load NumPy, pandas, gguf and the oracle (seconds), and ``harness
--help`` or ``harness lint`` should not wait for what they do not use.
"""

from __future__ import annotations

import os
import sys

import click

from harness.cli import calibrate, contracts, fixtures, release, runs  # noqa: F401  (each registers its commands on ``cli``)
from harness.cli.app import INTERNAL_ERROR_EXIT, cli
from harness.cli.render import _render_table
from harness.cli.runs import _dtype_settings, _render_parity
from harness.display import lines as _lines
from harness.display import plain as _p
from harness.errors import HarnessError
from harness.rundir import termination_exits

__all__ = ["INTERNAL_ERROR_EXIT", "cli", "console_main", "main", "_dtype_settings", "_render_parity", "_render_table"]


def main(argv: list[str] | None = None) -> int:
    """Entry point of the console script; returns the process exit code. SIGTERM and SIGHUP
    end a run like Ctrl-C does, through every ``finally`` (engines killed, temporary files
    removed)."""
    with termination_exits():
        return _main(argv)
def _main(argv: list[str] | None) -> int:
    try:
        cli.main(args=argv, prog_name="harness", standalone_mode=False)
    except HarnessError as e:
        if os.environ.get("HARNESS_DEBUG"):
            raise
        click.echo(f"harness: {e.verdict.value}: {_p(e)}", err=True)
        tail = getattr(e, "stderr_tail", "")
        if tail:
            click.echo("engine stderr (last lines):\n" + _lines(tail), err=True)
        return e.exit_code
    except click.exceptions.Abort:
        click.echo("harness: aborted", err=True)
        return 130
    except click.ClickException as e:
        e.message = _p(e.message)  # an unknown option or bad value echoes what was typed
        e.show()
        return 2
    except SystemExit as e:
        return int(e.code or 0) if not isinstance(e.code, str) else 2
    except KeyboardInterrupt:
        click.echo("harness: interrupted", err=True)
        return 130
    except Exception as e:  # a bug in the harness itself: one line, a documented code
        if os.environ.get("HARNESS_DEBUG"):
            raise
        msg = str(e).splitlines()[0] if str(e) else ""
        click.echo(f"harness: INTERNAL-ERROR: {type(e).__name__}: {_p(msg)} (set HARNESS_DEBUG=1 for the traceback)", err=True)
        return INTERNAL_ERROR_EXIT
    return 0
def console_main() -> None:
    """Console-script wrapper: exit with ``main()``'s code."""
    sys.exit(main())


if __name__ == "__main__":
    console_main()
