"""``harness sweep MANIFEST``: run every cell of a release that has no current receipt.

The coordinator (this process) plans the runs (``harness.release.cells.plan_runs``: per model,
candidate and backend a parity and a probe run), finds which already have a receipt made from the
same inputs (``existing_receipts``), and hands the rest to an executor:

* ``LocalExecutor`` (default): ``--jobs`` processes (spawned, so no engine state is shared; one
  job runs in this process), llama.cpp's threads divided among them (``threads_per_job``);
* ``RayExecutor`` (``--ray [ADDRESS]``, the ``dist`` extra): each run is a Ray task. Without an
  address Ray is started locally with the dashboard off, usage statistics off and ``num_cpus``
  equal to ``--jobs``; with one it joins that cluster.

A task measures its cell and records nothing: it returns the receipt (JSON) and its arrays to the
coordinator, which alone writes receipts and appends ledger rows, in the manifest's order (a
finished run waits for the runs planned before it), so the hash chain stays linear and the same
manifest gives the same chain whatever the executor. Resumable: a run whose receipt exists for the
same inputs is skipped; a receipt written before a kill but not yet in the ledger gets its row
(``adopted``); nothing already written is touched.
"""

from __future__ import annotations

import json
import os
import shlex
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

from harness.errors import HarnessError, InvalidInput, Verdict
from harness.evidence.rows import CACHE_COLUMNS, row_from_receipt
from harness.evidence.ledger_cache import LedgerCache
from harness.evidence.receipts import iter_receipt_files, load_receipt
from harness.evidence.record import EvidencePaths, preflight_evidence, record_evidence, record_row
from harness.provenance import sha256_bytes
from harness.release.cells import (PlanContext, Run, candidate_settings, keys_of_receipt, known_receipt_keys, plan_context, plan_runs,
                                   receipt_verdict, run_command)
from harness.release.manifest import Manifest

ENV_PASSED = ("HARNESS_CONFIG", "HARNESS_CACHE_DIR", "HARNESS_DEBUG")
"""Environment variables a task carries to its worker (a Ray worker does not inherit the
coordinator's environment)."""


# ---------------------------------------------------------------------------------------------
# Tasks: what a worker runs (top-level functions, so they pickle)
# ---------------------------------------------------------------------------------------------


def task_of(m: Manifest, ctx: PlanContext, run: Run, threads: int, ledger: Path) -> dict[str, Any]:
    """The picklable description of ``run`` a worker executes (``run_task``); ``ledger`` is read
    (never written) for a calibration recorded for the model; ``candidate_settings`` make the
    candidate compute in its pinned class (``cells.candidate_settings``: ``--dtype``)."""
    return {"ledger": str(ledger),
        "kind": run.kind, "key": run.key, "inputs": run.inputs, "model": run.cell.model.spec, "candidate": run.cell.candidate.engine,
        "reference": m.reference, "prompts": None if m.prompts is None else str(m.prompts), "thresholds": str(ctx.thresholds),
        "probes": list(m.probes), "threads": threads, "argv": shlex.split(run_command(m, run)), "cwd": os.getcwd(),
        "candidate_settings": candidate_settings(run.cell.candidate),
        "env": {k: os.environ[k] for k in ENV_PASSED if k in os.environ},
    }


