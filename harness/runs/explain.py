"""Explaining a receipt: what its verdict page needs beyond the receipt, looked up here because it
reads the model and may run engines (``harness.evidence.report`` only reads and renders).

- the model's vocabulary (``harness.model.vocab``) for token texts, from the model file whose
  sha256 is still the receipt's (``model_file``: the recorded path, else the fixture of that name);
- on a FAIL whose candidate declares ``activations``: first-divergence localization against the
  oracle (``harness.runs.localize``) on the receipt's own token ids
  (``report.localization_plan``), and the likely cause (``harness.judge.causes``).

``explain`` is what ``harness parity`` and ``harness probe`` hand the evidence door with their receipt
(the door writes the verdict page before the reports index); ``write_explained_report`` is what
``harness report RECEIPT`` calls.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Mapping

from harness.errors import HarnessError, InvalidInput
from harness.evidence.index import refresh_index_quietly
from harness.evidence.page import untrusted
from harness.evidence.receipts import PROBE_SCHEMA_ID, SCHEMA_ID, load_receipt, receipts_root
from harness.evidence.report import (
    Explanation,
    has_activations,
    localization_plan,
    write_report,
)
from harness.fixtures import synthetic as fx
from harness.judge.causes import OPS, likely_causes
from harness.model.gguf_model import GGUFModel
from harness.model.vocab import Vocab
from harness.provenance import sha256_file
from harness.runs.localize import LocalizeRequest, run_localize

Log = Callable[[str], None]


def model_file(model: Mapping[str, Any]) -> tuple[Path | None, str]:
    """The GGUF file of a receipt's ``model`` (path, name, sha256), and why none when none.

    ``model.path`` is used only if its sha256 is still the receipt's (a moved or replaced file
    would give wrong token texts and a wrong localization); a ``fixture:NAME`` model is also
    looked up where fixtures live (never built). Never raises.
    """
    candidates: list[Path] = []
    if model.get("path"):
        candidates.append(Path(model["path"]))
    name = str(model.get("name") or "")
    if name.startswith("fixture:") and name.removeprefix("fixture:") in fx.fixture_names():
        try:
            candidates.append(Path(fx.fixture_path(name.removeprefix("fixture:"))))
        except (HarnessError, KeyError, ValueError, OSError):
            pass
    why = "the model file is not on this machine"
    for path in candidates:
        try:
            if not path.is_file():
                continue
            if model.get("sha256") and sha256_file(path) != model["sha256"]:
                why = f"{path.name} no longer has the receipt's sha256"
                continue
            return path, ""
        except (HarnessError, OSError) as e:
            why = f"cannot read {path.name} ({e})"
    return None, why


def vocabulary(model: Mapping[str, Any], opened: GGUFModel | None = None) -> tuple[Vocab | None, str]:
    """The vocabulary of a receipt's ``model`` (``model_file``), or None and why. Never raises.
    ``opened``: the run's own ``GGUFModel`` of that file, used when its path and sha256 are the
    receipt's (opening the file again parses every key: 0.2 s at Qwen3.5's vocabulary, issue 47)."""
    same = (opened is not None and str(model.get("path") or "") == str(opened.path) and opened.sha256 == model.get("sha256"))
    path, why = (opened.path, "") if same else model_file(model)
    if path is None:
        return None, why
    try:
        gm = opened if same else GGUFModel(path)
        tokens = gm.token_texts  # read token by token: a page shows a few
        kind = gm.raw_metadata("tokenizer.ggml.model")
    except HarnessError as e:
        return None, f"cannot read the model's vocabulary ({untrusted(e)})"
    if not tokens:
        return None, "the model has no tokenizer.ggml.tokens"
    return Vocab(tokens, kind), ""


def divergent_side(rec: Mapping[str, Any]) -> str:
    """Whose divergence a receipt's FAIL is: ``"reference"`` when the candidate is the exact
    oracle itself, or when the release gate found the reference off the oracle
    (``gated.release.oracle_referee.reference_off_oracle``, ``harness.runs.referee``), else
    ``"candidate"``. That side is localized against the oracle."""
    if str(rec["engines"]["candidate"].get("name")) == "oracle":
        return "reference"
    ruling = ((rec.get("gated") or {}).get("release") or {}).get("oracle_referee") or {}
    return "reference" if ruling.get("reference_off_oracle") else "candidate"


def localize_receipt(rec: Mapping[str, Any], plan: Mapping[str, Any]) -> dict[str, Any]:
    """First-divergence localization of the receipt's candidate against the oracle on ``plan``
    (``localization_plan``: token ids and pieces); ``Localization.to_dict()`` plus the plan.

    Raises ``InvalidInput`` (model file gone or changed, engine without activations) and
    ``EngineError``.
    """
    path, why = model_file(rec["model"])
    if path is None:
        raise InvalidInput(f"cannot localize: {why}")
    th = (rec.get("thresholds") or {}).get("file")
    side = divergent_side(rec)
    req = LocalizeRequest(model=str(path), candidate=rec["engines"][side]["name"], tokens=list(plan["tokens"]),
                          chunks=plan["chunks"], max_tokens=len(plan["tokens"]), overrides=list(rec["model"].get("overrides") or []),
                          thresholds=th if th and Path(th).is_file() else None)
    loc = run_localize(req).to_dict()
    loc["divergent"] = side
    loc["plan"] = {k: v for k, v in plan.items() if k != "tokens"}
    return loc


def _localization(rec: Mapping[str, Any], localize: bool | str, log: Log | None) -> tuple[dict[str, Any] | None, str]:
    """(localization or None, why there is none) following ``localize`` (True, False, "auto":
    a FAIL whose candidate has activations)."""
    if rec.get("schema") not in (SCHEMA_ID, PROBE_SCHEMA_ID):
        return None, "Not localized: an MTP or tokenizer receipt has no trunk logits to localize."
    verdict = rec["verdict"] if rec.get("schema") == PROBE_SCHEMA_ID else rec["gated"]["verdict"]
    cand = untrusted(rec["engines"]["candidate"]["name"])
    if not has_activations(rec):
        return None, (f"Not localized: the candidate {cand} does not declare the activations capability. An engine that "
                      "returns its named activations (llama.cpp's graph names; capability activations in the engine protocol, "
                      "docs/engine-protocol.md) can be localized layer by layer against the oracle.")
    if localize is False or (localize == "auto" and verdict != "FAIL"):
        return None, "Not localized in this report (the verdict is not FAIL); localize by hand with the command below."
    plan = localization_plan(dict(rec))
    if plan is None:
        return None, "Not localized: the receipt names no failing position to localize."
    if log:
        log(f"localizing {cand} against the oracle on {len(plan['tokens'])} tokens ...")
    try:
        return localize_receipt(rec, plan), ""
    except HarnessError as e:
        return None, f"Localization could not run here ({e.verdict.value}: {untrusted(e)}); run it by hand with the command below."


def explain(rec: Mapping[str, Any], localize: bool | str = "auto", log: Log | None = None,
            model: GGUFModel | None = None) -> Explanation:
    """Everything a verdict page shows beyond the receipt ``rec`` (a receipt as written, or as a
    run hands it to the evidence door: ``schema`` missing means a parity receipt): the vocabulary
    for token texts, the localization ``localize`` asks for, the likely causes
    (``Explanation``). A localization that cannot run is explained in ``loc_note``, not raised.
    ``model``: the run's open ``GGUFModel`` of the receipt's file, if the caller has it
    (``vocabulary``)."""
    rec = {"schema": SCHEMA_ID, **rec}
    vocab, vocab_note = vocabulary(rec["model"], model)
    loc, loc_note = _localization(rec, localize, log)
    ex = Explanation(vocab=vocab, vocab_note=vocab_note, localization=loc, loc_note=loc_note)
    first = (loc or {}).get("first_divergence")
    if first:
        ex.op_meaning = OPS.get(first.get("op") or "")
        ex.causes = [{"mutant": c.mutant, "bug_class": c.bug_class, "description": c.description}
                     for c in likely_causes(first.get("layer_type"), first.get("op"))]
    return ex


def explain_receipt(receipt_path: str | Path, localize: bool | str = "auto", log: Log | None = None) -> Explanation:
    """``explain`` of the receipt file at ``receipt_path``. Raises ``InvalidInput`` for an
    unreadable or invalid receipt."""
    return explain(load_receipt(receipt_path).receipt, localize, log)


def write_explained_report(receipt_path: str | Path, out_dir: str | Path | None = None, localize: bool | str = "auto",
                           log: Log | None = None) -> Path:
    """``explain_receipt`` then ``write_report``; the Markdown path. A page written to its default
    folder beside a ledger regenerates that ledger's reports index (a failure there is a warning).
    Raises as they do."""
    md = write_report(receipt_path, out_dir, explanation=explain_receipt(receipt_path, localize, log))
    ledger = receipts_root(Path(receipt_path).with_suffix(".json")).parent / "ledger.jsonl"
    if out_dir is None and ledger.exists():
        refresh_index_quietly(ledger, receipt_id=Path(receipt_path).stem)
    return md
