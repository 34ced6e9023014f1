"""Engine names, how each is loaded, and which source files its numbers come from: one table.

Names: ``llama.cpp`` (the reference, in a worker process, extra buffer types off),
``llama.cpp-repack`` (the same with llama.cpp's extra buffer types on, its ``--repack``), ``oracle`` (exact float64 NumPy
forward), ``oracle-bf16`` / ``oracle-f16`` (the oracle with bf16/f16 matmuls and residual
stream: a compute class's emulation), ``mutant:NAME`` (the oracle with one planted fault), ``command:NAME`` (an external
engine configured in ``[tool.harness.engines.NAME]``), ``http:NAME`` (an OpenAI-compatible server
configured in ``[tool.harness.http.NAME]``: top-k logprobs, not logits), ``llama-server`` (llama.cpp's
own server built from the reference's commit, started by the harness: top-k logprobs, and its
serving under concurrent clients: ``harness.engines.llama_server``), ``llama-cpp-python-server``
(llama-cpp-python's own server, started by the harness: top-k logprobs keyed by text, and its
serving, one request at a time: ``harness.engines.llamacpp_python_server``), ``transformers``
(optional extra), ``mlx`` (mlx-lm, optional extra).
``planted:NAME`` is no engine of its own: it names a fault planted into another engine's output
(the pytest plugin's ``--plant``), listed here for its source files only.

``resolve_engine`` loads an engine through its row; contract discharge hashes a row's
``source_files`` (``engine_source_hashes``) so evidence goes STALE when an engine's code changes.
``engine_build_id`` folds those hashes (and, for ``command:NAME``, the program files its command
names) into one id: the *build* that discharge records, receipts and sign-off are keyed by.
Unknown names raise ``InvalidInput`` (exit 2) listing the known ones.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from types import ModuleType
from typing import Any, Callable, Sequence

from harness import config
from harness.engines import (
    _llamacpp_worker,
    base,
    command,
    http_engine,
    http_traffic,
    llama_server,
    llamacpp,
    llamacpp_python_server,
    mlx_engine,
    mutants,
    oracle,
    persistent,
    transformers_engine,
)
from harness.engines.base import Engine
from harness.errors import InvalidInput
from harness.model import gguf_model
from harness.model.gguf_model import Override
from harness.paths import SOURCE_ROOT
from harness.provenance import sha256_bytes, sha256_file

Loader = Callable[[str, Path, Sequence[Override], dict[str, Any]], Engine]
"""``loader(rest, model_path, overrides, settings)``: ``rest`` is what follows a prefix
(``NAME`` of ``mutant:NAME``), empty for a plain name; ``settings`` are engine-specific."""


@dataclass(frozen=True)
class EngineEntry:
    """One row of the engine table.

    ``name`` is the engine name, or a prefix ending in ``:`` (``mutant:``) for a family;
    ``aliases`` other accepted spellings; ``load`` None for a name that is not an engine by
    itself (``planted:``); ``modules`` the harness modules (a package: all its files) whose code
    computes the engine's numbers; ``distributions`` installed packages whose version is part of
    the engine (llama.cpp's compiled library ships in llama-cpp-python).
    """

    name: str
    load: Loader | None
    modules: tuple[ModuleType, ...]
    aliases: tuple[str, ...] = ()
    distributions: tuple[str, ...] = ()

    @property
    def is_family(self) -> bool:
        return self.name.endswith(":")

    def matches(self, name: str) -> bool:
        return name.startswith(self.name) if self.is_family else name in (self.name, *self.aliases)

    def source_files(self) -> list[str]:
        """The modules' files relative to the checkout (``harness/engines/base.py``), sorted."""
        files: set[Path] = set()
        for m in self.modules:
            f = Path(m.__file__).resolve()
            files |= set(f.parent.glob("*.py")) if f.name == "__init__.py" else {f}
        return sorted(p.relative_to(SOURCE_ROOT).as_posix() for p in files)


def _lowp_oracle(compute_class: str) -> Loader:
    """``oracle-bf16`` / ``oracle-f16``. Imported when used: ml_dtypes takes 0.05-0.45 s to import
    (0.7 builds every format's finfo), which a run of any other engine should not pay."""

    def load(rest: str, path: Path, overrides: Sequence[Override], settings: dict[str, Any]) -> Engine:
        from harness.engines.oracle import lowp

        return lowp.load_lowp_oracle(path, compute_class, overrides)

    return load


def _llamacpp(rest: str, path: Path, overrides: Sequence[Override], settings: dict[str, Any]) -> Engine:
    return llamacpp.LlamaCppEngine(path, overrides, llamacpp.LlamaCppSettings(**settings) if settings else None)


def _llamacpp_repack(rest: str, path: Path, overrides: Sequence[Override], settings: dict[str, Any]) -> Engine:
    """``llama.cpp-repack``: llama.cpp with its extra buffer types on (``use_extra_bufts``, llama.cpp
    ``--repack``, llama.cpp's own default), whatever ``settings`` say of it."""
    return llamacpp.LlamaCppEngine(path, overrides, llamacpp.LlamaCppSettings(**{**settings, "use_extra_bufts": True}))


_ORACLE = (oracle, base, gguf_model)
ENGINES: tuple[EngineEntry, ...] = (
    EngineEntry("llama.cpp", _llamacpp, (llamacpp, _llamacpp_worker, base), aliases=("llamacpp", "llama-cpp"),
                distributions=("llama-cpp-python",)),
    EngineEntry(llamacpp.REPACK_ENGINE, _llamacpp_repack, (llamacpp, _llamacpp_worker, base), aliases=("llamacpp-repack",),
                distributions=("llama-cpp-python",)),
    EngineEntry("oracle", lambda rest, path, ov, s: oracle.load_oracle(path, ov), _ORACLE),
    EngineEntry("oracle-bf16", _lowp_oracle("bf16"), _ORACLE),
    EngineEntry("oracle-f16", _lowp_oracle("f16"), _ORACLE),
    EngineEntry("mutant:", lambda rest, path, ov, s: mutants.load_mutant(rest, path, ov), _ORACLE + (mutants,)),
    EngineEntry("command:", lambda rest, path, ov, s: command.load_command_engine(rest, path, ov), (command, persistent, base, config)),
    EngineEntry("http:", lambda rest, path, ov, s: http_engine.load_http_engine(rest, path, ov), (http_engine, base, config)),
    EngineEntry("llama-server", lambda rest, path, ov, s: llama_server.load_llama_server(path, ov, **s), (llama_server, http_engine, base),
                distributions=("llama-cpp-python",)),
    EngineEntry(llamacpp_python_server.ENGINE_NAME, lambda rest, path, ov, s: llamacpp_python_server.load_llamacpp_python_server(path, ov),
                (llamacpp_python_server, llama_server, http_traffic, http_engine, base), distributions=("llama-cpp-python",)),
    EngineEntry("transformers", lambda rest, path, ov, s: transformers_engine.load_transformers(path, ov, **s),
                (transformers_engine, base)),
    EngineEntry("mlx", lambda rest, path, ov, s: mlx_engine.load_mlx(path, ov, **s), (mlx_engine, base),
                distributions=("mlx", "mlx-cpu", "mlx-lm")),
    EngineEntry("planted:", None, (mutants,)),
)
"""Every engine name the harness knows; see ``EngineEntry``."""


def engine_entry(name: str) -> EngineEntry | None:
    """The row ``name`` belongs to, or None."""
    return next((e for e in ENGINES if e.matches(name)), None)


def known_engine_names() -> list[str]:
    """Every name ``resolve_engine`` accepts now: plain names, each mutant, each configured
    command engine. Raises ``InvalidInput`` for a malformed ``[tool.harness.engines]`` table."""
    names = [e.name for e in ENGINES if e.load is not None and not e.is_family]
    names += [f"mutant:{m}" for m in mutants.ALL_MUTANTS]
    names += [f"command:{c}" for c in command.configured_commands()]
    names += [f"http:{c}" for c in http_engine.configured_servers()]
    return names


def unknown_engine(name: str) -> InvalidInput:
    """The one-line refusal of an engine name ``resolve_engine`` does not know: ``unknown engine
    'oracel' (did you mean 'oracle'?); known: llama.cpp, ..., mlx, mutant:NAME (50 mutants: harness
    mutants list), configured: command:mine`` (the closest of ``known_engine_names``, when one is
    close). Raises ``InvalidInput`` itself for a malformed engines table."""
    names = known_engine_names()
    plain = [e.name for e in ENGINES if e.load is not None and not e.is_family]
    configured = [n for n in names if n.startswith(config.CONFIGURED_PREFIXES)]
    by_tail = {n.split(":", 1)[-1]: n for n in names}  # "mine" for "command:mine", "qk-norm-skiped" for "mutant:qk-norm-skipped"
    close = config.closest(name, names) or by_tail.get(config.closest(name, list(by_tail)) or "")
    hint = f" (did you mean {close!r}?)" if close else ""
    return InvalidInput(f"unknown engine {name!r}{hint}; known: {', '.join(plain)}, "
                        f"mutant:NAME ({len(mutants.ALL_MUTANTS)} mutants: harness mutants list), configured: {', '.join(configured) or 'none'}")


def resolve_engine(name: str, model_path: str | os.PathLike, overrides: Sequence[Override] = (), **settings: Any) -> Engine:
    """Return the engine called ``name`` bound to ``model_path``.

    ``settings`` are engine-specific (e.g. ``LlamaCppSettings`` fields for ``llama.cpp``).
    Raises ``InvalidInput`` for an unknown name: the closest known name first ("did you mean"),
    then the plain names, the mutants' count and the configured engines (``unknown_engine``).
    """
    entry = engine_entry(name)
    if entry is None or entry.load is None:
        raise unknown_engine(name)
    rest = name[len(entry.name):] if entry.is_family else ""
    return entry.load(rest, Path(model_path), overrides, settings)


def engine_source_hashes(name: str) -> dict[str, Any]:
    """``{file: sha256}`` of the source files of ``name``'s row (none for an unknown name), plus
    ``{distribution: version}`` of its ``distributions`` (None when not installed)."""
    entry = engine_entry(name)
    if entry is None:
        return {}
    out: dict[str, Any] = {f: sha256_file(SOURCE_ROOT / f) for f in entry.source_files()}
    for dist in entry.distributions:
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = None
    return out


def program_files(name: str) -> dict[str, str]:
    """``{path: sha256}`` of the engine's own program files: for ``command:NAME``, every argument of
    its configured command that names an existing regular file (relative to the engine's ``cwd``;
    placeholders such as ``{python}`` are skipped), e.g. ``examples/llamacpp_engine.py``; empty for
    the harness's own engines (their files are in ``engine_source_hashes``) and for an unknown or
    unconfigured command. Paths are shown as the command names them."""
    if not name.startswith("command:"):
        return {}
    spec = command.configured_commands().get(name[len("command:"):])
    if spec is None:
        return {}
    out: dict[str, str] = {}
    for arg in spec.command:
        if arg.startswith("{") and arg.endswith("}"):
            continue
        p = Path(arg) if Path(arg).is_absolute() else (spec.cwd or Path.cwd()) / arg
        if p.is_file():
            out[arg] = sha256_file(p)
    return out


def engine_build_id(name: str) -> str:
    """The build id of engine ``name``: sha256 (hex) over ``engine_source_hashes(name)`` (the harness
    modules and packages its numbers come from) and ``program_files(name)`` (a command engine's own
    program), as sorted ``path NUL sha256`` lines. Changes whenever any of those files changes, so a
    record keyed by it cannot be mistaken for another build's. Raises ``InvalidInput`` for a
    malformed ``[tool.harness.engines]`` table."""
    parts = {**engine_source_hashes(name), **{f"program:{k}": v for k, v in program_files(name).items()}}
    return sha256_bytes("".join(f"{k}\0{v}\n" for k, v in sorted(parts.items())).encode())