def run_task(task: dict[str, Any]) -> dict[str, Any]:
    """Measure one run without recording it: ``{"receipt", "arrays", "verdict", "message",
    "seconds"}``, or ``{"error": {"verdict", "message"}, "seconds"}`` when the harness refused or an
    engine failed (a ``HarnessError``). The receipt carries ``cell`` (the planned key and inputs)."""
    # deferred: a worker process imports the engines only when it runs a task
    from harness.runs.parity import ParityRequest, run_parity
    from harness.runs.probes import PROBE_NAMES, ProbeRequest, run_probes

    os.environ.update(task["env"])
    os.chdir(task["cwd"])
    t0 = time.monotonic()
    common = dict(model=task["model"], candidate=task["candidate"], reference=task["reference"], prompts=task["prompts"],
                  thresholds=task["thresholds"], argv=task["argv"], write_evidence=False, ledger=task["ledger"],
                  reference_settings={"n_threads": task["threads"]} if task["reference"] in ("llama.cpp", "llama.cpp-repack") else {},
                  candidate_settings=dict(task.get("candidate_settings") or {}))
    try:
        if task["kind"] == "parity":
            out = run_parity(ParityRequest(**common))
            receipt, arrays, verdict, message = out.receipt, out.result.per_position, out.result.verdict, out.result.message
        else:
            # every probe: judged as `harness probe` (split, decode, determinism required); a
            # manifest's subset: as `harness probe --only ...` (its reproducer), each one required
            every = set(task["probes"]) == set(PROBE_NAMES)
            run = run_probes(ProbeRequest(**common, only=[] if every else task["probes"]))
            receipt, arrays, verdict, message = run.receipt, {}, run.verdict, run.message
    except HarnessError as e:
        return {"error": {"verdict": e.verdict.value, "message": str(e)}, "seconds": time.monotonic() - t0}
    receipt = {**receipt, "cell": {"key": task["key"], "inputs": task["inputs"]}}
    return {"receipt": receipt, "arrays": dict(arrays), "verdict": verdict.value, "message": message, "seconds": time.monotonic() - t0}


# ---------------------------------------------------------------------------------------------
# Executors
# ---------------------------------------------------------------------------------------------


