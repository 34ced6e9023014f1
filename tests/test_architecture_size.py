"""Functions a reader can hold: none in ``harness/`` is over ``MAX_LINES`` lines unless its
docstring says why, in a sentence starting "Long because".

A function's length is its whole ``def`` statement, from the ``def`` line to its last line
(docstring, comments and nested functions included), as ``ast`` reports it; methods and nested
functions are functions too.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAX_LINES = 60
REASON = re.compile(r"Long because \S[^.]*\S\.")


def long_functions(source: str, max_lines: int = MAX_LINES) -> list[tuple[str, int, int, bool]]:
    """``(name, first line, length, has a stated reason)`` of every function of ``source`` longer
    than ``max_lines`` lines."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            length = node.end_lineno - node.lineno + 1
            if length > max_lines:
                out.append((node.name, node.lineno, length, bool(REASON.search(ast.get_docstring(node) or ""))))
    return out


def _function(lines: int, doc: str) -> str:
    body = [f'    """{doc}"""'] + [f"    x{i} = {i}" for i in range(lines - 2)]
    return "\n".join(["def f():", *body]) + "\n"


def test_the_rule_on_examples():
    assert _function(61, "").count("\n") == 61
    assert long_functions(_function(60, "")) == []
    assert long_functions(_function(61, "Does f.")) == [("f", 1, 61, False)]
    assert long_functions(_function(61, "Does f. Long because the steps share every local.")) == [("f", 1, 61, True)]
    assert long_functions(_function(61, "Long because.")) == [("f", 1, 61, False)]  # a reason, not the words alone


def test_no_function_over_60_lines_without_a_reason():
    sources = {p.relative_to(ROOT).as_posix(): p.read_text(encoding="utf-8") for p in sorted((ROOT / "harness").rglob("*.py"))}
    n_functions = sum(isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) for s in sources.values() for n in ast.walk(ast.parse(s)))
    assert n_functions > 300, f"only {n_functions} functions found under harness/: is the scan reading the package?"
    found = {f: long_functions(s) for f, s in sources.items()}
    unexplained = [f"{f}:{line} {name} ({n} lines)" for f, fs in found.items() for name, line, n, ok in fs if not ok]
    assert not unexplained, (
        f"functions over {MAX_LINES} lines without a 'Long because ...' sentence in their docstring: "
        + "; ".join(unexplained) + ". Split them into named steps, or state the reason."
    )
