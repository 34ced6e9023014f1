"""``harness calibrate --state``: the ``state:`` rows of thresholds.yaml, the tolerance of the state
probe (``harness.runs.probes.probe_state``).

What is measured (docs/gates.md, "The state probe"):

- **The model**: ``fixture:state-qwen35`` (``harness.fixtures.synthetic.STATE_FIXTURE``), whose slow
  Gated DeltaNet decay and sharp attention make a too-narrow state or attention format visible.
- **Known-good engines**, per compute class (``STATE_KNOWN_GOOD``), each fed the shipped prompts
  (tokenized by llama.cpp, cycled to ``STATE_TOKENS``) whole and as a prefill of 16 tokens then one
  token per call, exactly as the probe feeds them; the worst position's 1 − cosine and KLD of each
  engine against itself make the class's floor. Engines whose extra is not installed
  (transformers: ``hf``; mlx: ``mlx``) are named as skipped, never silently left out.
- **Rows**: one per class, the tolerance ``propose_probes`` gives every probe (20× the floor in
  1 − cosine, 50× in KLD), at least ``STATE_MIN_STEP``.
- **Known-bad engines**: the precision mutants (``harness.engines.mutants.PRECISION_MUTANTS``,
  declared class f32) and the trunk's state faults that show in this comparison
  (``STATE_TRUNK_MUTANTS``), measured the same way; each must leave the f32 row's bounds, or
  calibration refuses (``CalibrationRefused``) and nothing is written.

Nothing else in thresholds.yaml is measured or changed: ``merge_state_rows`` replaces the ``state:``
rows of the same key and keeps every other number as it is.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from harness.errors import HarnessError, InvalidInput
from harness.measure import metrics
from harness.runs.calibrate.document import _basis, merge_rows
from harness.runs.calibrate.fit import propose_probes
from harness.runs.calibrate.plan import CalibrationRefused, _llama, _lowp, _mlx, _oracle, _transformers, have_module

STATE_TOKENS = 256
"""Tokens the state probe feeds (the rows' ``max_tokens``): on ``fixture:state-qwen35`` a state
rounded to bf16 between calls leaves a correct f32 engine's floor ~100x behind within 80 calls."""

STATE_MIN_STEP = {"f64": (1e-8, 1e-8)}
"""Per class, the smallest state-row tolerance (1 − cosine, KLD); ``(1e-6, 1e-6)`` for a class not
listed. The oracle's own floor is exact, so f64 takes the step: 1e-8 in KLD rather than the probes'
1e-9 because run-to-run noise of 1e-6 relative (``mutant:nondeterministic``, which the determinism
probe judges) reaches KLD 1.1e-9 over this comparison, and a bound at that noise would judge it
by chance."""

STATE_TRUNK_MUTANTS = ("ssm-state-reset", "conv-state-dropped")
"""Trunk mutants whose fault is between calls, measured as known-bad beside the precision mutants."""


STATE_KNOWN_GOOD: dict[str, list[tuple[str, Callable[[Path], Any], str | None]]] = {
    "f64": [("oracle", _oracle, None)],
    "f32": [("llama.cpp", lambda p: _llama(p), None), ("llama.cpp n_ubatch=7", lambda p: _llama(p, n_ubatch=7), None),
            ("llama.cpp n_threads=1", lambda p: _llama(p, n_threads=1), None),
            ("transformers float32", _transformers("float32"), "torch"), ("mlx float32", _mlx("float32"), "mlx_lm")],
    "bf16": [("oracle-bf16", _lowp("bf16"), None), ("transformers bfloat16", _transformers("bfloat16"), "torch"),
             ("mlx bfloat16", _mlx("bfloat16"), "mlx_lm")],
    "f16": [("oracle-f16", _lowp("f16"), None), ("transformers float16", _transformers("float16"), "torch"),
            ("mlx float16", _mlx("float16"), "mlx_lm")],
}
"""Compute class → known-good engines of the class: (label, factory(path), the module its extra
provides, or None). llama.cpp at its defaults is an f32 engine here: the probe judges an engine
against itself, not against the reference."""


@dataclass
class StateMeasure:
    """One engine's state-probe comparison on the fixture: the worst position's cosine and KLD
    (nats), the first position past ``bound`` once a row is known, ``n`` positions compared."""

    label: str
    min_cosine: float
    max_kld: float
    n: int
    first_outside: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass
class StateCalibration:
    """``calibrate_state``'s result: the known-good measures per class, the known-bad ones, the
    ``state:`` rows as written, the engines skipped (extra missing) and the refusals."""

    goods: dict[str, list[StateMeasure]]
    bads: list[StateMeasure]
    rows: list[dict[str, Any]]
    skipped: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)


