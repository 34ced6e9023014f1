"""The ``harness`` command: a thin layer over the library (no logic of its own).

Every command maps errors to the verdict exit codes of ../shared/DESIGN.md (see
``harness.errors``): a ``HarnessError`` prints one line ``harness: VERDICT: message`` to stderr
and exits with its code; nothing prints a traceback unless ``HARNESS_DEBUG=1``.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import click

from harness.errors import HarnessError, InvalidInput

INTERNAL_ERROR_EXIT = 70  # EX_SOFTWARE: a bug in the harness, not a verdict
CONTEXT = {"help_option_names": ["-h", "--help"], "max_content_width": 100}


def _echo_json(obj: Any) -> None:
    click.echo(json.dumps(obj, indent=2, sort_keys=False, default=str))


override_option = click.option(
    "--override-kv",
    "overrides",
    multiple=True,
    metavar="KEY=TYPE:VALUE",
    help="Override model metadata in memory, as llama.cpp's --override-kv (TYPE: int, float, bool, str).",
)


@click.group(context_settings=CONTEXT)
@click.version_option(package_name="qwen35-harness")
def cli() -> None:
    """Verification harness for Qwen3.5 (qwen35 / qwen35moe) inference engines."""


# -- fixtures --------------------------------------------------------------------------------
@cli.group()
def fixtures() -> None:
    """Synthetic and trained Qwen3.5 GGUF fixtures (addressable as fixture:NAME)."""


@fixtures.command("list")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
@click.option("--no-build", is_flag=True, help="Do not build missing fixtures; show sha256 only for built ones.")
def fixtures_list(as_json: bool, no_build: bool) -> None:
    """List fixtures with their sha256 (building any that are missing)."""
    from harness import fixtures as fx

    rows = []
    for name in fx.fixture_names():
        d = fx.describe(name)
        path = fx.cache_dir() / f"{name}.gguf" if name in fx.SPECS else fx.trained_fixtures()[name]
        if not no_build:
            path = fx.build(name)
        d["path"] = str(path)
        d["sha256"] = fx.sha256_of(path) if path.exists() else None
        d["bytes"] = path.stat().st_size if path.exists() else None
        rows.append(d)
    if as_json:
        _echo_json(rows)
        return
    from rich.console import Console
    from rich.table import Table

    t = Table(title="fixtures", show_lines=False)
    for col in ("name", "arch", "quant", "MB", "sha256", "description"):
        t.add_column(col, overflow="fold")
    for r in rows:
        mb = f"{r['bytes'] / 1e6:.1f}" if r["bytes"] else "-"
        t.add_row(f"fixture:{r['name']}", r["arch"], r["quant"], mb, r["sha256"] or "(not built)", r["description"])
    Console().print(t)


@fixtures.command("build")
@click.argument("names", nargs=-1)
@click.option("--all", "all_", is_flag=True, help="Build every fixture.")
@click.option("--force", is_flag=True, help="Rebuild even when cached.")
def fixtures_build(names: tuple[str, ...], all_: bool, force: bool) -> None:
    """Build fixtures into the cache and print NAME PATH SHA256."""
    from harness import fixtures as fx

    if not names and not all_:
        raise InvalidInput("name one or more fixtures, or pass --all (see `harness fixtures list`)")
    for name in fx.fixture_names() if all_ else names:
        name = name.removeprefix("fixture:")
        path = fx.build(name, force=force)
        click.echo(f"fixture:{name}  {path}  {fx.sha256_of(path)}")


# -- lint ------------------------------------------------------------------------------------
@cli.command()
@click.argument("model")
@override_option
@click.option("--json", "as_json", is_flag=True, help="Print the findings as JSON.")
def lint(model: str, overrides: tuple[str, ...], as_json: bool) -> None:
    """Static checks of a qwen35/qwen35moe GGUF (exit 0 clean, 1 errors found, 2 unreadable)."""
    from harness.lint import lint_path

    report = lint_path(model, list(overrides))
    if as_json:
        _echo_json(report.to_dict())
    else:
        click.echo(report.render())
    sys.exit(report.exit_code)


def main(argv: list[str] | None = None) -> int:
    """Entry point of the console script; returns the process exit code."""
    try:
        cli.main(args=argv, prog_name="harness", standalone_mode=False)
    except HarnessError as e:
        if os.environ.get("HARNESS_DEBUG"):
            raise
        click.echo(f"harness: {e.verdict.value}: {e}", err=True)
        tail = getattr(e, "stderr_tail", "")
        if tail:
            click.echo("engine stderr (last lines):\n" + tail, err=True)
        return e.exit_code
    except click.exceptions.Abort:
        click.echo("harness: aborted", err=True)
        return 130
    except click.ClickException as e:
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
        click.echo(f"harness: INTERNAL-ERROR: {type(e).__name__}: {msg} (set HARNESS_DEBUG=1 for the traceback)", err=True)
        return INTERNAL_ERROR_EXIT
    return 0


def console_main() -> None:
    """Console-script wrapper: exit with ``main()``'s code."""
    sys.exit(main())


if __name__ == "__main__":
    console_main()
