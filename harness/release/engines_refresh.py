"""``harness ledger engines-page --refresh``: fresh rows for every engine of docs/engines.md that this
machine has, then the page (``harness.evidence.engines_page``).

For each engine of ``engines_page.ENGINES`` that can run here (``available``), one
``harness parity`` per model of ``engines_page.MODELS`` and compute class the page has a column for
(a class the engine does not compute in, or a model the page marks as not run for it, is left out:
its cell keeps its stated reason), and the engine's probe runs (``PageEngine.probes``: every probe
on the dense F32 fixture, the serving scenarios for a server), each appending to ``ledger``. Each
run is its own ``python -m harness`` process, so an engine that crashes costs one row, not the
refresh; a run's verdict is its row (a FAIL is a fresh row like a PASS). An engine this machine
lacks is skipped, named with why, and its cells keep their newest rows (or their UNMEASURED
reason). Then the page is rendered from the ledger.

``stale_rows`` / ``stale_notice``: the release flow's check that no thresholds.yaml row the page
cites has changed since it judged its cell (``harness status`` prints the notice).
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

from harness.errors import InvalidInput
from harness.evidence import engines_page as ep

RUN_TIMEOUT_S = 3600.0
"""Seconds one run may take before it is stopped (its row is then missing: the cell stays as it was)."""


def _has(*modules: str) -> bool:
    try:
        return all(importlib.util.find_spec(m) is not None for m in modules)
    except (ImportError, ValueError):
        return False


def _imports(*modules: str) -> str | None:
    """None when every module imports in this interpreter, else the first failure, one line
    (``ModuleNotFoundError: No module named 'torch'``): installed is not enough, a torch whose
    native libraries do not load cannot run a cell."""
    import importlib

    for m in modules:
        try:
            importlib.import_module(m)
        except Exception as e:  # any failure to import (ImportError, OSError of a native library, RuntimeError) means: not here
            first = (str(e).splitlines() or [""])[0][:200]
            return f"{type(e).__name__}: {first}"
    return None


def available(name: str) -> str | None:
    """None when the engine ``name`` can run on this machine, else why not (one line).
    transformers: torch and transformers must import (``_imports``), not only be installed."""
    if name == "mlx":
        return None if _has("mlx", "mlx_lm") else "mlx-lm is not installed (the `mlx` extra)"
    if name == "transformers":
        failed = _imports("torch", "transformers")
        return None if failed is None else f"torch and transformers do not import here (the `hf` extra; {failed})"
    if name == "llama-server":
        from harness.engines.llama_server import BUILD_COMMAND, built_binary

        return None if built_binary() is not None else f"llama-server is not built (`{BUILD_COMMAND}`)"
    if name == "llama-cpp-python-server":
        return None if _has("llama_cpp", "fastapi", "sse_starlette", "uvicorn") else "llama-cpp-python's `server` extra is not installed"
    if name.startswith("command:"):
        from harness.config import load_config

        table = ((load_config().get("engines") or {}).get(name.split(":", 1)[1]) or {})
        program = (table.get("command") or [None])[0] if isinstance(table, dict) else None
        if not program:
            return f"no [tool.harness.engines.{name.split(':', 1)[1]}] table"
        return None if Path(program).exists() else f"its interpreter {program} is not here (make it: scripts/llamacpp_0317_venv.sh)"
    return f"the refresh does not know how to tell whether {name} runs here"


@dataclass(frozen=True)
class RefreshRun:
    """One run: ``argv`` after ``python -m harness``; ``what`` names it on the progress line."""

    what: str
    argv: tuple[str, ...]


@dataclass
class RefreshOutcome:
    """What a refresh did: each run with its exit status and seconds, the engines skipped with why,
    the page written (None on a dry run)."""

    runs: list[tuple[RefreshRun, int, float]] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    page: Path | None = None


def plan(ledger: str | Path, engines: Sequence[str] = (), models: Sequence[str] = ()) -> tuple[list[RefreshRun], list[str]]:
    """The runs of a refresh (module docstring) and the engines skipped with why. ``engines`` /
    ``models``: only these (default every one the page has); an unknown name is ``InvalidInput``."""
    names = [e.name for e in ep.ENGINES]
    specs = [m for m, _, _ in ep.MODELS]
    for bad, known, what in ((set(engines) - set(names), names, "engine"), (set(models) - set(specs), specs, "model")):
        if bad:
            raise InvalidInput(f"the conformance page has no {what} {', '.join(sorted(bad))}; it has: {', '.join(known)}")
    runs: list[RefreshRun] = []
    skipped: list[str] = []
    for eng in ep.ENGINES:
        if engines and eng.name not in engines:
            continue
        why = available(eng.name)
        if why is not None:
            skipped.append(f"{eng.name}: {why}")
            continue
        for spec, kind, _ in ep.MODELS:
            if models and spec not in models or spec in eng.model_unmeasured:
                continue
            for cls in ep.CLASSES:
                if cls in eng.unmeasured or (kind, cls) in eng.kind_unmeasured:
                    continue
                dtype = ("--dtype", eng.dtypes[cls]) if cls in eng.dtypes else ()
                runs.append(RefreshRun(f"parity {eng.name} {spec} {cls}",
                                       ("parity", "--candidate", eng.name, "--model", spec, *dtype, "--ledger", str(ledger))))
        for spec, cls, only in eng.probes:
            if models and spec not in models:
                continue
            dtype = ("--dtype", eng.dtypes[cls]) if cls in eng.dtypes else ()
            runs.append(RefreshRun(f"probe {eng.name} {spec} {cls}" + (f" --only {only}" if only else ""),
                                   ("probe", "--candidate", eng.name, "--model", spec, *dtype, *(("--only", only) if only else ()),
                                    "--ledger", str(ledger))))
    return runs, skipped


def refresh(ledger: str | Path, out: str | Path, engines: Sequence[str] = (), models: Sequence[str] = (), dry_run: bool = False,
            log: Callable[[str], None] = lambda line: None) -> RefreshOutcome:
    """Run every run of ``plan`` (each ``python -m harness ...`` from the current folder, at most
    ``RUN_TIMEOUT_S``), then write the page from ``ledger`` to ``out`` (``engines_page.write``).
    ``dry_run``: only plan. ``log`` gets a line before and after each run. Raises ``InvalidInput``
    as ``plan`` and ``engines_page.write`` do; a run that fails is reported, not raised."""
    runs, skipped = plan(ledger, engines, models)
    outcome = RefreshOutcome(skipped=skipped)
    for i, run in enumerate(runs, 1):
        if dry_run:
            log(f"[{i}/{len(runs)}] would run: harness {' '.join(run.argv)}")
            continue
        log(f"[{i}/{len(runs)}] {run.what} ...")
        t0 = time.monotonic()
        try:
            done = subprocess.run([sys.executable, "-m", "harness", *run.argv], stdin=subprocess.DEVNULL, capture_output=True,
                                  text=True, timeout=RUN_TIMEOUT_S)
            rc, tail = done.returncode, (done.stdout + done.stderr).strip().splitlines()[-1:] or [""]
        except subprocess.TimeoutExpired:
            rc, tail = 124, [f"stopped after {RUN_TIMEOUT_S:g} s"]
        outcome.runs.append((run, rc, time.monotonic() - t0))
        log(f"[{i}/{len(runs)}] {run.what}: exit {rc} in {time.monotonic() - t0:.0f} s: {tail[0][:200]}")
    if not dry_run:
        outcome.page = ep.write(ledger, out)
    return outcome


def stale_rows(page: str | Path, thresholds_path: str | Path) -> list[str]:
    """One line per row the page cites whose content in ``thresholds_path`` is not what judged the
    cell any more (changed, or gone); empty when the page is current. Raises ``InvalidInput`` for
    an unreadable page or thresholds file."""
    from harness.judge.thresholds import load_thresholds

    try:
        text = Path(page).read_text()
    except OSError as e:
        raise InvalidInput(f"{page}: cannot read the conformance page: {e.strerror or e}") from None
    th = load_thresholds(thresholds_path)
    out = []
    for label, sha in ep.cited_rows_on_page(text):
        now = ep.current_row_sha256(label, th)
        if now != sha:
            out.append(f"{label}: judged as sha256 {sha[:12]}, now " + (f"{now[:12]}" if now else "gone"))
    return out


def stale_notice(page: str | Path = ep.DEFAULT_OUT, thresholds_path: str | Path = "thresholds.yaml") -> str | None:
    """The line ``harness status`` prints when the conformance page is stale (``stale_rows``),
    naming the rows and ``ep.REFRESH_COMMAND``; None when it is current, or when either file is not
    here (a project that keeps no conformance page)."""
    if not Path(page).is_file() or not Path(thresholds_path).is_file():
        return None
    rows = stale_rows(page, thresholds_path)
    if not rows:
        return None
    shown = "; ".join(rows[:3]) + (f"; and {len(rows) - 3} more" if len(rows) > 3 else "")
    return (f"{page} is stale: {len(rows)} of the {thresholds_path} rows its cells cite changed since they judged them "
            f"({shown}); refresh it: {ep.REFRESH_COMMAND}")
