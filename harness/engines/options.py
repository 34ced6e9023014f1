"""Candidate options of the command line: the engine settings ``--dtype`` and ``--mlx-folder`` ask
for, read back from a receipt into the options that ask for them again, and the ``--dtype`` that
makes an engine compute in a release manifest's pinned class.

- ``CANDIDATE_FLAGS`` / ``candidate_flags``: a receipt records the settings a run asked of its
  candidate (``engines.candidate.requested``, ``harness.runs.inputs.engine_record``); the
  reproduce lines of the report and of the sweep's commands turn them back into options, so a
  line run as printed makes the same engine.
- ``DTYPE_ENGINES`` / ``class_settings``: the transformers and mlx engines compute in the dtype
  they are given (``transformers_engine.DTYPE_CLASS``, ``mlx_engine.DTYPE_CLASS``), float32 when
  given none; a manifest that pins ``compute_class: bf16`` for one of them is run with
  ``--dtype bfloat16``. Every other engine's class is its own (the oracle-bf16 engine, a command
  engine's ``compute_class``), and no option changes it.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

CANDIDATE_FLAGS = (("dtype", "--dtype"), ("folder", "--mlx-folder"), ("tokenizer_dir", "--tokenizer-dir"))
"""A candidate setting a run can be asked for on the command line, and the option that asks for
it (``harness parity``/``probe``: ``--dtype`` of the transformers and mlx engines, ``--mlx-folder``;
``harness tokenizer``: ``--tokenizer-dir``)."""

DTYPE_ENGINES = ("transformers", "mlx")
"""Engines whose compute class is the ``--dtype`` they are given."""

CLASS_DTYPE = {"f64": "float64", "f32": "float32", "bf16": "bfloat16", "f16": "float16"}
"""The ``--dtype`` of each compute class (the inverse of the engines' ``DTYPE_CLASS``)."""


def candidate_flags(settings: Mapping[str, Any] | None, only: Sequence[str] = ("dtype", "folder")) -> list[str]:
    """The options that ask for the candidate ``settings`` a run was made with
    (``CANDIDATE_FLAGS``, in that table's order) for the settings named in ``only``:
    ``{"dtype": "bfloat16", "folder": "/abs/dir"}`` gives ``["--dtype", "bfloat16",
    "--mlx-folder", "/abs/dir"]``. Settings with no option are left out; ``[]`` for None."""
    s = settings or {}
    return [x for key, flag in CANDIDATE_FLAGS if key in only and s.get(key) is not None for x in (flag, str(s[key]))]


def class_settings(engine: str, compute_class: str) -> dict[str, str]:
    """The settings that make ``engine`` compute in ``compute_class``: ``{"dtype": ...}``
    (``CLASS_DTYPE``) for an engine of ``DTYPE_ENGINES``, else ``{}`` (its class is its own)."""
    if engine in DTYPE_ENGINES and compute_class in CLASS_DTYPE:
        return {"dtype": CLASS_DTYPE[compute_class]}
    return {}
