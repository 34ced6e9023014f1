"""The two-tier gate model's data: what the calibrated tier is keyed by (``Subject``), its rows
(``Row``) and which row fits a subject (``find_row``). The judgement itself is
``harness.judge.verdicts``.

1. **Release gate** (the product's gate): per-position logit cosine ≥ ``release.min_cosine``
   (0.98) over ≥ ``release.min_positions`` (64) positions. A declared floor: it can always be
   computed, so it always gives a verdict, and no calibrated row may be looser
   (``thresholds.load_thresholds`` refuses such a row).
2. **Calibrated tier**: cosine, KLD mean, KLD p99 (parity) and the probe tolerances, from a row
   keyed by what the file's matmul weights hold (``GGUFModel.weights_key``, e.g. ``F32`` or
   ``F32+Q4_K+Q6_K``) and by the candidate's compute class (``f64``, ``f32``, ``bf16``, ``f16``,
   ``mixed``). A row fits only when both match, its basis models share the subject's
   ``general.architecture`` (``qwen35`` or ``qwen35moe``: expert routing has its own known-good
   floor, so an MoE file's row never judges a dense one of the same weights, nor the reverse) and
   the subject is at most ``MAX_SCALE`` times the row's largest basis model in ``n_layer`` and
   ``n_embd``; a row for another weights key or class is never borrowed. Where no row fits, the tier is measured on the subject itself
   (``harness calibrate --model``) or is UNMEASURED, naming the command that would measure it.

Verdict (``harness.judge.verdicts.overall``): FAIL when either tier fails; UNMEASURED when
fewer than ``release.min_positions`` positions were compared, or when the calibrated tier is
unmeasured and it was required (``--require-calibrated``, sign-off); else PASS (the release
gate's verdict, with the calibrated tier's status on its own line).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

MAX_SCALE = 2.0
"""A row measured on a model up to ``n_layer`` × ``n_embd`` fits subjects up to this many times
larger in each (a deeper, wider model accumulates more rounding: another known-good floor)."""

KLD_GATES = {"max_kld_mean": ("mean", "KLD mean"), "max_kld_p99": ("p99", "KLD p99")}
"""Distribution gates of the calibrated tier: gate name → (key of ``summary["kld"]``, label)."""
CALIBRATED_GATES = ("min_cosine", *KLD_GATES)


@dataclass(frozen=True)
class Subject:
    """What the calibrated tier is keyed by, for one run.

    ``weights``: ``GGUFModel.weights_key`` (sorted ggml types of every ≥2-D tensor, ``+``-joined);
    ``file_type``: ``general.file_type`` as llama.cpp names it (a label); ``compute_class``: the
    candidate's class (``ASSUMED_CLASS`` when it declares none, ``class_declared`` False);
    ``n_layer``/``n_embd``: the model's ``block_count``/``embedding_length``; ``arch``: its
    ``general.architecture`` (empty: not known, fits a row of any).
    """

    weights: str
    file_type: str
    compute_class: str
    class_declared: bool
    n_layer: int
    n_embd: int
    sha256: str = ""
    arch: str = ""

    def key_text(self) -> str:
        return f"weights {self.weights} ({self.file_type}), class {self.compute_class}"

    def to_dict(self) -> dict[str, Any]:
        return {"weights": self.weights, "file_type": self.file_type, "compute_class": self.compute_class,
                "class_declared": self.class_declared, "n_layer": self.n_layer, "n_embd": self.n_embd, "arch": self.arch}


@dataclass(frozen=True)
class Row:
    """One calibrated row: gates measured for one weights key × compute class.

    ``gates`` / ``probes``: ``{name: {"value": float, "basis": {...}}}``; ``basis_models``: the
    models it was measured on, each ``{"name", "n_layer", "n_embd", ...}``; ``source`` says where
    the row came from (``thresholds.yaml calibrated[3]``, or a calibration receipt id);
    ``max_tokens``: the positions per prompt it was measured over when that was bounded (a row
    measured on the subject, ``harness calibrate --model``: 128), which the calibrated tier then
    judges (a recurrent state's drift grows with the position); None: whole prompts.
    """

    weights: str
    compute_class: str
    basis_models: tuple[Mapping[str, Any], ...]
    gates: Mapping[str, Mapping[str, Any]]
    probes: Mapping[str, Mapping[str, Any]]
    source: str
    file_type: str = ""
    k: int = 0
    max_tokens: int | None = None

    @property
    def archs(self) -> frozenset[str] | None:
        """The basis models' ``general.architecture`` values, or None when one does not say (a
        row written before rows were split by architecture: it fits a subject of any)."""
        a = [m.get("arch") for m in self.basis_models]
        return None if not a or any(x is None for x in a) else frozenset(a)

    @property
    def max_dims(self) -> tuple[int, int]:
        return (max(int(m["n_layer"]) for m in self.basis_models), max(int(m["n_embd"]) for m in self.basis_models))

    def misfit(self, s: Subject) -> str | None:
        """Why this row does not fit ``s`` (None: it fits)."""
        if self.weights != s.weights:
            return f"weights {self.weights}"
        if self.compute_class != s.compute_class:
            return f"class {self.compute_class}"
        if s.arch and self.archs is not None and s.arch not in self.archs:
            return f"measured on {', '.join(sorted(self.archs))} models, not {s.arch}"
        nl, ne = self.max_dims
        if s.n_layer > MAX_SCALE * nl or s.n_embd > MAX_SCALE * ne:
            return (f"measured on models up to n_layer {nl}, n_embd {ne}; the subject's {s.n_layer} × {s.n_embd} "
                    f"exceeds {MAX_SCALE:g}× that")
        return None

    def to_receipt(self) -> dict[str, Any]:
        d = {"weights": self.weights, "compute_class": self.compute_class, "file_type": self.file_type,
             "source": self.source, "basis_models": [dict(m) for m in self.basis_models],
             "gates": {k: dict(v) for k, v in self.gates.items()}, "probes": {k: dict(v) for k, v in self.probes.items()}}
        if self.max_tokens is not None:
            d["max_tokens"] = self.max_tokens
        return d


def find_row(rows: list[Row], subject: Subject, what: str = "calibrated row") -> tuple[Row | None, str]:
    """The row that fits ``subject``, or None and why none does (one line; ``what`` names the
    kind of row in it: ``calibrated row``, ``MTP row``)."""
    same_key = [r for r in rows if r.weights == subject.weights and r.compute_class == subject.compute_class]
    for r in same_key:
        if r.misfit(subject) is None:
            return r, ""
    if same_key:
        same_arch = [r for r in same_key if not subject.arch or r.archs is None or subject.arch in r.archs]
        if not same_arch:
            return None, f"no {what} for {subject.key_text()} measured on {subject.arch} models"
        return None, f"the {what.split()[0] + ' ' if what != 'calibrated row' else ''}row for {subject.key_text()} was {same_arch[0].misfit(subject)}"
    return None, f"no {what} for {subject.key_text()}"


def find_topk_row(rows: list[Row], subject: Subject, k: int) -> tuple[Row | None, str]:
    """The top-k row that fits ``subject`` judged with ``k`` logprobs per position: same weights
    key and class, measured with at most ``k`` (the largest such k), within ``MAX_SCALE``; or
    None and why none does."""
    same_key = [r for r in rows if r.weights == subject.weights and r.compute_class == subject.compute_class]
    fitting = sorted((r for r in same_key if r.k <= k and r.misfit(subject) is None), key=lambda r: -r.k)
    if fitting:
        return fitting[0], ""
    if same_key:
        r = same_key[0]
        why = f"measured with k {r.k} > {k}" if r.k > k else r.misfit(subject)
        return None, f"the top-k row for {subject.key_text()} was {why}"
    return None, f"no top-k row for {subject.key_text()}"


def topk_calibrate_command(k: int, compute_class: str) -> str:
    """The command that measures the top-k family for one class on the F32 trained fixtures."""
    return f"harness calibrate --topk {k} --class {compute_class}"


def calibrate_command(model_spec: str, compute_class: str) -> str:
    """The command that measures the calibrated tier on the subject itself."""
    return f"harness calibrate --model {model_spec} --class {compute_class}"
