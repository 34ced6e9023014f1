"""The ``harness`` click group, its context settings and the options several commands share."""

from __future__ import annotations

import click


INTERNAL_ERROR_EXIT = 70  # EX_SOFTWARE: a bug in the harness, not a verdict


CONTEXT = {"help_option_names": ["-h", "--help"], "max_content_width": 100}


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
