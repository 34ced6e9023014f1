"""Resolve engine names to engines bound to one model file.

Names: ``llama.cpp`` (the reference, in a worker process), ``oracle`` (exact float64 NumPy
forward), ``mutant:NAME`` (the oracle with one planted fault), ``command:NAME`` (an external
engine configured in ``[tool.harness.engines.NAME]``), ``transformers`` (optional extra).
Unknown names raise ``InvalidInput`` (exit 2) listing the known ones.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Sequence

from harness.engines.base import Engine
from harness.errors import InvalidInput
from harness.model.gguf_model import Override

BUILTIN = ("llama.cpp", "oracle")


def known_engine_names() -> list[str]:
    """Every name ``resolve_engine`` accepts now (mutants and command engines included)."""
    names = list(BUILTIN)
    try:
        from harness.engines.mutants import MUTANTS

        names += [f"mutant:{m}" for m in MUTANTS]
    except ImportError:
        pass
    try:
        from harness.engines.command import configured_commands

        names += [f"command:{c}" for c in configured_commands()]
    except ImportError:
        pass
    return names


def resolve_engine(name: str, model_path: str | os.PathLike, overrides: Sequence[Override] = (), **settings) -> Engine:
    """Return the engine called ``name`` bound to ``model_path``.

    ``settings`` are engine-specific (e.g. ``LlamaCppSettings`` fields for ``llama.cpp``).
    Raises ``InvalidInput`` for an unknown name.
    """
    path = Path(model_path)
    if name in ("llama.cpp", "llamacpp", "llama-cpp"):
        from harness.engines.llamacpp import LlamaCppEngine, LlamaCppSettings

        return LlamaCppEngine(path, overrides, LlamaCppSettings(**settings) if settings else None)
    if name == "oracle":
        from harness.engines.oracle import load_oracle

        return load_oracle(path, overrides)
    if name.startswith("mutant:"):
        from harness.engines.mutants import load_mutant

        return load_mutant(name.split(":", 1)[1], path, overrides)
    if name.startswith("command:"):
        from harness.engines.command import load_command_engine

        return load_command_engine(name.split(":", 1)[1], path, overrides)
    if name == "transformers":
        from harness.engines.transformers_engine import load_transformers

        return load_transformers(path, overrides, **settings)
    raise InvalidInput(f"unknown engine {name!r}; known: {', '.join(known_engine_names())}")
