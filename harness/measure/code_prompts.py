"""Code prompt sets cut from this repository's own Python source, selected deterministically.

The trained MTP heads (``harness/data/fixtures/mtp/*.recipe.json``) were trained on the Python
standard library; the harness's own source is Python they never saw, so a head drafts it about as
well as held-out text of its training corpus, far better than the shipped prose prompts. Two sets
are committed as data (``harness/data/prompts/``), each written by ``code_prompt_set``:

- ``code.jsonl``, from ``harness/``: the speculative probe's code cases (shipped, judged);
- ``code-calibration.jsonl``, from ``tests/``: what ``harness calibrate --speculative`` measures
  the acceptance gate on, so the gate is calibrated on one set and judged on another.

Selection: the ``.py`` files under the folder, ordered by the sha256 of their path relative to
the repository (so no alphabetical neighbourhood dominates), files without a top-level ``def``
skipped; from each the source from its first top-level ``def`` on, cut at a line end to at most
``CHARS`` characters; the first ``COUNT`` files. Regenerate with
``python -m harness.measure.code_prompts`` (the source changes, so the committed text is the
data; its ``source`` field names each file and line).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from harness.paths import DATA_DIR

REPO = Path(__file__).resolve().parents[2]
CODE_PROMPTS = DATA_DIR / "prompts" / "code.jsonl"
"""The shipped code prompt set (from ``harness/``): the speculative probe's code cases."""
CODE_CALIBRATION_PROMPTS = DATA_DIR / "prompts" / "code-calibration.jsonl"
"""The calibration code prompt set (from ``tests/``): the acceptance gate's calibration."""
COUNT = 6
CHARS = 1500


def _first_def(text: str) -> int | None:
    """The character offset of the first top-level ``def`` line of ``text`` (None: none)."""
    at = 0
    for line in text.splitlines(keepends=True):
        if line.startswith("def "):
            return at
        at += len(line)
    return None


def _cut(text: str, chars: int) -> str:
    """``text`` up to the last line end within ``chars`` characters."""
    if len(text) <= chars:
        return text
    end = text.rfind("\n", 0, chars)
    return text[: end + 1 if end > 0 else chars]


def code_prompt_set(folder: str, repo: Path = REPO, count: int = COUNT, chars: int = CHARS) -> list[dict[str, Any]]:
    """The prompts (``{"id", "text", "source"}``) of ``folder`` (relative to ``repo``) by the
    module docstring's selection. Raises ``ValueError`` when fewer than ``count`` files qualify."""
    files = sorted((p for p in (repo / folder).rglob("*.py")), key=lambda p: hashlib.sha256(p.relative_to(repo).as_posix().encode()).hexdigest())
    out = []
    for p in files:
        text = p.read_text(encoding="utf-8")
        at = _first_def(text)
        if at is None:
            continue
        rel = p.relative_to(repo).as_posix()
        line = text.count("\n", 0, at) + 1
        out.append({"id": f"code-{rel.removesuffix('.py').replace('/', '.')}", "text": _cut(text[at:], chars), "source": f"{rel}:{line}"})
        if len(out) == count:
            return out
    raise ValueError(f"only {len(out)} files under {folder} have a top-level def; {count} wanted")


def write_code_prompts() -> None:
    """Write both committed sets (``CODE_PROMPTS``, ``CODE_CALIBRATION_PROMPTS``) from the source."""
    for path, folder in ((CODE_PROMPTS, "harness"), (CODE_CALIBRATION_PROMPTS, "tests")):
        path.write_text("".join(json.dumps(p, ensure_ascii=False) + "\n" for p in code_prompt_set(folder)), encoding="utf-8")


if __name__ == "__main__":
    write_code_prompts()
