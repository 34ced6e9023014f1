"""Showing untrusted text: the one place that escapes strings before a terminal, a rich table, a
Markdown file or a matplotlib label sees them.

Untrusted means anything the harness did not write itself: prompt ids and texts, file and model
names, GGUF metadata and tensor names, engine names, versions and settings (``info.json``),
engine stderr, thresholds bases, ledger rows. Each output kind has its own function:

- ``plain``: for a terminal line (``click.echo``, error messages, reproducer lines). Every
  character Python does not call printable (``str.isprintable``: C0 and C1 controls such as ESC,
  CR, BEL and CSI, DEL, the Unicode format characters such as bidirectional overrides, line and
  paragraph separators, lone surrogates, unassigned code points) is shown as a ``\\xNN``,
  ``\\uNNNN`` or ``\\UNNNNNNNN`` escape, so no string can move the cursor, set the title, open a
  hyperlink (OSC 8), reorder a line, or fail to encode.
- ``lines``: the same for multi-line text (stderr tails, tables), keeping newlines and tabs.
- ``markup``: for rich (tables, progress, ``Console.print``): ``plain`` then
  ``rich.markup.escape``, so ``[link=…]`` or ``[/bold]`` is shown, never interpreted.
- ``mathtext``: for matplotlib titles, labels and legends: ``plain`` with every ``$`` escaped,
  so ``$\\notacommand$`` is text, never parsed as mathtext.
- ``print_table``: a rich table of literal cells whose names, ids and numbers are never wrapped or
  cut (a list where the console is too narrow for them).
- ``md_text``: for a Markdown cell or inline text: ``plain`` with ``|``, backslash, backticks,
  brackets and angle brackets backslash-escaped and newlines as spaces, so a value cannot end a
  table cell, open a link or image, or inject HTML.
"""

from __future__ import annotations

import re
from typing import Any, Iterable, Mapping, Sequence

from rich.markup import escape as _rich_escape

_MD_SPECIAL = re.compile(r"([\\|`\[\]<>])")


def _escape(c: str) -> str:
    o = ord(c)
    return f"\\x{o:02x}" if o < 0x100 else f"\\u{o:04x}" if o < 0x10000 else f"\\U{o:08x}"


def lines(value: Any) -> str:
    """``str(value)`` with every non-printable character escaped (see module docstring) except
    newlines and tabs. Use for multi-line text: an engine's stderr tail, a rendered table."""
    text = str(value)
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() or c in "\n\t" else _escape(c) for c in text)


def plain(value: Any) -> str:
    """``str(value)`` on one line: every non-printable character escaped, newlines and tabs too."""
    text = str(value)
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else _escape(c) for c in text)


def markup(value: Any) -> str:
    """``plain(value)`` made literal for rich markup (``rich.markup.escape``)."""
    return _rich_escape(plain(value))


def mathtext(value: Any) -> str:
    """``plain(value)`` for a matplotlib text: ``$`` escaped so mathtext never parses it."""
    return plain(value).replace("$", r"\$")


def md_text(value: Any) -> str:
    """``value`` as literal Markdown inline text / table cell (see module docstring)."""
    text = _MD_SPECIAL.sub(r"\\\1", lines(value))
    return plain(text.replace("\n", " "))


TABLE_MIN_FOLD = 12
"""A table whose whole columns leave less than this many characters to each folding column (or
that is wider than the console with no folding column) is printed as a list instead."""


def _table_overhead(style: Mapping[str, Any], n: int) -> int:
    """Characters a rich ``Table(**style)`` of ``n`` columns adds to its cells (rules, padding),
    measured by rendering one row of one-character cells."""
    import io

    from rich.cells import cell_len
    from rich.console import Console
    from rich.table import Table

    t = Table(**style)
    for _ in range(n):
        t.add_column(width=1, no_wrap=True)
    t.add_row(*("x" * n))
    con = Console(file=io.StringIO(), width=10_000, emoji=False, color_system=None)
    con.print(t)
    return max(cell_len(line) for line in con.file.getvalue().splitlines()) - n


def print_table(console: Any, title: str, columns: Sequence[str], rows: Iterable[Sequence[Any]], *, fold: Iterable[str] = (),
                right: Iterable[str] = (), keys: int = 1, styles: Mapping[str, str] | None = None, compact: bool = False) -> bool:
    """Print ``rows`` under ``columns`` on the rich ``console`` (at ``console.width`` characters),
    every cell and the title shown literally (``plain``, rich ``Text``: no markup interpreted).

    Columns named in ``fold`` hold free text (details, messages) and fold onto more lines; every
    other column (names, ids, numbers, commands: what people copy) is never wrapped, cut or
    shortened with "…": it is exactly as wide as its longest value. ``right`` names columns
    justified right (numbers); ``styles`` maps a cell value to a rich style (``FAIL`` → red).
    When the whole columns leave less than ``TABLE_MIN_FOLD`` characters to each folding column
    (or exceed the width when nothing folds), the rows are printed as a list instead: each row's
    first ``keys`` values on one line, then one ``column: value`` line per other column, none of
    them wrapped or cropped. ``compact``: no outer edge, a rule under the header only, the title on the
    left (``ledger show``). Returns True when a table was printed, False for a list."""
    from rich import box
    from rich.cells import cell_len
    from rich.table import Table
    from rich.text import Text

    style = (dict(title_justify="left", title_style="bold", box=box.SIMPLE_HEAD, pad_edge=False, show_edge=False, collapse_padding=True)
             if compact else {})

    fold, right = set(fold), set(right)
    rows = [[plain("" if v is None else v) for v in r] for r in rows]
    # a header may fold at its spaces ("tok/s (vs median)"); a cell never
    natural = [max([*(cell_len(w) for w in plain(c).split()), 1, *(cell_len(r[i]) for r in rows)]) for i, c in enumerate(columns)]
    whole = sum(w for c, w in zip(columns, natural) if c not in fold)
    n_fold = sum(c in fold for c in columns)
    room = console.width - whole - _table_overhead(style, len(columns))
    if room < 0 or (n_fold and room < TABLE_MIN_FOLD * n_fold):
        console.print(Text(plain(title)))  # a title folds at its spaces, as above a table
        for r in rows:
            console.print(Text("  ".join(r[:keys])), soft_wrap=True)
            for c, v in zip(columns[keys:], r[keys:]):
                console.print(Text(f"    {plain(c)}: {v}"), soft_wrap=True)
        return False
    t = Table(title=Text(plain(title)), **style)
    for c, w in zip(columns, natural):
        justify = "right" if c in right else "left"
        if c in fold:
            t.add_column(Text(plain(c)), overflow="fold", justify=justify)
        else:
            t.add_column(Text(plain(c), overflow="fold"), width=w, justify=justify)
    for r in rows:
        t.add_row(*(Text(v, style=(styles or {}).get(v, ""), no_wrap=c not in fold) for c, v in zip(columns, r)))
    console.print(t)
    return True
