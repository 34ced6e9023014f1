"""Writing the file: every measured value as a thresholds.yaml entry with its basis, the known-bad ×
gates matrix as markdown, and the atomic write (``write_thresholds``) and merges of probe and
top-k rows into an existing file. Part of ``harness.runs.calibrate``."""

from __future__ import annotations

import datetime
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from harness.runs.calibrate.fit import PairStats, _round_up, bootstrap_by_prompt
from harness.runs.calibrate.plan import MARGIN, MIN_STEP, MOE_EXCURSION_MARGIN, MOE_EXCURSION_MIN, MOE_ROUTER_MAX_GAP, RELEASE


@dataclass
class CalibrationResult:
    """Measured pairs, one row per weights key × class, probe/localization tolerances, the
    known-bad × gates matrix (at f64, the mutants' own class) and the per-class detection matrix."""

    goods: list[PairStats]
    bads: list[PairStats]
    rows: list[dict[str, Any]]
    probes: dict[str, dict[str, dict[str, Any]]]
    localization: dict[str, dict[str, Any]]
    matrix: dict[str, dict[str, bool]]
    class_matrix: dict[str, dict[str, str]]
    skipped: list[str]
    problems: list[str]
    moe_excursions: dict[str, Any] | None = None
    weights_probes: dict[str, dict[str, dict[str, dict[str, Any]]]] = field(default_factory=dict)
    """Quantized weights key → class → probe tolerances (``weights_probe_floors``): a row of that
    key takes these instead of its class's ``probes``."""

    def probes_for(self, weights: str, cls: str) -> dict[str, dict[str, Any]] | None:
        """The probe tolerances a row of ``weights`` × ``cls`` carries (None: none measured)."""
        return row_probes(self.probes, self.weights_probes, weights, cls)


def row_probes(probes: dict[str, dict[str, dict[str, Any]]], by_weights: dict[str, dict[str, dict[str, dict[str, Any]]]] | None,
               weights: str, cls: str) -> dict[str, dict[str, Any]] | None:
    """The probe tolerances of a row of ``weights`` × ``cls``: ``by_weights[weights][cls]``
    (``weights_probe_floors``) where measured for its weights key, else the class's ``probes[cls]``
    (None: neither)."""
    return (by_weights or {}).get(weights, {}).get(cls) or probes.get(cls)

    @property
    def gates(self) -> dict[str, dict[str, Any]]:
        """The f64 row on F32 weights (the oracle's class on the default model's file type)."""
        return next(r["gates"] for r in self.rows if r["weights"] == "F32" and r["class"] == "f64" and r.get("arch", "qwen35") == "qwen35")


# ------------------------------------------------------------------------------- writing
def _basis(command: str, n: int, model: str, floor: float, bads: list[tuple[float, str]], note: str,
           threshold: float | None = None, lower_is_bad: bool = True) -> dict[str, Any]:
    """A measured basis. ``known_bad`` lists the known-bad values this gate separates (beyond
    ``threshold``), closest first; the ones it misses are named in the note."""
    vals = [(float(v), w) for v, w in bads if v is not None and math.isfinite(v)]
    if threshold is not None:
        sep = [(v, w) for v, w in vals if (v < threshold if lower_is_bad else v > threshold)]
        missed = [w for v, w in vals if (v, w) not in sep]
        if missed:
            note += f" Missed by this gate alone (caught by another, or below this class's floor): {', '.join(missed)}."
        vals = sep
    known_bad = [{"value": v, "what": w} for v, w in vals][:12]
    if not known_bad:
        known_bad = [{"value": float(floor), "what": "no known-bad value separated by this gate alone (see note)"}]
    return {"kind": "measured", "command": command, "n": int(n), "model": model, "date": datetime.date.today().isoformat(),
            "known_good_floor": float(floor), "known_bad": known_bad, "note": note}


