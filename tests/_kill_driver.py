"""SIGKILL ``harness parity`` mid-write and check the evidence it leaves (for tests/test_bad_input.py).

    python tests/_kill_driver.py WORKDIR      (WORKDIR/gates.yaml: the thresholds file to use)

One warm process imports the harness once, then forks one ``harness parity`` run per case (the
CLI's ``main``, so a child is exactly a ``harness parity`` process without the interpreter start):

- a seed run and a warm run (timed, so the kill moments below are fractions of the faster real run);
- six runs that SIGKILL themselves at a write step of the evidence (see ``HOOKS``);
- five runs killed by this process at 15 %, 35 %, 55 %, 75 % and 90 % of the seed run's time;
- a final run that must finish with exit 0 and one more ledger row.

Every run gets its own prompt tokens, so each writes a new receipt. After each, the driver
records whether any visible ``receipts/*.json`` fails to load (``partial_json``) and what
``verify_ledger`` says (``problems``). The last stdout line is a JSON report.
Both engines are command engines (cheap to start); what is under test is the evidence path.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import textwrap
import time
from pathlib import Path

WORK = Path(sys.argv[1]).resolve()
V = 515
ENGINE = textwrap.dedent(f"""
    import json, sys
    import numpy as np
    req = json.load(open(sys.argv[1])); out = sys.argv[2]
    good = np.stack([np.random.default_rng(t).standard_normal({V}).astype(np.float32) for t in req['tokens']])
    np.save(out + '/logits.npy', good + np.float32(float(sys.argv[3])))
""")
(WORK / "engine.py").write_text(ENGINE)
(WORK / "harness.toml").write_text(
    "".join(f'[engines.{n}]\ncommand = ["{{python}}", "{WORK / "engine.py"}", "{{request}}", "{{out_dir}}", "{d}"]\n'
            for n, d in (("good", "0"), ("near", "0.001")))
)
os.environ["HARNESS_CONFIG"] = str(WORK / "harness.toml")
os.environ["MPLBACKEND"] = "Agg"

import harness.runs.explain  # noqa: E402  (the verdict page and the index each run writes)
import harness.runs.parity  # noqa: E402
import harness.evidence.index  # noqa: E402
import harness.evidence.ledger  # noqa: E402  (warm every module a run touches before forking)
import harness.evidence.receipts  # noqa: E402
import harness.evidence.record  # noqa: E402
import harness.evidence.report  # noqa: E402
from harness.cli import main  # noqa: E402
from harness.errors import InvalidInput  # noqa: E402
from harness.evidence.ledger import read_rows, verify_ledger  # noqa: E402
from harness.evidence.receipts import load_receipt  # noqa: E402
from harness.fixtures import synthetic as fx  # noqa: E402

harness.evidence.report._plt()
harness.evidence.receipts.harness_info(Path(harness.runs.parity.__file__).resolve().parent.parent)  # git calls, cached for the children
fx.build("tiny-qwen35")
LEDGER = WORK / "ev" / "ledger.jsonl"
RECEIPTS = LEDGER.parent / "receipts"


def _die(*_a, **_k):
    os.kill(os.getpid(), signal.SIGKILL)


def _link_hook(suffix: str, after: bool):
    """Die when a receipt file is linked into place (receipts are created with link semantics),
    just before (its temporary file is written) or just after (it is visible, its temporary file
    not yet removed)."""
    real = os.link

    def link(src, dst, *a, **k):
        if str(dst).endswith(suffix) and RECEIPTS in (Path(dst).parent, Path(dst).parent.parent):  # flat or sharded
            if after:
                real(src, dst, *a, **k)
            _die()
        return real(src, dst, *a, **k)

    os.link = link


HOOKS = {
    "npz-temp-written": lambda: _link_hook(".npz", after=False),
    "npz-linked-no-json": lambda: _link_hook(".npz", after=True),
    "json-temp-written": lambda: _link_hook(".json", after=False),
    "receipt-written-no-ledger-row": lambda: setattr(harness.evidence.record, "receipt_row", _die),  # record.py's own name: after the receipt, before its row
    "row-appended-markdown-not-rendered": lambda: setattr(harness.evidence.ledger, "_write_text_atomic", _die),
    "report-half-written": lambda: setattr(harness.evidence.report, "plot_margins", _die),
}


def argv(i: int) -> list[str]:
    prompts = WORK / f"prompts-{i}.jsonl"
    prompts.write_text(json.dumps({"id": f"run{i}", "tokens": [(7 * k + i) % V for k in range(96)]}) + "\n")
    return ["parity", "--model", "fixture:tiny-qwen35", "--prompts", str(prompts), "--candidate", "command:near",
            "--reference", "command:good", "--ledger", str(LEDGER), "--json", "--thresholds", str(WORK / "gates.yaml"), "--no-calibrate"]


def fork_run(i: int, hook: str | None = None, kill_after: float | None = None) -> dict:
    t0 = time.perf_counter()
    pid = os.fork()
    if pid == 0:  # the child: a harness parity process
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 1)
        os.dup2(devnull, 2)
        if hook:
            HOOKS[hook]()
        os._exit(main(argv(i)))
    if kill_after is not None:
        time.sleep(kill_after)
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    _, status = os.waitpid(pid, 0)
    wall = time.perf_counter() - t0
    out = {"run": i, "hook": hook, "kill_after": kill_after, "wall_s": round(wall, 3),
           "signal": signal.Signals(os.WTERMSIG(status)).name if os.WIFSIGNALED(status) else None,
           "exit": os.WEXITSTATUS(status) if os.WIFEXITED(status) else None}
    out.update(inspect())
    return out


def inspect() -> dict:
    partial = []
    for p in sorted(RECEIPTS.glob("*/*.json")) if RECEIPTS.exists() else []:
        try:
            load_receipt(p)
        except InvalidInput as e:
            partial.append(f"{p.name}: {e}")
    problems = [str(p) for p in verify_ledger(LEDGER, RECEIPTS)] if LEDGER.exists() else ["no ledger"]
    return {"partial_json": partial, "problems": problems, "rows": len(read_rows(LEDGER)) if LEDGER.exists() else 0}


def main_driver() -> None:
    runs = [fork_run(0), fork_run(1)]  # the seed, then a warm run: the moments are fractions of the faster
    assert runs[0]["exit"] == 0 and runs[1]["exit"] == 0, runs
    seed_wall = min(runs[0]["wall_s"], runs[1]["wall_s"])  # a first run's cold caches made it 2x a warm one
    i = 2
    for hook in HOOKS:
        runs.append(fork_run(i, hook=hook))
        i += 1
    for frac in (0.15, 0.35, 0.55, 0.75, 0.9):
        runs.append(fork_run(i, kill_after=frac * seed_wall))
        i += 1
    rows_before = runs[-1]["rows"]
    final = fork_run(i)
    final["rows_before"] = rows_before
    for r in runs:
        print(json.dumps(r), file=sys.stderr)
    print(json.dumps({"seed_wall_s": seed_wall, "runs": runs, "final": final}))


if __name__ == "__main__":
    main_driver()
