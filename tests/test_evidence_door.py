"""The evidence door, followed at run time: one parity run's evidence step (from the moment the run
hands its receipt to ``harness.evidence.record.record_evidence`` until the door returns) calls each
evidence module once, in the door's order, and writes the verdict page before the index, so the
index links the page at once and nothing renders the index again afterwards.

How it is followed (the same way for the note of issue 46): ``sys.setprofile`` sees every Python
call; a call counts as an *entry* into a module of ``harness/evidence/`` when it is made by the
door itself (a frame of ``record.py``). ``strict`` counts, beside it, every call into an evidence
module from a frame of another file while no frame of that module is on the stack (helpers the
modules share count there each time they are used)."""

from __future__ import annotations

import collections
import json
import sys
from pathlib import Path

import pytest

from harness.evidence.index import INDEX_MD, reports_dir
from harness.measure.prompts import load_prompts
from harness.runs.parity import ParityRequest, run_parity

EVIDENCE = "harness/evidence/"
DOOR = EVIDENCE + "record.py"
DOOR_ORDER = ["chain.py", "receipts.py", "rows.py", "ledger_cache.py", "pages.py", "report.py", "index.py"]
"""The modules the door calls, in its order (module docstring of ``harness.evidence.record``): the
lock and the chained append, the receipt, its row, the query cache, LEDGER.md, the verdict page,
the reports index."""


class Follow:
    """Counts calls into ``harness/evidence/*`` while ``record_evidence`` runs (module docstring)."""

    def __init__(self) -> None:
        self.direct: list[str] = []
        self.strict: collections.Counter[str] = collections.Counter()
        self.after: collections.Counter[str] = collections.Counter()
        self._on_stack: collections.Counter[str] = collections.Counter()
        self._frames: dict[int, str | None] = {}
        self._active = 0
        self._done = False

    @staticmethod
    def _module(code) -> str | None:
        i = code.co_filename.replace("\\", "/").rfind("/harness/")
        return code.co_filename.replace("\\", "/")[i + 1:] if i >= 0 else None

    def __call__(self, frame, event, arg) -> None:
        if event == "call":
            mod = self._module(frame.f_code)
            caller = self._module(frame.f_back.f_code) if frame.f_back else None
            self._frames[id(frame)] = mod
            if mod == DOOR and frame.f_code.co_name == "record_evidence":
                self._active += 1
            if mod and mod.startswith(EVIDENCE) and caller != mod:
                if self._active:
                    if caller == DOOR and mod != DOOR:
                        self.direct.append(mod[len(EVIDENCE):])
                    if self._on_stack[mod] == 0:
                        self.strict[mod[len(EVIDENCE):]] += 1
                elif self._done and self._on_stack[mod] == 0:
                    self.after[mod[len(EVIDENCE):]] += 1
            if mod:
                self._on_stack[mod] += 1
        elif event == "return":
            mod = self._frames.pop(id(frame), None)
            if mod:
                self._on_stack[mod] -= 1
            if mod == DOOR and frame.f_code.co_name == "record_evidence":
                self._active -= 1
                self._done = True


@pytest.fixture(scope="module")
def followed(tmp_path_factory):
    d = tmp_path_factory.mktemp("door")
    texts = {p.id: p.text for p in load_prompts(None)}
    prompts = d / "one.jsonl"
    prompts.write_text(json.dumps({"id": "prose-weather", "text": texts["prose-weather"]}) + "\n")
    ledger = d / "ev" / "ledger.jsonl"
    req = dict(model="fixture:tiny-qwen35", prompts=str(prompts), ledger=str(ledger), greedy_tokens=0, report=True)
    run_parity(ParityRequest(candidate="oracle-f16", **req))  # a first row, so the door appends to a ledger that has one
    follow = Follow()
    sys.setprofile(follow)
    try:
        out = run_parity(ParityRequest(candidate="oracle", **req))
    finally:
        sys.setprofile(None)
    return follow, out, ledger


def test_the_door_calls_each_evidence_module_once_in_its_order(followed):
    follow, out, _ = followed
    assert out.result.verdict.value == "PASS"
    counts = collections.Counter(follow.direct)
    assert {m: n for m, n in counts.items() if n != 1} == {}, f"the door called these more than once: {follow.direct}"
    assert sorted(counts) == sorted(DOOR_ORDER), follow.direct
    assert follow.direct == DOOR_ORDER


def test_nothing_touches_the_evidence_after_the_door_returns(followed):
    follow, out, ledger = followed
    # the run returns what the door wrote; nothing re-reads the receipt or re-renders the index
    assert dict(follow.after) == {}
    assert out.report_path is not None and out.report_path.is_file()


def test_the_index_written_by_the_door_links_the_new_rows_verdict_page(followed):
    _, out, ledger = followed
    index = (reports_dir(ledger) / INDEX_MD).read_text(encoding="utf-8")
    rid = out.receipt["id"][:16]
    assert f"({rid}/report.md)" in index
    # the row before it, also written with its page, is linked too
    assert index.count("verdict page") == 2
    assert Path(out.report_path).parent.name == rid