def _row_document(r: dict[str, Any], res: CalibrationResult, command: str, commit_txt: str) -> dict[str, Any]:
    g = r["gates"]
    n = sum(p.n for p in r["goods"])
    model = r["basis_models"][0]["name"]
    goods_txt = "; ".join(f"{p.label} on {p.model}: min cos {p.min_cosine:.8f}, KLD mean {p.kld_mean:.3g}, p99 {p.kld_p99:.3g}" for p in r["goods"])
    f32_mutants = r["weights"] == "F32"
    bads = [b for b in res.bads if b.extra.get("arch", r.get("arch")) == r.get("arch")] if f32_mutants else []
    bad_cos = [(b.min_cosine, b.label) for b in sorted(bads, key=lambda b: -b.min_cosine)]
    bad_km = [(b.kld_mean, b.label) for b in sorted(bads, key=lambda b: b.kld_mean)]
    bad_kp = [(b.kld_p99, b.label) for b in sorted(bads, key=lambda b: b.kld_p99)]
    where = f"Known-bad values are the mutants' (F32 trained {r.get('arch')} models)." if f32_mutants else \
        "No mutant runs on this file type; the per-class mutant matrix is measured on F32."
    doc = {
        "weights": r["weights"], "class": r["class"], "file_type": ", ".join(r["file_types"]),
        "basis_models": [{k: d[k] for k in ("name", "sha256", "arch", "n_layer", "n_embd")} for d in r["basis_models"]],
        "gates": {
            "min_cosine": {"value": g["min_cosine"]["value"], "basis": _basis(command, n, model, g["min_cosine"]["floor"], bad_cos,
                           f"1 - {MARGIN}x(1 - lower 95% bootstrap CI by prompt {g['min_cosine']['ci']:.8f}), at most 1 - {MIN_STEP['min_cosine']:g}, "
                           "never below the release floor. "
                           f"Known-good ({r['class']}): {goods_txt}. {where}{commit_txt}", g["min_cosine"]["value"], True)},
            "max_kld_mean": {"value": g["max_kld_mean"]["value"], "basis": _basis(command, n, model, g["max_kld_mean"]["floor"], bad_km,
                             f"{MARGIN}x upper 95% bootstrap CI by prompt ({g['max_kld_mean']['ci']:.3g}) of the known-good KLD mean, at least "
                             f"{MIN_STEP['max_kld_mean']:g}.{commit_txt}",
                             g["max_kld_mean"]["value"], False)},
            "max_kld_p99": {"value": g["max_kld_p99"]["value"], "basis": _basis(command, n, model, g["max_kld_p99"]["floor"], bad_kp,
                            f"{MARGIN}x upper 95% bootstrap CI by prompt ({g['max_kld_p99']['ci']:.3g}) of the known-good KLD p99, at least "
                            f"{MIN_STEP['max_kld_p99']:g}.{commit_txt}",
                            g["max_kld_p99"]["value"], False)},
        },
    }
    pr = res.probes_for(r["weights"], r["class"])
    if pr:
        split_bads = [(0.0, b.label) for b in res.bads if b.extra.get("probe_split")]
        doc["probes"] = probe_document(r["class"], pr, command, res.goods[0].model, split_bads, commit_txt)
    return doc


def _floors_text(v: dict[str, Any]) -> str:
    return "; ".join(f"{label}: min cos {c:.10f}, max KLD {k:.3g}" for label, (c, k) in v.get("engines", {}).items())


def probe_document(cls: str, pr: dict[str, dict[str, Any]], command: str, model: str, split_bads: list[tuple[float, str]],
                   commit_txt: str) -> dict[str, Any]:
    """A row's ``probes`` section (``min_cosine``, ``max_kld``, each with its basis) from the
    class's ``probe_floors`` result; ``split_bads``: (value, what) of the mutants the split probe
    fails, the known-bad side of the basis."""
    tokens = pr["min_cosine"].get("decode_tokens")
    decode = f"decode over {tokens} tokens one per call" if tokens else "decode"
    ub = " and n_ubatch 7" if cls in ("f32", "mixed") else ""
    n = pr["min_cosine"].get("n", 1)
    model = ", ".join([model, *pr["min_cosine"].get("models", [model])[1:]])
    return {
        "min_cosine": {"value": pr["min_cosine"]["value"], "basis": _basis(command, n, model, pr["min_cosine"]["floor"], split_bads,
                       f"20x (in 1 - cosine) the {cls} engines' own floor across split points, {decode}{ub} "
                       f"({_floors_text(pr['min_cosine'])}); known-bad: mutants the split probe fails.{commit_txt}")},
        "max_kld": {"value": pr["max_kld"]["value"], "basis": _basis(command, n, model, pr["max_kld"]["floor"], [(1.0, w) for _, w in split_bads],
                    f"50x the {cls} engines' own max KLD across split points, {decode}{ub}.{commit_txt}")},
    }


