"""``harness doctor``: what this machine has for the harness, read without running an engine.

- the host as every receipt records it (``harness.evidence.receipts.host_info``: hostname,
  platform, Python, CPU count and model name);
- each extra of ``[project.optional-dependencies]`` (server, mlx, hf, dist, test): its
  requirements that apply here (their environment markers evaluated), each installed version or
  None, and whether the extra is installed (every requirement found);
- llama-cpp-python: its version as a receipt names the reference (``llama-cpp-python X``), the
  commit of its vendored llama.cpp (the ``COMMIT`` file of the cache's build of that version,
  ``scripts/build_llama_server.sh``; None when not built) and the CPU feature line receipts record
  as ``engines.*.build.cpu_features``: ``llama_print_system_info()``, the call the llama.cpp worker
  makes (``harness/engines/_llamacpp_worker.py``), run in a child process so a crash of the
  library cannot take the report with it;
- which of llama.cpp's tools are built (``harness.paths.llama_tool``: ``llama-server``,
  ``llama-quantize``, ``llama-imatrix``, ``llama-perplexity``);
- the fixtures cache (``harness.fixtures.synthetic.cache_dir``): its folder, files and bytes;
- the metrics' row kernel (``harness.measure.rowkernel.kernel_status``): compiled (its cached
  library) or the numpy path, and why (building it on first call, about a second).

Nothing here fails: what is missing is reported as missing (``None``), and the command exits 0.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

from harness.evidence.receipts import host_info
from harness.fixtures.synthetic import cache_dir
from harness.paths import SOURCE_ROOT, cache_root, llama_tool

DISTRIBUTION = "qwen35-harness"
EXTRAS = ("server", "mlx", "hf", "dist", "test")
"""The extras of pyproject.toml ``[project.optional-dependencies]`` reported, in this order."""

LLAMA_TOOLS = ("llama-server", "llama-quantize", "llama-imatrix", "llama-perplexity")
"""llama.cpp's tools the harness runs (``harness.paths.llama_tool``)."""

_SYSTEM_INFO = ("import json, llama_cpp; print(json.dumps({'llama_cpp_python': getattr(llama_cpp, '__version__', 'unknown'), "
                "'system_info': (llama_cpp.llama_print_system_info() or b'').decode(errors='replace').strip()}))")
# the worker's own two expressions (harness/engines/_llamacpp_worker.py main: info), in a child process


def _requirements() -> list[str]:
    """The harness's requirement strings: the installed distribution's metadata, else (a checkout
    run from its folder without an install) pyproject.toml's ``[project.optional-dependencies]``
    written as ``name; extra == "x"``."""
    try:
        reqs = metadata.requires(DISTRIBUTION)
        if reqs:
            return list(reqs)
    except metadata.PackageNotFoundError:
        pass
    import tomllib

    try:
        project = tomllib.loads((SOURCE_ROOT / "pyproject.toml").read_text(encoding="utf-8")).get("project", {})
    except (OSError, tomllib.TOMLDecodeError):
        return []
    out = []
    for extra, reqs in (project.get("optional-dependencies") or {}).items():
        for r in reqs:
            req, _, marker = r.partition(";")
            out.append(f'{req.strip()}; ({marker.strip()}) and extra == "{extra}"' if marker.strip() else f'{req.strip()}; extra == "{extra}"')
    return out


def _version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def extras() -> dict[str, dict[str, Any]]:
    """Per extra of ``EXTRAS``: ``installed`` (every requirement that applies here is installed)
    and ``packages``: ``[{name, requirement, version}]`` (version None when missing), a
    requirement applying when its marker holds for this interpreter and platform
    (``packaging.markers``)."""
    from packaging.requirements import InvalidRequirement, Requirement

    out: dict[str, dict[str, Any]] = {e: {"installed": True, "packages": []} for e in EXTRAS}
    for text in _requirements():
        try:
            req = Requirement(text)
        except InvalidRequirement:
            continue
        for extra in EXTRAS:
            if req.marker is None or not req.marker.evaluate({"extra": extra}):
                continue
            if req.marker.evaluate({"extra": "\0none"}):  # a base requirement, not this extra's
                continue
            version = _version(req.name)
            out[extra]["packages"].append({"name": req.name, "requirement": str(req.specifier) or "*", "version": version})
            out[extra]["installed"] &= version is not None
    return out


