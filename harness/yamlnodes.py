"""Bounded, line-aware reading of YAML node trees (``yaml.compose`` output), shared by every
YAML file the harness reads (thresholds.yaml, contracts): refuse alias bombs (many nodes, or
aliases to large scalars), recursive aliases and deep nesting before any walk of the data, and
find the line of a field for error messages.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import yaml

from harness.errors import InvalidInput

SAFE_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
"""libyaml's safe loader when PyYAML was built with it (about 5x faster), else the pure-Python
one; the same documents give the same data."""

MAX_YAML_NODES = 100_000
MAX_YAML_DEPTH = 64
MAX_ALIAS_CHARS = 1 << 20
"""Characters aliases may add to a document beyond its own text (1 Mi): sharing a basis between
gates adds a few KB; ten thousand aliases of a 10 KB string add 100 MB to every receipt."""


def check_size(path: Path, root: yaml.Node) -> None:
    """Refuse a document whose aliases form a cycle or expand it past ``MAX_YAML_NODES`` nodes
    or past its own length plus ``MAX_ALIAS_CHARS`` characters of scalars, or that nests deeper
    than ``MAX_YAML_DEPTH`` (a thresholds file has a few hundred nodes, eight levels deep), so
    every later walk of the data, and every receipt that copies it, is bounded by the file. One
    iterative pass over the node tree as the aliases expand it, stopping at the first limit."""
    max_chars = max(0, root.end_mark.index - root.start_mark.index) + MAX_ALIAS_CHARS
    count, chars, on_path = 0, 0, set()
    stack: list[tuple[yaml.Node, int, bool]] = [(root, 1, False)]
    while stack:
        node, depth, leaving = stack.pop()
        if leaving:
            on_path.discard(id(node))
            continue
        count += 1
        where = f"{path}:{node.start_mark.line + 1}"
        if id(node) in on_path:
            raise InvalidInput(f"{where}: recursive YAML alias (a node that contains itself)")
        if count > MAX_YAML_NODES:
            raise InvalidInput(f"{where}: YAML expands to more than {MAX_YAML_NODES:,} nodes through aliases")
        if depth > MAX_YAML_DEPTH:
            raise InvalidInput(f"{where}: YAML nested more than {MAX_YAML_DEPTH} levels deep")
        if isinstance(node, yaml.MappingNode):
            children = [n for kv in node.value for n in kv]
        elif isinstance(node, yaml.SequenceNode):
            children = list(node.value)
        else:
            chars += len(node.value)
            if chars > max_chars:
                raise InvalidInput(f"{where}: YAML expands to more than {max_chars:,} characters through aliases "
                                   f"(at most {MAX_ALIAS_CHARS:,} beyond the file's own text)")
            continue
        on_path.add(id(node))
        stack.append((node, depth, True))
        stack.extend((c, depth + 1, False) for c in children)


def load_bounded(path: Path, text: str, what: str) -> tuple[yaml.Node | None, Any]:
    """``(root node, data)`` of a YAML document, composed once (by libyaml when present), bounded
    by ``check_size`` before anything walks it, and constructed from that node tree as
    ``yaml.safe_load`` would construct it, without parsing the text a second time. ``(None, None)``
    for an empty document.

    Raises ``yaml.YAMLError`` for invalid YAML and ``InvalidInput`` for a document too large or
    nested too deeply (``what`` names the kind of file in that message, e.g. "a contract"; both
    the pure-Python composer's recursion and libyaml's own 1,000-level bound end there)."""
    deep = f"{path}: YAML nested too deeply ({what} is a few levels deep)"
    loader = SAFE_LOADER(text)
    try:
        try:
            root = loader.get_single_node()
        except RecursionError:
            raise InvalidInput(deep) from None
        except yaml.YAMLError as e:
            if "exceeded maximum nesting depth" in str(getattr(e, "problem", "") or ""):
                raise InvalidInput(deep) from None
            raise
        if root is None:
            return None, None
        check_size(path, root)
        return root, loader.construct_document(root)
    finally:
        loader.dispose()


def safe_load_shipped(text: str) -> Any:
    """``yaml.safe_load`` through ``SAFE_LOADER`` (libyaml when present), for files the harness
    ships (its own contracts); a user's file goes through ``load_bounded``."""
    loader = SAFE_LOADER(text)
    try:
        return loader.get_single_data()
    finally:
        loader.dispose()


def line_of(root: yaml.Node | None, keys: Sequence[Any]) -> int:
    """1-based line of the node at ``keys`` (a mapping key's own line), or of its deepest
    existing ancestor."""
    node, line = root, 1
    for key in keys:
        if node is None:
            break
        line = node.start_mark.line + 1
        nxt = None
        if isinstance(node, yaml.MappingNode):
            for k, v in node.value:
                if k.value == str(key):
                    nxt, line = v, k.start_mark.line + 1
                    break
        elif isinstance(node, yaml.SequenceNode) and isinstance(key, int) and key < len(node.value):
            nxt = node.value[key]
            line = nxt.start_mark.line + 1
        node = nxt
    return line


def duplicate_keys(root: yaml.Node | None) -> list[tuple[list[Any], int, int]]:
    """Every repeated mapping key in the node tree (``yaml.safe_load`` silently keeps the last
    one): ``(keys, line, first_line)`` with ``keys`` the path to the repeated key (sequence
    indices as ints), ``line`` its 1-based line and ``first_line`` the line of its first
    occurrence, in document order. Iterative; bounded by ``check_size`` run before it."""
    out: list[tuple[list[Any], int, int]] = []
    stack: list[tuple[yaml.Node, list[Any]]] = [(root, [])] if root is not None else []
    while stack:
        node, keys = stack.pop()
        children: list[tuple[yaml.Node, list[Any]]] = []
        if isinstance(node, yaml.MappingNode):
            seen: dict[Any, int] = {}
            for k, v in node.value:
                line = k.start_mark.line + 1
                if k.value in seen:
                    out.append((keys + [k.value], line, seen[k.value]))
                else:
                    seen[k.value] = line
                children.append((v, keys + [k.value]))
        elif isinstance(node, yaml.SequenceNode):
            children = [(v, keys + [i]) for i, v in enumerate(node.value)]
        stack.extend(children)
    return sorted(out, key=lambda d: d[1])
