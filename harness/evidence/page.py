"""Pages a person reads: one small document model rendered twice, to Markdown and to static HTML.

A ``Page`` is a list of blocks (headings, paragraphs, tables, images, code blocks, lists) whose
inline content is plain strings or the spans ``Code``, ``Bold`` and ``Link``. Both renderers
escape every plain string and code span for their target (Markdown: the characters that would
become markup, inline HTML included; HTML: ``html.escape``), so an untrusted id, file name or
token text can never become a link, a tag or a table column. ``untrusted`` additionally makes
control and invisible formatting characters visible (``\\x1b``, ``\\u202e``) before any rendering;
it is the one place to swap for the project-wide escaping helper.

The HTML is one self-contained file (inline CSS, no script, no server): it opens from disk.
Markdown follows GitHub's dialect (pipe tables).
"""

from __future__ import annotations

import html
import os
import re
import unicodedata
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Sequence, Union

# ----------------------------------------------------------------------------- escaping


def untrusted(value: Any) -> str:
    """``value`` as a single line of text safe to show anywhere: control characters, invisible
    format characters (bidi overrides, zero-width), surrogates and line or paragraph separators
    written as Python escapes (``\\n``, ``\\x1b``, ``\\u202e``); everything else kept as is.

    Markup escaping is the renderer's job; this only makes the text visible and one line.
    """
    s = str(value)
    out = []
    for ch in s:
        cat = unicodedata.category(ch)
        if cat in ("Cc", "Cf", "Cs", "Co", "Cn", "Zl", "Zp"):
            code = ord(ch)
            named = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}.get(ch)
            out.append(named or (f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}"))
        else:
            out.append(ch)
    return "".join(out)


_MD_SPECIAL = re.compile(r"([\\`*_\[\]#|~])")


def md_escape(text: str) -> str:
    """Markdown-escape plain text: markup characters backslash-escaped, ``<``, ``>`` and ``&``
    as HTML entities (so no inline HTML survives), one line."""
    s = untrusted(text)
    s = s.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
    return _MD_SPECIAL.sub(r"\\\1", s)


def _md_code(text: str, in_table: bool) -> str:
    s = untrusted(text)
    run = max((len(m) for m in re.findall(r"`+", s)), default=0)
    fence = "`" * (run + 1)
    pad = " " if s.startswith("`") or s.endswith("`") or not s.strip() else ""
    if in_table:
        s = s.replace("|", "\\|")  # GFM: a pipe in a table cell is escaped even inside code
    return f"{fence}{pad}{s}{pad}{fence}"


# ----------------------------------------------------------------------------- inline spans


@dataclass(frozen=True)
class Code:
    """Inline code (commands, tensor names, hashes)."""

    text: str


@dataclass(frozen=True)
class Bold:
    """Strong emphasis around inline content."""

    content: "Inline"


@dataclass(frozen=True)
class Badge:
    """A verdict word (PASS, FAIL, UNMEASURED ...): bold in Markdown, a coloured label in HTML."""

    text: str


@dataclass(frozen=True)
class Link:
    """A relative link to a file the page's directory can reach (``href`` relative to the page),
    or to another rendering of it: ``alt_href`` is used in the HTML rendering when given (e.g.
    ``report.html`` for ``report.md``)."""

    content: "Inline"
    href: str
    alt_href: str | None = None


Inline = Union[str, Code, Bold, Badge, Link, Sequence["Inline"], None]


def _inline_md(x: Inline, in_table: bool = False) -> str:
    if x is None:
        return ""
    if isinstance(x, str):
        return md_escape(x)
    if isinstance(x, Code):
        return _md_code(x.text, in_table)
    if isinstance(x, Bold):
        return f"**{_inline_md(x.content, in_table)}**"
    if isinstance(x, Badge):
        return f"**{md_escape(x.text)}**"
    if isinstance(x, Link):
        href = x.href.replace(" ", "%20").replace("(", "%28").replace(")", "%29")
        return f"[{_inline_md(x.content, in_table)}]({href})"
    return "".join(_inline_md(y, in_table) for y in x)


def _inline_html(x: Inline) -> str:
    if x is None:
        return ""
    if isinstance(x, str):
        return html.escape(untrusted(x))
    if isinstance(x, Code):
        return f"<code>{html.escape(untrusted(x.text))}</code>"
    if isinstance(x, Bold):
        return f"<strong>{_inline_html(x.content)}</strong>"
    if isinstance(x, Badge):
        cls = re.sub(r"[^A-Za-z-]", "", x.text)
        return f'<span class="badge b-{cls}">{html.escape(untrusted(x.text))}</span>'
    if isinstance(x, Link):
        return f'<a href="{html.escape(x.alt_href or x.href, quote=True)}">{_inline_html(x.content)}</a>'
    return "".join(_inline_html(y) for y in x)


def links_of(x: Inline) -> list[Link]:
    """Every ``Link`` inside inline content."""
    if isinstance(x, Link):
        return [x] + links_of(x.content)
    if isinstance(x, Bold):
        return links_of(x.content)
    if isinstance(x, (list, tuple)):
        return [lk for y in x for lk in links_of(y)]
    return []


# ----------------------------------------------------------------------------- blocks


@dataclass
class Page:
    """A document: ``title`` plus blocks added in reading order. ``css_class`` tags the HTML body
    (``verdict-PASS`` etc.) so the verdict colour shows at a glance."""

    title: str
    css_class: str = ""
    blocks: list[tuple[str, Any]] = field(default_factory=list)

    def h(self, level: int, content: Inline) -> "Page":
        """A heading of ``level`` 1–4."""
        self.blocks.append(("h", (level, content)))
        return self

    def p(self, *content: Inline) -> "Page":
        """A paragraph of inline content."""
        self.blocks.append(("p", list(content)))
        return self

    def note(self, *content: Inline) -> "Page":
        """A paragraph set off as a remark (blockquote in Markdown, muted in HTML)."""
        self.blocks.append(("note", list(content)))
        return self

    def table(self, header: Sequence[Inline], rows: Iterable[Sequence[Inline]], align: str | None = None) -> "Page":
        """A table; ``align`` is one letter per column (``l`` left, ``r`` right, ``c`` centre,
        ``n`` left without wrapping), default all left."""
        rows = [list(r) for r in rows]
        for r in rows:
            if len(r) != len(header):
                raise ValueError(f"table row has {len(r)} cells for {len(header)} columns")
        self.blocks.append(("table", (list(header), rows, align or "l" * len(header))))
        return self

    def fields(self, rows: Iterable[tuple[Inline, Inline]]) -> "Page":
        """A two-column key/value table without a visible header."""
        self.blocks.append(("fields", [tuple(r) for r in rows]))
        return self

    def image(self, src: str, alt: str) -> "Page":
        """An image file beside the page (relative path)."""
        self.blocks.append(("img", (src, alt)))
        return self

    def code(self, text: str) -> "Page":
        """A block of commands or literal text, one item per line."""
        self.blocks.append(("code", text))
        return self

    def bullets(self, items: Iterable[Inline]) -> "Page":
        """An unordered list."""
        self.blocks.append(("ul", list(items)))
        return self

    # -------------------------------------------------------------- queries

    def links(self, html: bool = False) -> list[str]:
        """Every link target and image source of the page: the Markdown rendering's, or with
        ``html`` the HTML rendering's (``Link.alt_href`` where given)."""
        out: list[str] = []

        def walk(x: Inline) -> None:
            out.extend((lk.alt_href or lk.href) if html else lk.href for lk in links_of(x))

        for kind, b in self.blocks:
            if kind == "img":
                out.append(b[0])
            elif kind == "table":
                for cell in b[0] + [c for r in b[1] for c in r]:
                    walk(cell)
            elif kind == "fields":
                for kv in b:
                    walk(list(kv))
            elif kind == "h":
                walk(b[1])
            elif kind in ("p", "note", "ul"):
                walk(b)
        return out

    # -------------------------------------------------------------- renderers

    def to_markdown(self) -> str:
        """GitHub-flavoured Markdown."""
        out: list[str] = []
        for kind, b in self.blocks:
            if kind == "h":
                out.append("#" * b[0] + " " + _inline_md(b[1]))
            elif kind == "p":
                out.append(_inline_md(b))
            elif kind == "note":
                out.append("> " + _inline_md(b))
            elif kind == "table":
                header, rows, align = b
                out.append("| " + " | ".join(_inline_md(c, True) for c in header) + " |")
                out.append("|" + "|".join({"l": "---", "n": "---", "r": "---:", "c": ":---:"}[a] for a in align) + "|")
                out += ["| " + " | ".join(_inline_md(c, True) or " " for c in r) + " |" for r in rows]
            elif kind == "fields":
                out.append("| | |")
                out.append("|---|---|")
                out += [f"| {_inline_md(k, True)} | {_inline_md(v, True) or ' '} |" for k, v in b]
            elif kind == "img":
                out.append(f"![{md_escape(b[1])}]({b[0]})")
            elif kind == "code":
                fence = "```" if "```" not in b else "~~~~"
                out.append(f"{fence}\n{untrusted_lines(b)}\n{fence}")
            elif kind == "ul":
                out.append("\n".join("- " + _inline_md(i) for i in b))
            out.append("")
        return "\n".join(out).rstrip("\n") + "\n"

    def to_html(self) -> str:
        """One self-contained HTML5 document (inline CSS, no script)."""
        body: list[str] = []
        for kind, b in self.blocks:
            if kind == "h":
                body.append(f"<h{b[0]}>{_inline_html(b[1])}</h{b[0]}>")
            elif kind == "p":
                body.append(f"<p>{_inline_html(b)}</p>")
            elif kind == "note":
                body.append(f'<p class="note">{_inline_html(b)}</p>')
            elif kind == "table":
                header, rows, align = b
                cls = {"l": "", "r": ' class="num"', "c": ' class="mid"', "n": ' class="nowrap"'}
                th = "".join(f"<th{cls[a]}>{_inline_html(c)}</th>" for c, a in zip(header, align))
                trs = "".join("<tr>" + "".join(f"<td{cls[a]}>{_inline_html(c)}</td>" for c, a in zip(r, align)) + "</tr>\n" for r in rows)
                body.append(f"<table>\n<thead><tr>{th}</tr></thead>\n<tbody>\n{trs}</tbody>\n</table>")
            elif kind == "fields":
                trs = "".join(f"<tr><th>{_inline_html(k)}</th><td>{_inline_html(v)}</td></tr>\n" for k, v in b)
                body.append(f'<table class="fields">\n<tbody>\n{trs}</tbody>\n</table>')
            elif kind == "img":
                src = html.escape(b[0], quote=True)
                body.append(f'<p><a href="{src}"><img src="{src}" alt="{html.escape(untrusted(b[1]), quote=True)}"></a></p>')
            elif kind == "code":
                body.append(f"<pre><code>{html.escape(untrusted_lines(b))}</code></pre>")
            elif kind == "ul":
                body.append("<ul>\n" + "".join(f"<li>{_inline_html(i)}</li>\n" for i in b) + "</ul>")
        return (
            "<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n"
            '<meta name="viewport" content="width=device-width, initial-scale=1">\n'
            f"<title>{html.escape(untrusted(self.title))}</title>\n<style>{_CSS}</style>\n</head>\n"
            f'<body class="{html.escape(self.css_class, quote=True)}">\n<main>\n' + "\n".join(body) + "\n</main>\n</body>\n</html>\n"
        )

    def write(self, md_path: str | Path, html_path: str | Path | None = None) -> tuple[Path, Path | None]:
        """Write the Markdown (and HTML) renderings atomically; return their paths."""
        md_path = Path(md_path)
        write_text_atomic(md_path, self.to_markdown())
        hp = None
        if html_path is not None:
            hp = Path(html_path)
            write_text_atomic(hp, self.to_html())
        return md_path, hp


def untrusted_lines(text: str) -> str:
    """``untrusted`` applied line by line (a code block keeps its line breaks)."""
    return "\n".join(untrusted(line) for line in str(text).split("\n"))


def write_text_atomic(path: Path, text: str) -> None:
    """Write ``text`` (UTF-8) to a temporary file beside ``path`` and rename it over ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


_CSS = """
body{font:15px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;color:#1b1f24;background:#fff;margin:0}
main{max-width:1180px;margin:0 auto;padding:18px 28px 40px}
h1{font-size:1.55em;margin:.2em 0 .5em;padding:.35em .6em;border-left:8px solid #8c959f;background:#f6f8fa}
body.verdict-PASS h1{border-color:#1a7f37} body.verdict-FAIL h1{border-color:#cf222e}
body.verdict-UNMEASURED h1{border-color:#9a6700}
h2{font-size:1.2em;margin:1.4em 0 .5em;border-bottom:1px solid #d0d7de;padding-bottom:.2em}
h3{font-size:1.05em;margin:1.1em 0 .4em}
table{border-collapse:collapse;margin:.4em 0 1em;font-size:.93em}
th,td{border:1px solid #d0d7de;padding:4px 9px;text-align:left;vertical-align:top}
thead th{background:#f6f8fa}
table.fields th{background:#f6f8fa;white-space:nowrap;font-weight:600}
td.num,th.num{text-align:right;font-variant-numeric:tabular-nums} td.mid,th.mid{text-align:center}
code{font:.9em/1.3 ui-monospace,SFMono-Regular,Menlo,Consolas,monospace;background:#f6f8fa;padding:1px 4px;border-radius:4px;overflow-wrap:anywhere}
pre{background:#f6f8fa;border:1px solid #d0d7de;border-radius:6px;padding:10px 12px;overflow-x:auto}
pre code{background:none;padding:0;white-space:pre}
img{max-width:100%;border:1px solid #d0d7de}
p.note{color:#57606a;border-left:3px solid #d0d7de;padding-left:10px}
a{color:#0969da}
td.nowrap{white-space:nowrap}
.badge{display:inline-block;padding:0 7px;border-radius:10px;font-weight:700;font-size:.9em;color:#fff;background:#6e7781}
.b-PASS{background:#1a7f37} .b-FAIL,.b-FAILED{background:#cf222e} .b-UNMEASURED{background:#9a6700}
.b-ENGINE-ERROR,.b-NOT-COMPARABLE,.b-INVALID{background:#8250df}
"""
