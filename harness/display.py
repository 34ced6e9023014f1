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
- ``md_text``: for a Markdown cell or inline text: ``plain`` with ``|``, backslash, backticks,
  brackets and angle brackets backslash-escaped and newlines as spaces, so a value cannot end a
  table cell, open a link or image, or inject HTML.
"""

from __future__ import annotations

import re
from typing import Any

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
