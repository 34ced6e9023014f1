"""Release manifests (``releases/NAME.yaml`` or any path; schema ``harness-release/v1``,
``harness/schemas/release-manifest.schema.json``): what one release's sign-off requires.

A manifest names the release, the candidate engines (each with the compute class it is pinned to,
the backends it must be verified on, optionally the build id and the version it must be), the
models (``fixture:NAME`` or a GGUF path, each pinned by sha256), the thresholds file (pinned by
sha256), the prompt file, the probes each probe cell runs, the hosts expected to run cells, the
contracts that must hold and whether each model × candidate needs a passing tokenizer check
(``tokenizer: true``: ``harness tokenizer``, its chat-template part included). Relative paths resolve against the manifest's folder. Example::

    schema: harness-release/v1
    release: mine-0.4.0
    thresholds: {sha256: 3f…}          # the thresholds.yaml every cell is judged with
    contracts: [qwen35-e2e-verification-v1]
    candidates:
      - {engine: "command:mine", compute_class: f32, backends: [cpu]}
    models:
      - {model: "fixture:trained-qwen35", sha256: 9a…}

Everything wrong with a manifest (not YAML, not the schema, a duplicate candidate or model, an
unknown engine or contract, a file that does not exist) is ``InvalidInput`` (exit 2) naming the
manifest and the field; whether the pinned sha256 still hold is judged by ``harness signoff``
(a changed model is a BLOCKED release, not an invalid manifest).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from harness.runs.probes import PROBE_NAMES, REQUIRED_PROBES
from harness.config import DEFAULT_REFERENCE
from harness.errors import InvalidInput
from harness.fschecks import read_utf8
from harness.provenance import sha256_bytes
from harness.validation import best_error, schema_validator
from harness.yamlnodes import duplicate_keys, line_of, load_bounded

SCHEMA_ID = "harness-release/v1"
SCHEMA_FILE = "release-manifest.schema.json"
DEFAULT_BACKENDS = ("cpu",)


@dataclass(frozen=True)
class CandidatePin:
    """One candidate of a release: ``engine`` (registry name), the ``compute_class`` it is pinned
    to, the ``backends`` it must be verified on (as the engine reports them), the ``build`` id
    prefix and ``version`` it must be (None: not pinned) and the contracts it must hold."""

    engine: str
    compute_class: str
    backends: tuple[str, ...] = DEFAULT_BACKENDS
    build: str | None = None
    version: str | None = None
    contracts: tuple[str, ...] = ()


@dataclass(frozen=True)
class ModelPin:
    """One model of a release: ``spec`` (``fixture:NAME`` or a resolved path) and its sha256."""

    spec: str
    sha256: str


@dataclass(frozen=True)
class Manifest:
    """A loaded, validated release manifest (module docstring); ``path`` is the file it came from,
    ``sha256`` its bytes' hash."""

    path: Path
    sha256: str
    release: str
    candidates: tuple[CandidatePin, ...]
    models: tuple[ModelPin, ...]
    thresholds_path: Path | None
    thresholds_sha256: str
    prompts: Path | None
    reference: str = DEFAULT_REFERENCE
    probes: tuple[str, ...] = PROBE_NAMES
    hosts: tuple[str, ...] = ()
    contracts: tuple[str, ...] = field(default_factory=tuple)
    tokenizer: bool = False

    def contracts_for(self, cand: CandidatePin) -> list[str]:
        """The contracts ``cand`` must hold: the manifest's, then its own, each once."""
        return list(dict.fromkeys([*self.contracts, *cand.contracts]))


def _resolve(base: Path, value: str) -> Path:
    p = Path(value).expanduser()
    return p if p.is_absolute() else base / p


def _model_spec(base: Path, value: str) -> str:
    return value if value.startswith("fixture:") else str(_resolve(base, value))