def moe_excursions_document(ex: dict[str, Any], command: str, commit_txt: str) -> dict[str, Any]:
    """thresholds.yaml ``probes.moe_excursions`` with its basis, from ``moe_excursions``."""
    counts = "; ".join(f"{label}: {c}" for label, c in ex["engines"].items())
    return {"value": int(ex["value"]), "basis": {
        "kind": "measured", "command": command, "n": int(ex["n"]), "model": ex["model"], "date": datetime.date.today().isoformat(),
        "known_good_floor": float(ex["floor"]),
        "known_bad": [{"value": float(ex["decode_tokens"] - 1), "what": "a state dropped or drifting between calls (mutant:ssm-state-reset, "
                       "a recurrent state rounded to bf16): up to every position after the first call leaves the bounds"}],
        "note": (f"{MOE_EXCURSION_MARGIN}x (at least {MOE_EXCURSION_MIN}: a 97-token counting prompt gives llama.cpp a 9-position burst on tiny-qwen35moe) the most positions of one split or {ex['decode_tokens']}-token decode "
                 f"comparison that a known-good f32 engine had outside the f32 probe bounds on these MoE models ({counts}; lowest cosine "
                 f"{ex['min_cosine']:.6f}): an expert-router near-tie picks another expert when the prompt is fed in other pieces. The burst must end before the comparison's last position: a state fault lasts to it."
                 + (f" Not measured (the engine cannot load the model): {', '.join(ex['skipped'])}." if ex.get("skipped") else "")
                 + commit_txt)}}


def merge_probe_rows(path: str | Path, probes: dict[str, dict[str, dict[str, Any]]], ex: dict[str, Any] | None, command: str,
                     base_model: str, commit: str | None, by_weights: dict[str, dict[str, dict[str, dict[str, Any]]]] | None = None) -> Path:
    """thresholds.yaml at ``path`` with every calibrated row's ``probes`` section of a class in
    ``probes`` replaced (known-bad sides kept from the file): ``by_weights[weights][class]``
    (``weights_probe_floors``) where measured for the row's weights key, else ``probes[class]``;
    with ``ex``, ``probes.moe_excursions``; every other number kept; written by
    ``write_thresholds``."""
    from harness.fschecks import new_file_mode
    from harness.judge.thresholds import load_thresholds

    commit_txt = f" harness commit {commit}." if commit else ""
    doc = dict(load_thresholds(path).data)
    for row in doc.get("calibrated", []):
        if row["class"] in probes:
            old = row.get("probes", {}).get("min_cosine", {}).get("basis", {}).get("known_bad", [])
            bads = [(0.0, b["what"]) for b in old if str(b.get("what", "")).startswith("mutant:")]
            pr = row_probes(probes, by_weights, row["weights"], row["class"])
            row["probes"] = probe_document(row["class"], pr, command, base_model, bads, commit_txt)
    if ex is not None:
        doc["probes"] = {**doc.get("probes", {}), "moe_excursions": moe_excursions_document(ex, command, commit_txt)}
    doc["probes"] = {**doc.get("probes", {}), "moe_router_max_gap": doc.get("probes", {}).get("moe_router_max_gap", MOE_ROUTER_MAX_GAP)}
    return write_thresholds(doc, path)


