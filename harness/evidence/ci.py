"""What a CI job shows of parity runs: a Markdown step summary and JUnit XML.

``harness parity --summary-md FILE --junit-xml FILE`` writes both for the receipts of its run
(every model of a multi-model run, and a line for each model that raised before a receipt was
written); with ``$GITHUB_STEP_SUMMARY`` set the Markdown is also appended to that file, GitHub
Actions' job summary. ``harness report RECEIPT --format markdown|junit`` renders the same from a
receipt on disk.

JUnit XML follows the common schema CI systems read (Jenkins' and GitLab's ``testsuites`` →
``testsuite`` → ``testcase``): one ``testsuite`` per cell (``parity MODEL: CANDIDATE vs
REFERENCE``), a ``testcase`` per gated tier (``release gate``, ``calibrated tier``) and per prompt
(``prompt ID``). A failed tier or a prompt with failing positions carries a ``failure`` element
(its message the tier's line, or the prompt's failing count and first failing position); a tier
or a prompt the verdict left unjudged (UNMEASURED) a ``skipped`` element, never a pass; a run
that ended in ENGINE-ERROR, NOT-COMPARABLE or INVALID an ``error`` element. Nothing here
decides a verdict: each is read from the receipt.

Untrusted text (prompt ids, engine and model names, messages) is escaped for where it goes:
``harness.evidence.page`` escapes the Markdown, ``xml.etree.ElementTree`` the XML (control
characters, which XML 1.0 cannot hold, written as Python escapes first by ``page.untrusted``).
"""

from __future__ import annotations

import xml.etree.ElementTree as ET
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from harness.evidence import fmt
from harness.evidence.page import Page, untrusted


@dataclass(frozen=True)
class CiEntry:
    """One model of a run: its receipt, or (``receipt`` None) the ``verdict`` and ``message`` of
    the error that ended it before a receipt was written; ``spec`` the model as the user named it."""

    spec: str
    receipt: Mapping[str, Any] | None = None
    verdict: str | None = None
    message: str = ""

    @property
    def outcome(self) -> str:
        """The entry's verdict: the receipt's ``gated.verdict``, else the error's."""
        return self.receipt["gated"]["verdict"] if self.receipt is not None else (self.verdict or "INTERNAL-ERROR")


def _cell_name(e: CiEntry) -> str:
    if e.receipt is None:
        return f"parity {e.spec}"
    r = e.receipt
    return f"parity {r['model']['name']}: {r['engines']['candidate']['name']} vs {r['engines']['reference']['name']}"


def markdown_summary(entries: Sequence[CiEntry]) -> str:
    """A Markdown step summary of ``entries``: a table of one row per model (verdict, positions,
    lowest cosine, failing positions, KLD mean, and where measured the perplexity ratio and the
    mean Δp of the reference's top token), then each non-PASS entry's message in a code block."""
    page = Page("harness parity")
    page.h(2, "harness parity")
    rows = []
    for e in entries:
        r = e.receipt
        if r is None:
            rows.append([untrusted(e.spec), e.outcome] + [fmt.NA] * 6)
            continue
        g, ro = r["gated"], r["report_only"]
        ppl = ro.get("perplexity") or {}
        rows.append([untrusted(r["model"]["name"]), e.outcome, str(g.get("positions", r["prompts"]["positions"])),
                     fmt.cosine(g.get("min_cosine_observed")), str(g.get("failing_positions", fmt.NA)),
                     fmt.kld((ro.get("kld") or {}).get("mean")),
                     fmt.ratio(ppl.get("ratio")),
                     fmt.signed_percent((ro.get("delta_p") or {}).get("mean"))])
    page.table(["model", "verdict", "positions", "lowest cosine", "failing", "KLD mean", "PPL ratio", "mean Δp"], rows, "llrrrrrr")
    for e in entries:
        if e.outcome != "PASS":
            msg = e.receipt["gated"]["message"] if e.receipt is not None else e.message
            page.p(f"{_cell_name(e)}: {e.outcome}")
            page.code(untrusted(msg) or e.outcome)
    return page.to_markdown()