def load_manifest(path: str | Path) -> Manifest:
    """Read and validate a release manifest (module docstring). Raises ``InvalidInput`` (exit 2)
    naming the file, the line where YAML locates it and the field."""
    # deferred: the engine registry and contract suite load NumPy and the engines; a schema error needs neither
    from harness.contracts.suite import resolve_contract
    from harness.engines.registry import engine_entry

    p = Path(path)
    if not p.is_file():
        raise InvalidInput(f"{p}: no such release manifest")
    raw, text = read_utf8(p, "release manifest", "; a release manifest is UTF-8 YAML")
    try:
        root, data = load_bounded(p, text, "a release manifest")
    except yaml.YAMLError as e:
        raise InvalidInput(f"{p}: not valid YAML ({' '.join(str(e).split())})") from None
    for keys, line, _first in duplicate_keys(root)[:1]:
        raise InvalidInput(f"{p}:{line}: duplicate key {'.'.join(map(str, keys))}")
    if not isinstance(data, dict):
        raise InvalidInput(f"{p}: a release manifest is a YAML mapping (schema: {SCHEMA_ID})")
    err = best_error(schema_validator(SCHEMA_FILE).iter_errors(data))
    if err:
        where, message = err
        keys = [int(k) if k.isdigit() else k for k in where.split(".")] if where else []
        raise InvalidInput(f"{p}:{line_of(root, keys)}: {where or '(top level)'}: {message} (schema {SCHEMA_ID})")
    base = p.resolve().parent
    cands = []
    for i, c in enumerate(data["candidates"]):
        if engine_entry(c["engine"]) is None or engine_entry(c["engine"]).load is None:
            raise InvalidInput(f"{p}:{line_of(root, ['candidates', i, 'engine'])}: candidates.{i}.engine: unknown engine {c['engine']!r}")
        cands.append(CandidatePin(c["engine"], c["compute_class"], tuple(c.get("backends") or DEFAULT_BACKENDS), c.get("build"),
                                  c.get("version"), tuple(c.get("contracts") or ())))
    names = [c.engine for c in cands]
    if len(set(names)) != len(names):
        raise InvalidInput(f"{p}: candidates: {next(n for n in names if names.count(n) > 1)!r} is listed twice")
    models = tuple(ModelPin(_model_spec(base, m["model"]), m["sha256"]) for m in data["models"])
    specs = [m.spec for m in models]
    if len(set(specs)) != len(specs):
        raise InvalidInput(f"{p}: models: {next(s for s in specs if specs.count(s) > 1)!r} is listed twice")
    for cid in [*data.get("contracts", []), *(c for cand in cands for c in cand.contracts)]:
        if resolve_contract(cid) is None:
            raise InvalidInput(f"{p}: contracts: {cid!r} is neither this project's contracts/{cid}.yaml nor a shipped contract")
    missing = [n for n in REQUIRED_PROBES if data.get("probes") and n not in data["probes"]]
    if missing:
        raise InvalidInput(f"{p}:{line_of(root, ['probes'])}: probes: a probe cell gives a verdict only with {', '.join(REQUIRED_PROBES)}; "
                           f"missing {', '.join(missing)}")
    th = data["thresholds"]
    prompts = _resolve(base, data["prompts"]) if data.get("prompts") else None
    thresholds = _resolve(base, th["path"]) if th.get("path") else None
    for what, f in (("prompts", prompts), ("thresholds.path", thresholds)):
        if f is not None and not f.is_file():
            raise InvalidInput(f"{p}: {what}: {f} does not exist")
    return Manifest(p, sha256_bytes(raw), data["release"], tuple(cands), models, thresholds, th["sha256"], prompts,
                    data.get("reference", DEFAULT_REFERENCE), tuple(data.get("probes") or PROBE_NAMES), tuple(data.get("hosts") or ()),
                    tuple(data.get("contracts") or ()), bool(data.get("tokenizer", False)))


def manifest_dict(m: Manifest) -> dict[str, Any]:
    """A JSON-ready summary of a manifest (what ``harness signoff --json`` prints)."""
    return {"path": str(m.path), "sha256": m.sha256, "release": m.release, "reference": m.reference,
            "candidates": [vars(c) | {"backends": list(c.backends), "contracts": list(c.contracts)} for c in m.candidates],
            "models": [vars(x) for x in m.models], "thresholds": None if m.thresholds_path is None else str(m.thresholds_path),
            "thresholds_sha256": m.thresholds_sha256, "prompts": None if m.prompts is None else str(m.prompts),
            "probes": list(m.probes), "hosts": list(m.hosts), "contracts": list(m.contracts), "tokenizer": m.tokenizer}
