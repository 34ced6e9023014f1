"""The import paths of release 0.1's ``harness.compare`` and ``harness.gates``, kept for one release.

Release 0.2 laid the package out by layer (docs/design.md, "Layout"): pure measurement in
``harness.measure``, pure judgement in ``harness.judge``, the runs that drive engines in
``harness.runs``. An old path such as ``harness.compare.metrics`` or ``harness.gates.thresholds``
still imports, as the very module object of its new home (so ``isinstance`` checks and monkeypatches
agree), with a ``DeprecationWarning`` naming the new path. ``MOVED`` is the whole table;
docs/changes.md says the same in words. The finder is installed by ``harness/__init__.py`` and
answers only for the names in ``MOVED``.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import types
import warnings

MOVED: dict[str, str] = {
    "harness.compare": "harness.runs",
    "harness.compare.metrics": "harness.measure.metrics",
    "harness.compare.near_ties": "harness.measure.near_ties",
    "harness.compare.prompts": "harness.measure.prompts",
    "harness.compare.topk": "harness.measure.topk",
    "harness.compare.verdicts": "harness.judge.verdicts",
    "harness.compare.calibrated": "harness.judge.calibrated",
    "harness.compare.causes": "harness.judge.causes",
    "harness.compare.reproducer": "harness.judge.reproducer",
    "harness.compare.inputs": "harness.runs.inputs",
    "harness.compare.parity": "harness.runs.parity",
    "harness.compare.probes": "harness.runs.probes",
    "harness.compare.localize": "harness.runs.localize",
    "harness.compare.greedy": "harness.runs.greedy",
    "harness.compare.explain": "harness.runs.explain",
    "harness.gates": "harness.judge",
    "harness.gates.thresholds": "harness.judge.thresholds",
    "harness.gates.tiers": "harness.judge.tiers",
    "harness.gates.calibrate": "harness.runs.calibrate",
    "harness.gates.subject": "harness.runs.subject",
}
"""Old module path → where the module lives now. ``harness.compare.topk``'s top-k tier
(``judge_topk``, ``overall_topk``, ``release_not_computable``) moved on to ``harness.judge.topk``
and ``measure_topk_prompts`` to ``harness.runs.topk``; the old path gives the metrics."""


class _Alias(importlib.abc.Loader):
    def __init__(self, new: str) -> None:
        self.new = new

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        warnings.warn(f"{spec.name} moved to {self.new} (docs/changes.md); the old path goes in the next release",
                      DeprecationWarning, stacklevel=2)
        return importlib.import_module(self.new)

    def exec_module(self, module: types.ModuleType) -> None:  # already executed under its new name
        pass


class MovedFinder(importlib.abc.MetaPathFinder):
    """Finds the old paths of ``MOVED`` and loads the new module under them."""

    def find_spec(self, fullname: str, path: object = None, target: object = None) -> importlib.machinery.ModuleSpec | None:
        new = MOVED.get(fullname)
        if new is None:
            return None
        return importlib.util.spec_from_loader(fullname, _Alias(new), is_package=fullname.count(".") == 1)


def install() -> None:
    """Put ``MovedFinder`` first on ``sys.meta_path``, once (first, so the path finder never loads
    an old name from the new folder as a second copy of a module)."""
    if not any(isinstance(f, MovedFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, MovedFinder())