def _case(suite: ET.Element, classname: str, name: str, status: str, message: str) -> None:
    """A ``testcase``; ``status`` ``ok``, ``fail`` (a ``failure``), ``unmeasured`` (``skipped``) or
    ``error`` (an ``error``), the message in the element's ``message`` attribute and text."""
    case = ET.SubElement(suite, "testcase", classname=classname, name=untrusted(name), time="0")
    tag = {"fail": "failure", "unmeasured": "skipped", "error": "error"}.get(status)
    if tag:
        el = ET.SubElement(case, tag, message=untrusted(message)[:500])
        el.text = untrusted(message)


def junit_xml(entries: Sequence[CiEntry]) -> str:
    """JUnit XML (module docstring) of ``entries``, as a UTF-8 string with an XML declaration."""
    root = ET.Element("testsuites", name="harness parity")
    for e in entries:
        suite = ET.SubElement(root, "testsuite", name=untrusted(_cell_name(e)))
        cls = "harness.parity." + untrusted(e.spec if e.receipt is None else e.receipt["model"]["name"])
        if e.receipt is None:
            _case(suite, cls, "run", "error", f"{e.outcome}: {e.message}")
        else:
            g = e.receipt["gated"]
            verdict = g["verdict"]
            if verdict not in ("PASS", "FAIL", "UNMEASURED"):  # a receipt written for an error verdict
                _case(suite, cls, "run", "error", f"{verdict}: {g['message']}")
            for tier in ("release", "calibrated"):
                t = g.get(tier) or {}
                status = t.get("status", "unmeasured")
                _case(suite, cls, f"{tier} tier" if tier == "calibrated" else "release gate", status if status in ("ok", "fail") else "unmeasured",
                      t.get("line") or t.get("reason") or status)
            judged = verdict in ("PASS", "FAIL")
            for p in e.receipt.get("per_prompt", []):
                fails = p.get("failing_positions") or 0
                if fails:
                    status, msg = "fail", (f"{fails} of {p['positions']} positions below the cosine threshold; first at position "
                                           f"{p.get('first_failing_position')}, lowest cosine {fmt.cosine(p.get('min_cosine'))}")
                elif judged:
                    status, msg = "ok", ""
                else:
                    status, msg = "unmeasured", f"the cell is {verdict}: {g['message']}"
                _case(suite, cls, f"prompt {p['id']}", status, msg)
        cases = suite.findall("testcase")
        suite.set("tests", str(len(cases)))
        for tag, attr in (("failure", "failures"), ("error", "errors"), ("skipped", "skipped")):
            suite.set(attr, str(sum(1 for c in cases if c.find(tag) is not None)))
    for attr in ("tests", "failures", "errors", "skipped"):
        root.set(attr, str(sum(int(s.get(attr, "0")) for s in root)))
    ET.indent(root)
    return ET.tostring(root, encoding="unicode", xml_declaration=True) + "\n"


__all__ = ["CiEntry", "junit_xml", "markdown_summary"]


def write_summaries(entries: Sequence[CiEntry], summary_md: str | None, junit: str | None, step_summary: str | None) -> None:
    """Write the Markdown summary (``markdown_summary``) to ``summary_md`` and the JUnit XML
    (``junit_xml``) to ``junit``, and append the Markdown to ``step_summary`` (the file GitHub
    Actions names in ``$GITHUB_STEP_SUMMARY``); each only when given, nothing without entries.
    Raises ``InvalidInput`` (one line) when a file cannot be written."""
    from pathlib import Path

    from harness.errors import InvalidInput

    if not (summary_md or junit or step_summary) or not entries:
        return
    md = markdown_summary(entries)
    try:
        if summary_md:
            Path(summary_md).write_text(md, encoding="utf-8")
        if junit:
            Path(junit).write_text(junit_xml(entries), encoding="utf-8")
        if step_summary:
            with open(step_summary, "a", encoding="utf-8") as f:
                f.write(md)
    except OSError as e:
        raise InvalidInput(f"cannot write the CI summary: {untrusted(e)}") from None