def thresholds_document(res: CalibrationResult, command: str, commit: str | None, near_tie_margin: float = 0.25) -> dict[str, Any]:
    """The thresholds.yaml (``harness-thresholds/v2``) content: the declared release gate, the
    localization bounds and one measured row per weights key × class."""
    commit_txt = f" harness commit {commit}." if commit else ""
    base = res.goods[0].model
    loc_bads = [b for b in res.bads if b.extra.get("localize")]
    lz = res.localization
    doc = {
        "schema": "harness-thresholds/v2",
        "report_only": {"near_tie_margin": near_tie_margin},
        "release": RELEASE,
        "probes": {
            "localize_max_nmse": {"value": lz["localize_max_nmse"]["value"], "basis": _basis(command, lz["localize_max_nmse"]["n"], base,
                                  lz["localize_max_nmse"]["floor"], [(1.0, f"{b.label} (first divergence {b.extra.get('first_divergence')})") for b in loc_bads],
                                  "100x the largest per-tensor NMSE of llama.cpp (F32) against the oracle." + commit_txt)},
            "localize_min_cosine": {"value": lz["localize_min_cosine"]["value"], "basis": _basis(command, lz["localize_min_cosine"]["n"], base,
                                    lz["localize_min_cosine"]["floor"], [(0.0, b.label) for b in loc_bads],
                                    "1 - 100x(1 - smallest per-tensor cosine of llama.cpp (F32) against the oracle), at most 0.9999." + commit_txt)},
        },
        "calibrated": [_row_document(r, res, command, commit_txt) for r in res.rows],
    }
    if res.moe_excursions is not None:
        doc["probes"]["moe_excursions"] = moe_excursions_document(res.moe_excursions, command, commit_txt)
    doc["probes"]["moe_router_max_gap"] = MOE_ROUTER_MAX_GAP
    return doc


MATRIX_KEPT_FROM = "\n## "
"""Where the sections of docs/gates-matrix.md that the full calibration does not measure start (the
MTP, speculative and precision mutants' tables, each measured by its own command and named there):
``matrix_markdown`` keeps them as they are."""


def kept_matrix_sections(old: str) -> str:
    """The part of an existing matrix page (``old``: its text, "" when there is none) from its first
    second-level heading on: the sections a full calibration does not write, kept verbatim."""
    at = old.find(MATRIX_KEPT_FROM)
    return "" if at < 0 else old[at:]


def matrix_markdown(res: CalibrationResult, command: str, kept: str = "") -> str:
    """The per-class detection matrix as Markdown: each mutant caught (by which gates) or below
    the class floor, per class, with its numbers (``class_detection``), then ``kept``
    (``kept_matrix_sections`` of the page it replaces)."""
    classes = list(res.class_matrix)
    lines = ["# Mutants × compute classes: caught, or below the class floor", "",
             f"Written by `{command}` ({datetime.date.today().isoformat()}). Each mutant runs against llama.cpp on the F32 trained",
             "fixture of its architecture; a cell says which gates of that class's F32 row (`cosine`, `kld_mean`, `kld_p99`),",
             "probes (`probe_split`, `probe_decode`, `probe_determinism`) or first-divergence localization (`localize`) catch it,",
             "or that its logits are **below the class floor**: within what a correct engine of that class produces.", "",
             "| mutant | " + " | ".join(classes) + " |", "|---|" + "---|" * len(classes)]
    for b in res.bads:
        lines.append(f"| `{b.label}` | " + " | ".join(res.class_matrix[c].get(b.label, "-") for c in classes) + " |")
    return "\n".join(lines) + "\n" + kept


HEADER = (
    "# Every number that gates a verdict, each with its basis (docs/gates.md).\n"
    "# Written by `harness calibrate` (harness/runs/calibrate/): the release gate is a declared floor;\n"
    "# every calibrated row is measured (command, n, known-good floor, known-bad values it separates) for one\n"
    "# weights key x compute class. Schema: harness/schemas/thresholds.schema.json. Edit by re-running\n"
    "# calibration, or replace a value with a declared basis (who, why) -- a number without a basis refuses\n"
    "# to gate (exit 2), and no row may be looser than the release floor.\n"
)


def write_thresholds(doc: dict[str, Any], path: str | Path) -> Path:
    """Write ``doc`` as thresholds.yaml (header comment + YAML) atomically, then validate it by
    loading it back (``InvalidInput`` if it does not validate)."""
    import os
    import tempfile

    from harness.fschecks import new_file_mode
    from harness.judge.thresholds import load_thresholds

    path = Path(path)
    text = HEADER + yaml.safe_dump(doc, sort_keys=False, width=100, allow_unicode=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".thresholds.", suffix=".tmp")
    os.fchmod(fd, new_file_mode())  # mkstemp makes 0600; thresholds.yaml follows the umask (0644 under 022)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    try:
        load_thresholds(tmp)
    except Exception:
        os.unlink(tmp)
        raise
    os.replace(tmp, path)
    return path