def state_tokens(path: Path, n: int = STATE_TOKENS) -> list[int]:
    """The state probe's token ids on the fixture at ``path``: the shipped prompts tokenized by
    llama.cpp, cycled to ``n`` (``probes.decode_prompt``), as ``plan_state`` makes them."""
    from harness.engines.llamacpp import LlamaCppEngine
    from harness.measure.prompts import load_prompt_set, tokenize_prompts
    from harness.runs.probes import decode_prompt

    ptoks = tokenize_prompts(load_prompt_set(None), LlamaCppEngine(path, (), tokenizer_only=True))
    return decode_prompt([p.tokens for p in ptoks], n)


def measure(label: str, engine: Any, tokens: Sequence[int]) -> StateMeasure:
    """``engine`` fed ``tokens`` whole and as the state probe feeds them (``probe_state``'s chunks),
    the worst position of the comparison. Raises ``EngineError`` from the engine."""
    from harness.engines.base import gather
    from harness.runs.probes import STATE_PREFILL

    n = len(tokens)
    whole = gather(engine.logits(tokens), n)
    pieces = gather(engine.logits(tokens, chunks=[STATE_PREFILL] + [1] * (n - STATE_PREFILL)), n)
    pm = metrics.position_metrics(whole, pieces)
    return StateMeasure(label, float(np.min(pm["cosine"])), float(np.max(pm["kld"])), n)


def _document(cls: str, model: Any, spec: str, goods: list[StateMeasure], bads: list[StateMeasure], proposal: dict[str, Any],
              command: str, max_tokens: int, commit_txt: str) -> dict[str, Any]:
    goods_txt = "; ".join(f"{g.label}: min cos {g.min_cosine:.10f}, max KLD {g.max_kld:.3g}" for g in goods)
    where = (f"The state probe's comparison on {spec} (the shipped prompts cycled to {max_tokens} tokens, a prefill of 16 then one "
             f"token per call, against the same tokens fed whole), each engine against itself. Known-good ({cls}): {goods_txt}. "
             f"Known-bad: the precision mutants (declared f32) and the trunk's between-call state faults.{commit_txt}")
    n = sum(g.n for g in goods)
    cos, kld = proposal["min_cosine"], proposal["max_kld"]
    return {
        "weights": model.weights_key, "class": cls, "file_type": model.file_type,
        "basis_models": [{"name": spec, "sha256": model.sha256, "arch": model.hparams.arch, "n_layer": model.hparams.n_layer,
                          "n_embd": model.hparams.n_embd}],
        "max_tokens": max_tokens,
        "gates": {
            "min_cosine": {"value": cos["value"], "basis": _basis(
                command, n, spec, cos["floor"], [(b.min_cosine, b.label) for b in sorted(bads, key=lambda b: -b.min_cosine)],
                f"20x (in 1 - cosine) the class engines' own floor. {where}", cos["value"], True)},
            "max_kld": {"value": kld["value"], "basis": _basis(
                command, n, spec, kld["floor"], [(b.max_kld, b.label) for b in sorted(bads, key=lambda b: b.max_kld)],
                f"50x the class engines' own worst KLD. {where}", kld["value"], False)},
        },
    }