def threads_per_job(jobs: int) -> int:
    """llama.cpp threads per job: the CPU count divided among ``jobs`` (at least 1)."""
    return max(1, (os.cpu_count() or 1) // max(1, jobs))


class LocalExecutor:
    """``jobs`` local processes (spawned); ``jobs == 1`` runs each task in this process."""

    def __init__(self, jobs: int = 1):
        self.jobs = max(1, int(jobs))

    def map_unordered(self, tasks: Sequence[dict[str, Any]]) -> Iterator[tuple[int, dict[str, Any]]]:
        """Yield ``(index, result)`` as each task finishes."""
        if self.jobs == 1:
            for i, t in enumerate(tasks):
                yield i, run_task(t)
            return
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor, as_completed

        with ProcessPoolExecutor(max_workers=min(self.jobs, len(tasks) or 1), mp_context=multiprocessing.get_context("spawn")) as pool:
            futures = {pool.submit(run_task, t): i for i, t in enumerate(tasks)}
            for f in as_completed(futures):
                yield futures[f], f.result()


class RayExecutor:
    """Runs tasks as Ray tasks (``dist`` extra). ``address`` None: a local Ray instance with the
    dashboard off, usage statistics off and ``num_cpus = jobs``; else the cluster at ``address``.
    Raises ``InvalidInput`` when Ray is not installed."""

    def __init__(self, address: str | None = None, jobs: int = 1):
        self.address, self.jobs = address, max(1, int(jobs))

    def map_unordered(self, tasks: Sequence[dict[str, Any]]) -> Iterator[tuple[int, dict[str, Any]]]:
        """Yield ``(index, result)`` as each Ray task finishes; shuts down a Ray it started."""
        os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
        try:
            import ray
        except ImportError:
            raise InvalidInput("--ray needs Ray: pip install 'qwen35-harness[dist]'") from None
        started = not ray.is_initialized()
        if started:
            kwargs: dict[str, Any] = {"include_dashboard": False, "log_to_driver": False, "configure_logging": False}
            if self.address:
                ray.init(address=self.address, **kwargs)
            else:
                ray.init(num_cpus=self.jobs, **kwargs)
        try:
            remote = ray.remote(num_cpus=1, max_retries=0)(run_task)
            refs = {remote.remote(t): i for i, t in enumerate(tasks)}
            pending = list(refs)
            while pending:
                done, pending = ray.wait(pending, num_returns=1)
                for ref in done:
                    yield refs[ref], ray.get(ref)
        finally:
            if started:
                ray.shutdown()


# ---------------------------------------------------------------------------------------------
# The coordinator
# ---------------------------------------------------------------------------------------------


@dataclass
class RunOutcome:
    """What happened to one run: ``status`` ``current`` (a receipt with its row existed),
    ``adopted`` (a receipt existed without its row: the row was appended), ``ran`` (measured and
    recorded now) or ``error`` (the task failed; nothing recorded); the receipt id, verdict,
    message, seconds and the ledger row's seq where there is one."""

    run: Run
    status: str
    verdict: str | None = None
    message: str = ""
    receipt_id: str | None = None
    seq: int | None = None
    seconds: float = 0.0


@dataclass
class SweepResult:
    """A finished sweep: every run's outcome in the manifest's order, and the ledger."""

    outcomes: list[RunOutcome] = field(default_factory=list)
    ledger: Path | None = None

    @property
    def verdict(self) -> Verdict:
        """The worst verdict over the runs (``Verdict.worst``); PASS when every receipt is a PASS."""
        known = {v.value: v for v in Verdict}
        verdicts = [known.get(o.verdict or "", Verdict.UNMEASURED) for o in self.outcomes]
        return Verdict.worst(verdicts) if verdicts else Verdict.UNMEASURED


def existing_receipts(paths: EvidencePaths) -> tuple[dict[str, Path], dict[str, dict[str, Any]]]:
    """``({key: receipt path}, {receipt id: ledger row})`` of the receipts folder and ledger: each
    receipt is indexed under the key of the inputs it was made from (``receipt_inputs``) and, when
    a sweep made it, under its planned ``cell.key``; the later of two receipts for a key wins. The
    rows are those (the latest naming each receipt) of the receipts found.

    Each receipt is read once: its keys are kept in the ledger's query cache
    (``cells.known_receipt_keys``, ``LedgerCache.add_receipt_keys``; receipts are content-addressed
    and never replaced), so a sweep over a folder of 100,000 receipts lists the folder and reads
    only the receipts it has not seen; the rows come from the cache by receipt id, not from
    parsing the ledger."""
    files = iter_receipt_files(paths.receipts)
    with LedgerCache.open(paths.ledger, CACHE_COLUMNS, check=True) as cache:
        by_id = {p.stem: p for p in files}
        known = known_receipt_keys(cache, by_id, by_id.__getitem__)
        by_key: dict[str, tuple[str, Path]] = {}

        def seq(rid: str) -> int:  # a tie in ``created`` (one second) goes to the later ledger row
            return max(cache.seqs_of_receipt(rid) or [-1])

        for p in files:
            for typed, created in known.get(p.stem, []):
                kind, _, k = typed.partition(":")
                if kind not in ("input", "cell"):
                    continue
                if (k not in by_key or created > by_key[k][0]
                        or (created == by_key[k][0] and seq(p.stem) >= seq(by_key[k][1].stem))):
                    by_key[k] = (created, p)
        found = {k: v[1] for k, v in by_key.items()}
        rows = {}
        for rid in {p.stem for p in found.values()}:
            seqs = cache.seqs_of_receipt(rid)
            if seqs:
                rows[rid] = cache.rows(max(seqs), max(seqs))[0]
    return found, rows


def _current(run: Run, path: Path, row: dict[str, Any]) -> RunOutcome:
    """The outcome of a run whose receipt ``path`` and ledger ``row`` exist: ``current``, its
    verdict read from the receipt; ``error`` (INVALID, naming what disagrees, nothing run) when the
    receipt's bytes are not the sha256 the row binds, its verdict is not the row's, or it was not
    made for this run (the query cache's keys are an index, checked against the receipt here)."""
    rid = path.stem
    data = path.read_bytes()
    rec = json.loads(data.decode("utf-8"))
    verdict = receipt_verdict(rec)
    sha = sha256_bytes(data)
    why = (f"receipt {rid[:12]} has sha256 {sha[:12]}, not the {str(row.get('receipt_sha256'))[:12]} row {row.get('seq')} binds"
           if sha != row.get("receipt_sha256") else
           f"row {row.get('seq')} says {row.get('verdict')!r} but its receipt {rid[:12]} says {verdict!r}" if row.get("verdict") != verdict else
           None if {f"input:{run.key}", f"cell:{run.key}"} & {k for k, _ in keys_of_receipt(rec)} else
           f"the query cache files receipt {rid[:12]} under this run, but the receipt was made from other inputs")
    if why:
        return RunOutcome(run, "error", Verdict.INVALID.value, f"{why}; not run (harness ledger verify --deep)", rid, row.get("seq"))
    return RunOutcome(run, "current", verdict, "receipt exists", rid, row.get("seq"))


def _adopt(paths: EvidencePaths, path: Path) -> dict[str, Any]:
    """Append the row of a receipt written before a kill (checked by ``load_receipt`` first)."""
    receipt = load_receipt(path).receipt
    return record_row(paths.ledger, row_from_receipt(receipt), path, paths.markdown)


def sweep(m: Manifest, ledger: str | Path | None, executor: Any, jobs: int = 1,
          on_done: Callable[[RunOutcome, int, int], None] | None = None) -> SweepResult:
    """Run every run of ``m`` without a current receipt on ``executor`` (``LocalExecutor`` or
    ``RayExecutor``), recording each result in manifest order into ``ledger`` (None: the
    project's). ``on_done(outcome, done, total)`` is called as each run is settled. Runs whose
    model's sha256 is not the manifest's pin are not run (error: the sign-off is blocked on the
    pin, not on a receipt). Raises ``InvalidInput`` when the evidence cannot be written
    (``preflight_evidence``)."""
    paths = preflight_evidence(ledger)
    ctx = plan_context(m, paths.ledger)
    runs = plan_runs(m, ctx)
    found, rows = existing_receipts(paths)
    outcomes: list[RunOutcome | None] = [None] * len(runs)
    todo: list[int] = []
    done_count = 0

    def settle(i: int, o: RunOutcome) -> None:
        nonlocal done_count
        outcomes[i] = o
        done_count += 1
        if on_done:
            on_done(o, done_count, len(runs))

    for i, run in enumerate(runs):
        pin = run.cell.model
        if ctx.model_sha256.get(pin.spec) != pin.sha256:
            settle(i, RunOutcome(run, "error", Verdict.INVALID.value, f"model {pin.spec} has sha256 {str(ctx.model_sha256.get(pin.spec))[:12]}, "
                                                                   f"not the manifest's {pin.sha256[:12]}; not run"))
        elif run.key in found:
            path = found[run.key]
            rid = path.stem
            if rid in rows:
                settle(i, _current(run, path, rows[rid]))
            else:
                row = _adopt(paths, path)
                rows[rid] = row
                settle(i, RunOutcome(run, "adopted", row.get("verdict"), "receipt written before an interruption: row appended", rid, row["seq"]))
        else:
            todo.append(i)
    threads = threads_per_job(jobs)
    tasks = [task_of(m, ctx, runs[i], threads, paths.ledger) for i in todo]
    ready: dict[int, dict[str, Any]] = {}
    nxt = 0  # next position in ``todo`` to record: results are recorded in the manifest's order
    for j, result in executor.map_unordered(tasks):
        ready[j] = result
        while nxt in ready:
            settle(todo[nxt], _record(paths, runs[todo[nxt]], ready.pop(nxt)))
            nxt += 1
    return SweepResult([o for o in outcomes if o is not None], paths.ledger)


def _record(paths: EvidencePaths, run: Run, result: dict[str, Any]) -> RunOutcome:
    """Write a finished task's receipt and ledger row (the coordinator's only writes)."""
    if "error" in result:
        return RunOutcome(run, "error", result["error"]["verdict"], result["error"]["message"], seconds=result["seconds"])
    rec = record_evidence(result["receipt"], result["arrays"], paths.ledger)
    return RunOutcome(run, "ran", result["verdict"], result["message"], rec.receipt["id"], rec.row["seq"], result["seconds"])