KEPT_SECTIONS = ("topk", "mtp", "state")
"""The thresholds.yaml sections a full calibration keeps from the file it replaces: each is
measured by its own command (``harness calibrate --topk K``, ``--mtp``, ``--state``) with its own
basis."""

KEPT_PROBES = ("spec_max_acceptance_drop", "spec_min_reference_accepted")
"""The ``probes:`` entries a full calibration keeps from the file it replaces: the speculative
probe's acceptance gate, measured by ``harness calibrate --speculative`` (its own basis) and not
by the full calibration."""


def kept_probes(path: str | Path) -> dict[str, Any]:
    """The ``KEPT_PROBES`` entries of the ``probes:`` section of the thresholds file at ``path``
    (each as the file has it, basis included); none when the file is absent or unreadable."""
    from harness.errors import HarnessError
    from harness.judge.thresholds import load_thresholds

    try:
        probes = load_thresholds(path).data.get("probes", {}) if Path(path).is_file() else {}
    except HarnessError:
        return {}
    return {k: probes[k] for k in KEPT_PROBES if k in probes}


def section_rows(path: str | Path, section: str) -> list[Any]:
    """The ``section`` rows (``calibrated``, ``topk``, ``mtp``, ``state``) of the thresholds file at
    ``path`` as the file has them; none when the file is absent. Raises ``InvalidInput`` for a file
    ``load_thresholds`` refuses: ``harness calibrate --probes`` reads each quantized weights key's
    file from the ``calibrated`` rows it will merge into (``weights_probe_files``), and a file it
    cannot merge into is refused before half an hour of measuring, not after."""
    from harness.judge.thresholds import load_thresholds

    return list(load_thresholds(path).data.get(section, [])) if Path(path).is_file() else []


def kept_rows(path: str | Path, section: str) -> list[Any]:
    """The ``section`` rows of the thresholds file at ``path`` (``KEPT_SECTIONS``); none when it
    is absent or unreadable."""
    from harness.errors import HarnessError

    try:
        return section_rows(path, section)
    except HarnessError:
        return []


def write_calibration(res: CalibrationResult, out: str | Path, matrix_out: str | Path, command: str, commit: str | None) -> tuple[Path, Path]:
    """Write a full calibration: thresholds.yaml at ``out`` (``thresholds_document`` with the
    ``KEPT_SECTIONS`` and ``KEPT_PROBES`` of the file it replaces, ``write_thresholds``) and the detection matrix
    page at ``matrix_out`` (``matrix_markdown``, keeping the page's hand-measured sections:
    ``kept_matrix_sections``). Returns both paths. Raises ``InvalidInput`` when the document does
    not validate (nothing is replaced then) and ``OSError`` when a file cannot be written."""
    doc = thresholds_document(res, command, commit)
    doc["probes"].update(kept_probes(out))
    for section in KEPT_SECTIONS:
        doc[section] = kept_rows(out, section)
        if not doc[section]:
            del doc[section]
    write_thresholds(doc, out)
    matrix = Path(matrix_out)
    old = matrix.read_text(encoding="utf-8", errors="replace") if matrix.is_file() else ""
    matrix.write_text(matrix_markdown(res, command, kept_matrix_sections(old)))
    return Path(out), matrix