def calibrate_state(classes: Sequence[str] = tuple(STATE_KNOWN_GOOD), max_tokens: int = STATE_TOKENS,
                    command: str = "harness calibrate --state", commit: str | None = None,
                    log: Callable[[str], None] = print) -> StateCalibration:
    """Measure the ``state:`` rows (module docstring) and return them; writes nothing.

    Raises ``InvalidInput`` for a class with no known-good engines, ``EngineError`` when an engine
    fails. A known-bad engine inside the f32 row's bounds is a refusal in ``problems`` (the caller
    raises ``CalibrationRefused`` before writing)."""
    from harness.engines.mutants import PRECISION_MUTANTS, load_mutant
    from harness.fixtures.resolve import resolve_model
    from harness.fixtures.synthetic import STATE_FIXTURE
    from harness.model.gguf_model import GGUFModel

    bad_cls = [c for c in classes if c not in STATE_KNOWN_GOOD]
    if bad_cls:
        raise InvalidInput(f"state rows are measured for classes {', '.join(STATE_KNOWN_GOOD)}; not {', '.join(bad_cls)}")
    spec = f"fixture:{STATE_FIXTURE}"
    path = Path(resolve_model(spec))
    model = GGUFModel(path)
    tokens = state_tokens(path, max_tokens)
    goods: dict[str, list[StateMeasure]] = {}
    skipped: list[str] = []
    for cls in classes:
        goods[cls] = []
        for label, make, module in STATE_KNOWN_GOOD[cls]:
            if not have_module(module):
                skipped.append(f"{label} ({cls}): its extra is not installed (no module {module})")
                log(f"  skipped: {skipped[-1]}")
                continue
            log(f"  state ({cls}): {label}")
            try:
                goods[cls].append(measure(label, make(path), tokens))
            except (HarnessError, RuntimeError) as e:
                skipped.append(f"{label} ({cls}): {str(e).splitlines()[0][:160]}")
                log(f"  skipped: {skipped[-1]}")
    bads = []
    for name in (*PRECISION_MUTANTS, *STATE_TRUNK_MUTANTS):
        log(f"  state (known-bad): mutant:{name}")
        bads.append(measure(f"mutant:{name}", load_mutant(name, path), tokens))
    commit_txt = f" harness commit {commit}." if commit else ""
    rows, problems = [], []
    for cls in classes:
        if not goods[cls]:
            problems.append(f"no known-good engine of class {cls} ran; its state row cannot be measured")
            continue
        proposal = propose_probes(min(g.min_cosine for g in goods[cls]), max(g.max_kld for g in goods[cls]), cls, STATE_MIN_STEP)
        rows.append(_document(cls, model, spec, goods[cls], bads, proposal, command, max_tokens, commit_txt))
        log(f"  state row {cls}: cosine ≥ {proposal['min_cosine']['value']}, KLD ≤ {proposal['max_kld']['value']:g} "
            f"({len(goods[cls])} engines)")
        if cls == "f32":
            cos, kld = proposal["min_cosine"]["value"], proposal["max_kld"]["value"]
            for b in bads:
                if b.min_cosine >= cos and b.max_kld <= kld:
                    problems.append(f"{b.label} stays within the f32 state row (min cosine {b.min_cosine:.10f}, max KLD {b.max_kld:.3g})")
    return StateCalibration(goods, bads, rows, skipped, problems)


def merge_state_rows(path: str | Path, rows: list[dict[str, Any]]) -> Path:
    """thresholds.yaml at ``path`` with ``rows`` replacing the ``state:`` rows of the same weights ×
    class × architecture, every other number kept (``document.merge_rows``)."""
    return merge_rows(path, "state", rows)


def refuse(res: StateCalibration) -> None:
    """Raise ``CalibrationRefused`` (exit 1) naming every problem of ``res``; nothing is written."""
    if res.problems:
        raise CalibrationRefused("state calibration refused: " + "; ".join(res.problems))
