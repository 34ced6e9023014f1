"""The conformance suite shipped with the harness, and where a project's contracts and evidence go.

The suite (``harness.paths.SUITE_ROOT``: ``contracts/*.yaml``, their bound tests in
``tests/contracts/`` and ``thresholds.yaml``) travels in the wheel, versioned with the harness. A
project (an engine's repository: the folder of the ``pyproject.toml`` found from the current
directory, ``harness.config``) uses it:

* a contract is named by path, or by id: the project's ``contracts/<id>.yaml`` first, then the
  shipped one (``harness discharge qwen35-hybrid-forward-v1``);
* the project's own contracts may ``depends_on`` shipped ones (``loader.load_contracts`` loads
  them from the suite);
* evidence goes to the project: ``<evidence>/discharge/<contract>/<build>/<obligation>.json`` with
  ``<evidence>`` = ``[tool.harness] evidence`` or ``<project root>/evidence``. For a shipped
  contract the project is the one you run in; for a contract file in a repository, that
  repository. In this repository (a checkout) both are the same folder as before;
* ``harness status`` looks at the project's ``contracts/`` and at the shipped contracts the project
  uses: those listed in ``[tool.harness] contracts``, else those it has discharge records for.

Receipts and discharge records name the harness version, the shipped contracts' versions and one
sha256 over the suite's contracts and bound tests (``harness.provenance.suite_pins``), so a record
made with one release can be told from another's; ``harness status`` compares the files
themselves and says STALE when an upgrade changed a contract or a bound test.
"""

from __future__ import annotations

import os
from pathlib import Path

from harness.config import HarnessConfig, load_config
from harness.errors import InvalidInput
from harness.paths import SUITE_ROOT

CONTRACTS_DIR = "contracts"


def shipped_contracts() -> dict[str, Path]:
    """``{id: path}`` of the shipped contracts (ids are file stems; validation enforces it)."""
    folder = SUITE_ROOT / CONTRACTS_DIR
    return {p.stem: p for p in sorted(folder.glob("*.yaml"))} if folder.is_dir() else {}


def is_shipped(contract_root: Path) -> bool:
    """True when a contract whose repository is ``contract_root`` belongs to the shipped suite."""
    return contract_root.resolve() == SUITE_ROOT.resolve()


def project_config(contract_root: Path | None = None) -> HarnessConfig:
    """The configuration of the project a contract's evidence belongs to: the current project for
    a shipped contract (or none given), else the repository holding the contract."""
    if contract_root is None or is_shipped(contract_root):
        return load_config()
    return load_config(contract_root)


def discharge_dir(contract_root: Path) -> Path:
    """Where discharge records of a contract in ``contract_root`` go (see module docstring)."""
    return project_config(contract_root).evidence_dir / "discharge"


def _looks_like_id(text: str) -> bool:
    return bool(text) and os.sep not in text and "/" not in text and not text.endswith((".yaml", ".yml")) and text not in (".", "..")


def resolve_contract(arg: str | os.PathLike) -> Path | None:
    """The contract file an id names (the project's ``contracts/<id>.yaml``, else the shipped
    one), or None when ``arg`` is not an id of either."""
    text = str(arg)
    if not _looks_like_id(text):
        return None
    own = load_config().base_dir / CONTRACTS_DIR / f"{text}.yaml"
    if own.is_file():
        return own
    return shipped_contracts().get(text)


def unknown_contract_message(arg: str | os.PathLike) -> str:
    """The error for a path that does not exist and is not a contract id."""
    ids = ", ".join(shipped_contracts()) or "none (the suite is missing from this installation)"
    return f"{arg}: no such contract file, folder or id; shipped contracts: {ids}"


def _has_records(evidence: Path, contract_id: str) -> bool:
    folder = evidence / contract_id
    return folder.is_dir() and any(folder.rglob("*.json"))


def default_contract_paths(cfg: HarnessConfig | None = None) -> list[Path]:
    """The contracts ``harness status`` looks at by default (module docstring): the project's
    ``contracts/`` folder when it holds contracts, plus the shipped contracts the project uses.
    Raises ``InvalidInput`` for an unknown id in ``[tool.harness] contracts``."""
    cfg = cfg or load_config()
    shipped = shipped_contracts()
    own_dir = cfg.base_dir / CONTRACTS_DIR
    own = sorted(own_dir.glob("*.yaml")) if own_dir.is_dir() else []
    listed = cfg.names("contracts")
    unknown = [c for c in listed if c not in shipped]
    if unknown:
        raise InvalidInput(f"{cfg.source}: [tool.harness] contracts: unknown shipped contract {unknown[0]!r}; shipped: {', '.join(shipped)}")
    evidence = cfg.evidence_dir / "discharge"
    used = listed if "contracts" in cfg.table else [cid for cid in shipped if _has_records(evidence, cid)]
    seen = {p.resolve() for p in own}
    return own + [shipped[cid] for cid in used if shipped[cid].resolve() not in seen]
