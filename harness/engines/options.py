"""Candidate options of the command line: the engine settings ``--dtype`` and ``--mlx-folder`` ask
for, read back from a receipt into the options that ask for them again, and the ``--dtype`` that
makes an engine compute in a release manifest's pinned class.

- ``CANDIDATE_FLAGS`` / ``candidate_flags``: a receipt records the settings a run asked of its
  candidate (``engines.candidate.requested``, ``harness.runs.inputs.engine_record``); the
  reproduce lines of the report and of the sweep's commands turn them back into options, so a
  line run as printed makes the same engine.
- ``KV_ENGINES`` / ``kv_settings``: llama.cpp-based engines take the KV-cache types and flash
  attention (``--cache-type-k``, ``--cache-type-v``, ``--flash-attn``, llama.cpp's own option names;
  ``--reference-cache-type-k`` ... for the reference); the values are checked where the settings
  are made (``harness.engines.llamacpp.LlamaCppSettings``, one line listing the allowed types).
- ``DTYPE_ENGINES`` / ``class_settings``: the transformers and mlx engines compute in the dtype
  they are given (``transformers_engine.DTYPE_CLASS``, ``mlx_engine.DTYPE_CLASS``), float32 when
  given none; a manifest that pins ``compute_class: bf16`` for one of them is run with
  ``--dtype bfloat16``. Every other engine's class is its own (the oracle-bf16 engine, a command
  engine's ``compute_class``), and no option changes it.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from harness.engines.llamacpp import LlamaCppSettings
from harness.errors import InvalidInput

CANDIDATE_FLAGS = (("dtype", "--dtype"), ("folder", "--mlx-folder"), ("tokenizer_dir", "--tokenizer-dir"),
                   ("type_k", "--cache-type-k"), ("type_v", "--cache-type-v"), ("flash_attn", "--flash-attn"))
"""A candidate setting a run can be asked for on the command line, and the option that asks for
it (``harness parity``/``probe``: ``--dtype`` of the transformers and mlx engines, ``--mlx-folder``;
``harness tokenizer``: ``--tokenizer-dir``; llama.cpp-based candidates: ``--cache-type-k``,
``--cache-type-v``, ``--flash-attn``)."""

KV_ENGINES = ("llama.cpp", "llamacpp", "llama-cpp", "llama.cpp-repack", "llamacpp-repack")
"""The engine names (registry rows ``llama.cpp`` and ``llama.cpp-repack`` with their aliases)
that take ``type_k`` / ``type_v`` / ``flash_attn`` settings."""

KV_KEYS = ("type_k", "type_v", "flash_attn")
"""The llama.cpp settings ``kv_settings`` fills (``LlamaCppSettings`` fields)."""

DTYPE_ENGINES = ("transformers", "mlx")
"""Engines whose compute class is the ``--dtype`` they are given."""

CLASS_DTYPE = {"f64": "float64", "f32": "float32", "bf16": "bfloat16", "f16": "float16"}
"""The ``--dtype`` of each compute class (the inverse of the engines' ``DTYPE_CLASS``)."""


def candidate_flags(settings: Mapping[str, Any] | None,
                    only: Sequence[str] = ("dtype", "folder", "type_k", "type_v", "flash_attn")) -> list[str]:
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


def kv_settings(engine: str, type_k: str | None, type_v: str | None, flash_attn: str | None,
                prefix: str = "--") -> dict[str, str]:
    """The llama.cpp settings ``{type_k, type_v, flash_attn}`` asked for on the command line for
    ``engine`` (None: not given, left at ``LlamaCppSettings``' default, f16 / f16 / auto), checked
    here as the engine's settings will be (``LlamaCppSettings``: ``InvalidInput`` naming the allowed
    types, or a quantized V cache with flash attention off).
    ``prefix`` names the options in the error (``--`` for the candidate's, ``--reference-``).
    Raises ``InvalidInput`` (exit 2) when one is given to an engine of no ``KV_ENGINES`` row."""
    asked = {k: v for k, v in zip(KV_KEYS, (type_k, type_v, flash_attn)) if v is not None}
    if asked and engine not in KV_ENGINES:
        names = ", ".join(f"{prefix}{'flash-attn' if k == 'flash_attn' else 'cache-' + k.replace('_', '-')}" for k in asked)
        raise InvalidInput(f"{names} appl{'y' if len(asked) > 1 else 'ies'} to the llama.cpp and llama.cpp-repack engines, not {engine}")
    LlamaCppSettings(**asked)  # a bad type name: one line listing the allowed ones, before any engine runs
    return asked


def engine_label(record: Mapping[str, Any]) -> str:
    """An engine record's name (a receipt's ``engines.candidate`` / ``engines.reference``) with,
    for a llama.cpp-based engine, the KV-cache types it ran and whether flash attention ran:
    ``llama.cpp (KV f16/f16, flash attention enabled)``; the name alone for other engines. The
    flash-attention word is what llama.cpp's log said (``settings.flash_attn_ran``), else what was
    asked (``flash_attn auto``)."""
    s = record.get("settings") or {}
    if "type_k" not in s or "type_v" not in s:
        return str(record.get("name", "?"))
    fa = f"flash attention {s['flash_attn_ran']}" if s.get("flash_attn_ran") else f"flash_attn {s.get('flash_attn', '?')}"
    return f"{record.get('name', '?')} (KV {s['type_k']}/{s['type_v']}, {fa})"