def llama_cpp_commit(version: str | None) -> str | None:
    """The vendored llama.cpp commit of llama-cpp-python ``version``: the ``COMMIT`` file of the
    cache's build folder (``<cache_root>/llama.cpp-<commit>/``) whose ``VERSION`` is ``version``;
    None when no build of it is there."""
    if version is None:
        return None
    for root in sorted(cache_root().glob("llama.cpp-*")):
        try:
            if (root / "VERSION").read_text().strip() == version:
                return (root / "COMMIT").read_text().strip() or None
        except OSError:
            continue
    return None


def llama_cpp(timeout_s: float = 60.0) -> dict[str, Any]:
    """llama-cpp-python as receipts record the reference: ``version`` (``llama-cpp-python X``,
    ``engines.reference.version``), ``cpu_features`` (``engines.reference.build.cpu_features``),
    ``commit`` (``llama_cpp_commit``); ``error`` (one line) when the library is missing or its
    child process failed, the other fields then None."""
    installed = _version("llama_cpp_python")
    rec: dict[str, Any] = {"version": None, "cpu_features": None, "commit": llama_cpp_commit(installed), "error": None}
    if installed is None:
        rec["error"] = "llama-cpp-python is not installed"
        return rec
    try:
        p = subprocess.run([sys.executable, "-c", _SYSTEM_INFO], capture_output=True, text=True, timeout=timeout_s,
                           env={**os.environ, "GGML_NO_BACKTRACE": "1"})
        facts = json.loads(p.stdout.strip().splitlines()[-1]) if p.returncode == 0 and p.stdout.strip() else None
    except (OSError, subprocess.TimeoutExpired, ValueError) as e:
        facts, p = None, None
        rec["error"] = f"llama_cpp could not be loaded: {type(e).__name__}: {e}"
    if facts is None:
        if rec["error"] is None:
            tail = (p.stderr.strip().splitlines() or [""])[-1] if p is not None else ""
            rec["error"] = f"llama_cpp could not be loaded (exit {p.returncode if p is not None else '?'}): {tail[:300]}"
        return rec
    rec["version"] = f"llama-cpp-python {facts['llama_cpp_python']}"
    rec["cpu_features"] = facts["system_info"]
    return rec


def _folder_size(folder: Path) -> tuple[int, int]:
    """(files, bytes) under ``folder``, symbolic links not followed; (0, 0) when it is missing."""
    files = size = 0
    for dirpath, _, names in os.walk(folder):
        for n in names:
            try:
                st = os.lstat(os.path.join(dirpath, n))
            except OSError:
                continue
            files += 1
            size += st.st_size
    return files, size


def doctor() -> dict[str, Any]:
    """Everything ``harness doctor`` reports (module docstring), JSON-ready: ``host``,
    ``harness`` (version, source folder), ``extras``, ``llama_cpp``, ``llama_tools`` (name →
    path or None), ``fixtures_cache`` (``path``, ``exists``, ``files``, ``bytes``) and
    ``metrics_kernel`` (``path``: compiled or numpy, ``detail``). Never raises for something missing."""
    from harness.measure.rowkernel import kernel_status

    fx = cache_dir()
    files, size = _folder_size(fx)
    return {
        "host": host_info(),
        "harness": {"version": _version(DISTRIBUTION), "source": str(SOURCE_ROOT)},
        "extras": extras(),
        "llama_cpp": llama_cpp(),
        "llama_tools": {name: (str(p) if (p := llama_tool(name)) else None) for name in LLAMA_TOOLS},
        "fixtures_cache": {"path": str(fx), "exists": fx.is_dir(), "files": files, "bytes": size},
        "metrics_kernel": kernel_status(),
    }
