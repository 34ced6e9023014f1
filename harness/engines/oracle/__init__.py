"""The exact float64 NumPy oracle: one module per architecture (``qwen35``, ``qwen35moe``).

``load_oracle(model, overrides)`` returns the oracle engine for a GGUF by its arch; the engine
registry resolves the name ``oracle`` through it.
"""

from __future__ import annotations

import os
from typing import Sequence

from harness.engines.oracle.qwen35 import Qwen35Oracle
from harness.engines.oracle.qwen35moe import Qwen35MoeOracle
from harness.model.gguf_model import GGUFModel, Override

ORACLES = {"qwen35": Qwen35Oracle, "qwen35moe": Qwen35MoeOracle}


def load_oracle(model: GGUFModel | str | os.PathLike, overrides: Sequence[Override] = ()) -> Qwen35Oracle:
    """The oracle engine for ``model`` (a ``GGUFModel``, or a path opened with ``overrides``).

    Raises ``InvalidInput`` (exit 2) for an unreadable file or an unsupported architecture.
    """
    if not isinstance(model, GGUFModel):
        model = GGUFModel(model, overrides)
    return ORACLES[model.require_supported()](model)


__all__ = ["ORACLES", "Qwen35MoeOracle", "Qwen35Oracle", "load_oracle"]
