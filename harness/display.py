"""Showing untrusted text: the one place that escapes strings before a terminal, a rich table, a
Markdown file or a matplotlib label sees them.

Untrusted means anything the harness did not write itself: prompt ids and texts, file and model
names, GGUF metadata and tensor names, engine names, versions and settings (``info.json``),
engine stderr, thresholds bases, ledger rows. Each output kind has its own function:

- ``plain``: for a terminal line (``click.echo``, error messages). C0 controls (ESC, CR, BEL,
  ...), DEL, C1 controls (U+0080–U+009F, which some terminals read as CSI/OSC), and the Unicode
  bidirectional overrides and line separators are shown as ``\\xNN`` / ``\\uNNNN`` escapes, so
  no string can move the cursor, set the title, open a hyperlink (OSC 8) or reorder a line.
- ``lines``: the same for multi-line text (stderr tails, tables), keeping the newlines.
- ``markup``: for rich (tables, progress, ``Console.print``): ``plain`` then
  ``rich.markup.escape``, so ``[link=…]`` or ``[/bold]`` is shown, never interpreted.
- ``mathtext``: for matplotlib titles, labels and legends: ``plain`` with every ``$`` escaped,
  so ``$\\notacommand$`` is text, never parsed as mathtext.
- ``md``: for a Markdown cell or inline text: ``plain`` with ``|``, backslash, backticks,
  brackets and angle brackets backslash-escaped and newlines as spaces, so a value cannot end a
  table cell, open a link or image, or inject HTML.
"""

from __future__ import annotations

import re
from typing import Any

from rich.markup import escape as _rich_escape

_CONTROL = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028\u2029\u202a-\u202e\u2066-\u2069]")
"""C0 controls except tab and newline, DEL, C1 controls, and Unicode bidi/line-separator marks."""
_TAB_NL = re.compile("[\t\n]")
_MD_SPECIAL = re.compile(r"([\\|`\[\]<>])")


def _escape_char(m: re.Match) -> str:
    o = ord(m.group())
    return f"\\x{o:02x}" if o < 0x100 else f"\\u{o:04x}"


def lines(value: Any) -> str:
    """``str(value)`` with control characters escaped (see module docstring); newlines and tabs
    kept. Use for multi-line text: an engine's stderr tail, a rendered table."""
    return _CONTROL.sub(_escape_char, str(value))


def plain(value: Any) -> str:
    """``str(value)`` on one line: every control character escaped, newlines and tabs included."""
    return _TAB_NL.sub(_escape_char, lines(value))


def markup(value: Any) -> str:
    """``plain(value)`` made literal for rich markup (``rich.markup.escape``)."""
    return _rich_escape(plain(value))


def mathtext(value: Any) -> str:
    """``plain(value)`` for a matplotlib text: ``$`` escaped so mathtext never parses it."""
    return plain(value).replace("$", r"\$")


def md(value: Any) -> str:
    """``value`` as literal Markdown inline text / table cell (see module docstring)."""
    text = _MD_SPECIAL.sub(r"\\\1", lines(value))
    return plain(text.replace("\r\n", " ").replace("\n", " "))