def _topk_row(k: int, cls: str, gs: list[PairStats], bads: list[PairStats], command: str, base_spec: str,
              commit_txt: str) -> tuple[dict[str, Any], list[str], list[str]]:
    """One ``topk:`` row from the class's known-good top-k pairs (``propose``'s rule on the KLD
    mean and p99, never tighter than ``MIN_STEP``), the mutants passing both its gates, and the good
    pairs lying past it."""
    hi_mean = max(bootstrap_by_prompt(g, "kld_mean")[1] for g in gs)
    hi_p99 = max(bootstrap_by_prompt(g, "kld_p99")[1] for g in gs)
    # never tighter than MIN_STEP, as the calibrated rows: a top-k KLD (the tail one bucket) is at most the full
    # KLD, so float32 noise that the calibrated tier allows must pass here too (llama-server at its own settings on
    # fixture:trained-qwen35 measured top-20 KLD mean 7.8e-7, p99 8.2e-6 against a row floored at 1e-7)
    gate_mean = _round_up(max(MARGIN * hi_mean, MIN_STEP["max_kld_mean"]))
    gate_p99 = _round_up(max(MARGIN * hi_p99, MIN_STEP["max_kld_p99"]))
    n = sum(g.n for g in gs)
    goods_txt = "; ".join(f"{g.label} on {g.model}: top-{k} KLD mean {g.kld_mean:.3g}, p99 {g.kld_p99:.3g}" for g in gs)
    late = [f"{g.label} on {g.model} lies past its top-{k} row" for g in gs if g.kld_mean > gate_mean or g.kld_p99 > gate_p99]
    passing = [b.label for b in bads if b.kld_mean <= gate_mean and b.kld_p99 <= gate_p99]
    note = (f"{MARGIN}x upper 95% bootstrap CI by prompt of the known-good pairs cut to their top {k} logprobs "
            f"(harness.measure.topk: KLD with the tail as one bucket), at least the calibrated rows' smallest step "
            f"(KLD mean {MIN_STEP['max_kld_mean']:g}, p99 {MIN_STEP['max_kld_p99']:g}: a top-k KLD is at most the full KLD, so "
            f"float32 noise the calibrated tier allows passes here too). Known-good ({cls}): {goods_txt}. Known-bad: the mutants "
            f"on {', '.join(sorted({b.model for b in bads})) or 'no model'} (the model of their architecture), cut the same way"
            + ("" if gs[0].weights == "F32" else
               f"; on {gs[0].weights} weights a mutant's KLD includes the oracle's own distance from llama.cpp there (the mutants "
               "are the oracle with one fault, and llama.cpp quantizes its activations), so a row tighter than the oracle's own "
               "floor catches every mutant whatever its fault")
            + f".{commit_txt}")
    dims = {g.model: g.extra["dims"] for g in gs}
    row = {
        "weights": gs[0].weights, "class": cls, "k": int(k), "file_type": gs[0].extra["file_type"],
        "basis_models": [{kk: d[kk] for kk in ("name", "sha256", "arch", "n_layer", "n_embd")} for d in dims.values()],
        "gates": {
            "max_topk_kld_mean": {"value": gate_mean, "basis": _basis(command, n, base_spec, max(g.kld_mean for g in gs),
                                  [(b.kld_mean, b.label) for b in sorted(bads, key=lambda b: b.kld_mean)], note, gate_mean, False)},
            "max_topk_kld_p99": {"value": gate_p99, "basis": _basis(command, n, base_spec, max(g.kld_p99 for g in gs),
                                 [(b.kld_p99, b.label) for b in sorted(bads, key=lambda b: b.kld_p99)], note, gate_p99, False)},
        },
    }
    return row, passing, late


def merge_topk_rows(path: str | Path, rows: list[dict[str, Any]]) -> Path:
    """thresholds.yaml at ``path`` with ``rows`` replacing the top-k rows of the same weights ×
    class × k (every other number kept as it is), written by ``write_thresholds``."""
    from harness.fschecks import new_file_mode
    from harness.judge.thresholds import load_thresholds

    doc = dict(load_thresholds(path).data)
    keys = {(r["weights"], r["class"], r["k"]) for r in rows}
    kept = [r for r in doc.get("topk", []) if (r["weights"], r["class"], r["k"]) not in keys]
    doc["topk"] = kept + rows
    return write_thresholds(doc, path)


def merge_rows(path: str | Path, section: str, rows: list[dict[str, Any]]) -> Path:
    """thresholds.yaml at ``path`` with ``rows`` replacing the ``section`` rows (``mtp``, ``state``)
    of the same weights × class × architecture (other rows of it and every other section kept as
    they are), written by ``write_thresholds`` (atomic, validated by loading it back)."""
    from harness.judge.thresholds import load_thresholds

    def key(r: dict[str, Any]) -> tuple[str, str, tuple[str, ...]]:
        return r["weights"], r["class"], tuple(sorted({str(m.get("arch")) for m in r["basis_models"]}))

    doc = dict(load_thresholds(path).data)
    new = {key(r) for r in rows}
    doc[section] = [r for r in doc.get(section, []) if key(r) not in new] + list(rows)
    return write_thresholds(doc, path)
