"""What a re-calibration moved: two thresholds files compared row by row and gate by gate
(``harness thresholds diff``; docs/gates.md, "Reviewing a re-calibration").

A row is matched across the two files by what it is for, never by its position (a re-calibration
that adds rows renumbers the ones after them): its section (``calibrated``, ``topk``, ``mtp``,
``state``), weights key, compute class, the architectures of its basis models and, for a top-k
row, its ``k``. The top-level tables (``release``, ``probes``, ``report_only``) are one row each.
Every gate of a matched row (its ``gates`` and its own ``probes``, and ``max_tokens``) is compared:

- a cosine bound by ``1 − value``, the distance from a perfect match that it allows (0.9999 →
  0.9998 doubles what a cell may be off: a change of 100 %);
- every other bound (KLD, NMSE, counts, shares) by its value.

``change`` is ``|new − old| / |old|`` on that scale (infinite where ``old`` is 0 and ``new`` is
not). A row found in one file only is ``added`` or ``removed``. Each moved gate carries the new
row's basis (its command and date, and its known-good floor before and after), which says which
calibration measured it; the cause is for the reviewer to state.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Mapping

from harness.evidence.engines_page import ROW_SECTIONS
from harness.judge.thresholds import Thresholds

TABLES = ("release", "probes", "report_only")
"""The top-level tables: one row each."""


def _archs(row: Mapping[str, Any]) -> str:
    return ",".join(sorted({str(m.get("arch")) for m in row.get("basis_models") or [] if m.get("arch")})) or "any"


def row_key(section: str, row: Mapping[str, Any]) -> tuple[str, ...]:
    """What identifies a row across files: (section, weights, class, archs, k) for a row section,
    (section,) for a top-level table."""
    if section in TABLES:
        return (section,)
    k = row.get("k")
    return (section, str(row.get("weights")), str(row.get("class")), _archs(row)) + ((f"k={k}",) if k is not None else ())


def key_text(key: tuple[str, ...]) -> str:
    """``calibrated F32 x f32 (qwen35)``, ``topk F32 x f64 (qwen35moe) k=20``, ``release``."""
    if len(key) == 1:
        return key[0]
    section, weights, cls, archs, *k = key
    return f"{section} {weights} x {cls} ({archs})" + "".join(f" {x}" for x in k)


def _gates(row: Mapping[str, Any], section: str) -> dict[str, tuple[Any, Mapping[str, Any]]]:
    """``{gate: (value, basis)}`` of one row: its ``gates``, its own ``probes`` (``probes.NAME``) and
    ``max_tokens``; a top-level table's entries by name."""
    if section in TABLES:
        return {name: ((g or {}).get("value"), (g or {}).get("basis") or {}) if isinstance(g, Mapping) else (g, {})
                for name, g in row.items()}
    out: dict[str, tuple[Any, Mapping[str, Any]]] = {}
    for part, prefix in (("gates", ""), ("probes", "probes.")):
        for name, g in (row.get(part) or {}).items():
            out[prefix + name] = ((g or {}).get("value"), (g or {}).get("basis") or {})
    if row.get("max_tokens") is not None:
        out["max_tokens"] = (row["max_tokens"], {})
    return out


def relative_change(gate: str, old: Any, new: Any) -> float:
    """The module docstring's ``change``: on ``1 − value`` for a cosine bound, else on the value.
    0.0 when equal; ``inf`` from 0 to anything else, or when either is not a number."""
    if old == new:
        return 0.0
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (old, new)):
        return math.inf
    a, b = (1.0 - old, 1.0 - new) if "cosine" in gate else (float(old), float(new))
    return math.inf if a == 0 else abs(b - a) / abs(a)


@dataclass(frozen=True)
class GateMove:
    """One gate whose value differs: the row (``key``, its label in each file: ``calibrated[3]``),
    the gate, both values, ``change`` (``relative_change``) and the new value's basis: ``command``,
    ``date`` and the known-good floor before and after (None where the basis has none)."""

    key: tuple[str, ...]
    old_label: str
    new_label: str
    gate: str
    old: Any
    new: Any
    change: float
    command: str | None = None
    date: str | None = None
    floor_old: Any = None
    floor_new: Any = None

    def to_dict(self) -> dict[str, Any]:
        """The JSON form (``--json``); an infinite change is ``null``."""
        d = {k: v for k, v in vars(self).items() if k != "key"}
        d["row"] = key_text(self.key)
        d["change"] = None if math.isinf(self.change) else self.change
        return d


@dataclass
class ThresholdsDiff:
    """The comparison of two files: gates that moved (all of them, largest change first), and the
    rows only one file has (``key_text`` with their label)."""

    moved: list[GateMove] = field(default_factory=list)
    added: list[str] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)
    rows_compared: int = 0

    def past(self, min_change: float) -> list[GateMove]:
        """The moves whose ``change`` is above ``min_change`` (0.10: more than 10 %)."""
        return [m for m in self.moved if m.change > min_change]


def _labelled(data: Mapping[str, Any]) -> dict[tuple[str, ...], tuple[str, Mapping[str, Any]]]:
    out: dict[tuple[str, ...], tuple[str, Mapping[str, Any]]] = {}
    for section in TABLES:
        if isinstance(data.get(section), Mapping):
            out[(section,)] = (section, data[section])
    for section in ROW_SECTIONS:
        for i, row in enumerate(data.get(section) or []):
            out.setdefault(row_key(section, row), (f"{section}[{i}]", row))
    return out


def diff_thresholds(old: Thresholds, new: Thresholds) -> ThresholdsDiff:
    """Compare two loaded thresholds files (``load_thresholds``; module docstring). Rows are
    matched by ``row_key``; the first row of a key counts where a file has two."""
    a, b = _labelled(old.data), _labelled(new.data)
    out = ThresholdsDiff(added=[f"{key_text(k)} ({b[k][0]})" for k in b if k not in a],
                         removed=[f"{key_text(k)} ({a[k][0]})" for k in a if k not in b])
    for key in (k for k in b if k in a):
        out.rows_compared += 1
        (la, ra), (lb, rb) = a[key], b[key]
        ga, gb = _gates(ra, key[0]), _gates(rb, key[0])
        for gate in [*ga, *(g for g in gb if g not in ga)]:
            (va, basis_a), (vb, basis_b) = ga.get(gate, (None, {})), gb.get(gate, (None, {}))
            if va == vb:
                continue
            out.moved.append(GateMove(key, la, lb, gate, va, vb, relative_change(gate, va, vb), basis_b.get("command"),
                                      None if basis_b.get("date") is None else str(basis_b.get("date")),
                                      basis_a.get("known_good_floor"), basis_b.get("known_good_floor")))
    out.moved.sort(key=lambda m: -m.change)
    return out
