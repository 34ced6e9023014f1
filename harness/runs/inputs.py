"""Inputs of every command that runs engines, resolved once, in one order.

``harness parity``, ``probe``, ``localize`` (and the pytest plugin) all need the same things
before an engine runs: ``--override-kv`` flags parsed, thresholds loaded (a gate without a basis
refuses here, before engine time is spent), the model resolved (path or ``fixture:NAME``) and its
hyperparameters validated, the prompt set loaded, and engines named the same way everywhere.
``resolve_inputs`` does that once; ``RunInputs`` then hands out engines, the reference tokenizer,
token ids, and the thresholds for a candidate (``thresholds_for``: the calibrated tier is keyed by
the candidate's compute class, which a command engine may only state when it runs).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping

from harness import display
from harness.config import DEFAULT_CANDIDATE, DEFAULT_REFERENCE, config_record
from harness.engines.base import ASSUMED_CLASS, Engine
from harness.engines.llamacpp import LlamaCppEngine
from harness.engines.registry import engine_build_id, resolve_engine
from harness.errors import HarnessError, InvalidInput
from harness.fixtures.resolve import resolve_model
from harness.engines.options import candidate_flags
from harness.judge.reproducer import Reproducer
from harness.judge.thresholds import ResolvedThresholds, Thresholds, load_thresholds
from harness.judge.tiers import Subject
from harness.measure.prompts import (
    DEFAULT_PROMPTS,
    PromptSet,
    PromptTokens,
    load_prompt_set,
    tokenize_prompts,
)
from harness.model.gguf_model import GGUFModel, Override, parse_overrides
from harness.paths import SUITE_ROOT

DEFAULT_THRESHOLDS = Path("thresholds.yaml")


def shipped_thresholds() -> Path:
    """thresholds.yaml shipped with the harness (the suite's: ``harness.paths.SUITE_ROOT``; used
    when ./thresholds.yaml is absent)."""
    return SUITE_ROOT / "thresholds.yaml"


def resolve_thresholds_path(given: str | Path | None) -> Path:
    """``given``; else ./thresholds.yaml when present; else the shipped copy."""
    if given:
        return Path(given)
    return DEFAULT_THRESHOLDS if DEFAULT_THRESHOLDS.is_file() else shipped_thresholds()


def model_display_name(spec: str) -> str:
    """``fixture:NAME`` as given, a path by its file name (receipts keep the full path too)."""
    return spec if str(spec).startswith("fixture:") else Path(spec).name


@dataclass
class RunInputs:
    """Validated inputs of one run (see the module docstring).

    ``model_spec`` is what the user gave (path or ``fixture:NAME``); ``path`` the file it resolved
    to; ``overrides`` the parsed ``--override-kv`` flags, applied to every engine the run makes.
    """

    model_spec: str
    path: Path
    overrides: list[Override]
    model: GGUFModel
    thresholds: Thresholds
    prompt_set: PromptSet

    @property
    def display_name(self) -> str:
        return model_display_name(self.model_spec)

    def engine(self, name: str, **settings: Any) -> Engine:
        """A new instance of the engine ``name`` (registry names) on this model, with the run's
        overrides and engine-specific ``settings`` (e.g. ``dtype`` for ``transformers``).
        Raises ``InvalidInput`` (unknown name or setting) or ``EngineError`` (cannot load)."""
        return resolve_engine(name, self.path, self.overrides, **settings)

    def tokenizer(self, reference: Engine | None = None) -> Any:
        """The reference's tokenizer: ``reference`` itself when it tokenizes, else llama.cpp on
        the same file (token ids always come from llama.cpp's vocabulary)."""
        if reference is not None and hasattr(reference, "tokenize"):
            return reference
        return LlamaCppEngine(self.path, self.overrides, tokenizer_only=True)

    def tokens(self, reference: Engine | None = None, prompt_set: PromptSet | None = None) -> list[PromptTokens]:
        """Token ids of every prompt of ``prompt_set`` (default: the run's), tokenized by
        ``tokenizer(reference)``. Raises ``NotComparable`` for a text with no tokens."""
        return tokenize_prompts(prompt_set or self.prompt_set, self.tokenizer(reference))

    def tokens_of(self, path: str | Path) -> list[PromptTokens]:
        """Token ids of the run's prompts tokenized by llama.cpp on the GGUF at ``path``, another
        model than the run's (the state probe's fixture). Raises ``NotComparable`` for a text with
        no tokens, ``EngineError`` when llama.cpp cannot load the vocabulary."""
        return tokenize_prompts(self.prompt_set, LlamaCppEngine(path, (), tokenizer_only=True))

    def reproducer(self, candidate: str, *others: str, settings: Mapping[str, Any] | None = None) -> Reproducer:
        """The start of every failure message of this run (``harness.judge.reproducer``):
        ``candidate`` and the model as the user named them, its sha256, the overrides, the
        prompt and thresholds files when they are not the ones found by default, and the
        config file (path and sha256) that defines ``candidate`` or one of the ``others`` (the
        reference) when one does (``harness.config.config_record``), and the options that made
        the candidate from its ``settings`` (``candidate_flags``: ``--dtype``, ``--mlx-folder``)."""
        th = self.thresholds.path
        cfg = next((r for r in map(config_record, (candidate, *others)) if r), None)
        return Reproducer(candidate, self.model_spec, self.model.sha256, overrides=[o.to_flag() for o in self.overrides],
                          prompts_file=None if self.prompt_set.path == DEFAULT_PROMPTS else str(self.prompt_set.path),
                          thresholds_file=None if Path(th).resolve() == resolve_thresholds_path(None).resolve() else str(th),
                          config=cfg, candidate_args=candidate_flags(settings))

    def thresholds_for(self, candidate_info: Mapping[str, Any] | None = None) -> ResolvedThresholds:
        """The thresholds for this model judged with a candidate of ``candidate_info`` (its
        ``compute_class``; the assumed class when None or undeclared): the release gate, the
        calibrated row that fits (or why none does) and the probe tolerances."""
        return self.thresholds.resolve(subject_of(self.model, candidate_info), self.model_spec, self.display_name)

    def model_record(self) -> dict[str, Any]:
        """The receipt's ``model`` field: path, display name, sha256, arch, file type, overrides."""
        d = self.model.describe()
        return {"path": d["path"], "name": self.display_name, "sha256": d["sha256"], "arch": d["arch"],
                "file_type": d["file_type"], "overrides": d["overrides"]}


@dataclass(kw_only=True)
class InputsRequest:
    """What every command that runs engines is asked for first: ``model`` (a path or
    ``fixture:NAME``), the prompt file (None: the shipped set), the thresholds file (None:
    ./thresholds.yaml, else the shipped copy) and ``--override-kv`` strings."""

    model: str
    prompts: str | None = None
    thresholds: str | None = None
    overrides: list[str] = field(default_factory=list)

    def resolve(self) -> RunInputs:
        """``resolve_inputs`` of this request (raises as it does)."""
        return resolve_inputs(self.model, thresholds=self.thresholds, overrides=self.overrides, prompts=self.prompts)


@dataclass(kw_only=True)
class RunRequest(InputsRequest):
    """A run that judges a candidate against a reference and records evidence (``harness parity``,
    ``harness probe``): engine names (registry names), the reference's engine-specific settings
    (``reference_settings``: e.g. ``n_threads`` for ``llama.cpp``, which a sweep divides among its
    jobs), the ledger (None: the default; receipts go beside it), the command line recorded in the
    receipt, whether to write evidence at all, and whether its verdict page goes with it
    (``report``, ``localize``)."""

    candidate: str = DEFAULT_CANDIDATE
    reference: str = DEFAULT_REFERENCE
    reference_settings: dict[str, Any] = field(default_factory=dict)
    ledger: str | None = None
    argv: list[str] = field(default_factory=list)
    write_evidence: bool = True
    report: bool = False
    """Write the receipt's verdict page too (``report.md``/``report.html`` beside the receipts),
    through the evidence door with the receipt: what ``harness parity`` and ``harness probe`` ask."""
    localize: bool | str = "auto"
    """With ``report``: localize the first divergence on the page (True, False, or "auto": a FAIL
    whose candidate declares activations; ``harness.runs.explain.explain``)."""


def engine_record(info: Mapping[str, Any], name: str, requested: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """A receipt's record of an engine: its ``info`` (``EngineInfo.to_dict()``) with ``build.id``, the
    build id of the engine ``name`` it was made as (``harness.engines.registry.engine_build_id``), so
    a receipt says which build of the engine's code produced it, and ``build.cpu_features``: the
    engine's own CPU feature line (llama.cpp: ``llama_print_system_info()``), None where the engine
    states none, so receipts from two machines show how their engines saw the CPU; for an engine a
    config file defines (``command:NAME``, ``http:NAME``), ``config``: that file's absolute path and
    sha256 (``harness.config.config_record``), which the reproduce lines carry; and ``requested``:
    the settings the run asked of it on the command line (``--dtype``: ``{"dtype": "bfloat16"}``,
    ``--mlx-folder``: ``{"folder": "/abs/dir"}``), left out when none, so a reproduce line made from
    the receipt alone asks for them again (``harness.judge.reproducer.candidate_flags``)."""
    rec = {**info, "build": {"cpu_features": None, **(info.get("build") or {}), "id": engine_build_id(name)}}
    cfg = config_record(name)
    asked = {k: v if isinstance(v, (str, int, float, bool)) else str(v) for k, v in (requested or {}).items() if v is not None}
    return rec | ({"config": cfg} if cfg else {}) | ({"requested": asked} if asked else {})


def subject_of(model: GGUFModel, candidate_info: Mapping[str, Any] | None) -> Subject:
    """The calibrated tier's key for ``model`` judged with a candidate of ``candidate_info``: the
    weights key, file type, ``n_layer``/``n_embd``, sha256, and the candidate's ``compute_class``
    (``ASSUMED_CLASS``, and not declared, when it states none), and ``general.architecture``."""
    declared = (candidate_info or {}).get("compute_class")
    hp = model.hparams
    return Subject(model.weights_key, model.file_type, declared or ASSUMED_CLASS, declared is not None,
                   hp.n_layer, hp.n_embd, model.sha256, hp.arch)


def resolve_inputs(model: str, *, thresholds: str | Path | None = None, overrides: list[str] | None = None,
                   prompts: str | Path | None = None) -> RunInputs:
    """Resolve a run's inputs in the order that makes failures cheap (module docstring); the
    model, thresholds and prompt files are kept as absolute paths (receipts and reproducers record
    them).

    Raises ``InvalidInput`` (bad override, thresholds without basis, unreadable or unsupported
    model, bad prompt file, a name that is not UTF-8 text) before any engine runs.
    """
    for what, name in (("model", model), ("thresholds file", thresholds), ("prompt file", prompts)):
        try:
            str(name or "").encode("utf-8")
        except UnicodeEncodeError:  # a file name of non-UTF-8 bytes: no receipt could record it
            raise InvalidInput(f"{what} name {display.plain(name)} is not UTF-8 text; receipts record it as text") from None
    ov = parse_overrides(overrides or [])
    # absolute, so receipts and reproduce lines name the same files run from another directory
    th = load_thresholds(resolve_thresholds_path(thresholds).absolute())
    path = resolve_model(model).absolute()
    gm = GGUFModel(path, ov)
    gm.hparams  # validates arch and required keys (InvalidInput) before any engine runs
    return RunInputs(model, path, ov, gm, th, load_prompt_set(Path(prompts).absolute() if prompts else None))


def run_each(specs: list[str], run: Callable[[str], Any]) -> Iterator[tuple[str, Any, HarnessError | None]]:
    """``run(spec)`` for each model spec of a multi-model run, in order: ``(spec, outcome, None)``,
    or ``(spec, None, error)`` when it raised a ``HarnessError`` and other models follow or came
    before (one spec: the error is raised, its verdict the run's)."""
    for spec in specs:
        try:
            yield spec, run(spec), None
        except HarnessError as e:
            if len(specs) == 1:
                raise
            yield spec, None, e
