"""Harness error types and the one table of verdicts and exit codes (docs/design.md).

Every failure the harness reports to a user is one of these exceptions; the CLI turns each into
a one-line message and its documented exit code, never a traceback.

| verdict        | exit | exception          |
|----------------|------|--------------------|
| PASS           | 0    | (none)             |
| FAIL           | 1    | (a verdict, not an error) |
| USAGE/INVALID  | 2    | ``InvalidInput``   |
| ENGINE-ERROR   | 3    | ``EngineError``    |
| NOT-COMPARABLE | 4    | ``NotComparable``  |
| UNMEASURED     | 5    | ``Unmeasured``     |

``harness signoff`` uses the same codes for its verdicts (docs/release.md): SIGNED 0, BLOCKED 1
when anything failed or is stale, BLOCKED 5 when nothing failed but something is missing or
unmeasured, 2 for an invalid manifest (``harness.release.signoff.Signoff.exit_code``).
"""

from __future__ import annotations

from enum import Enum
from typing import Iterable


class Verdict(str, Enum):
    """Verdicts shared by every command; ``exit_code`` is the process exit status."""

    PASS = "PASS"
    FAIL = "FAIL"
    INVALID = "INVALID"
    ENGINE_ERROR = "ENGINE-ERROR"
    NOT_COMPARABLE = "NOT-COMPARABLE"
    UNMEASURED = "UNMEASURED"

    @property
    def exit_code(self) -> int:
        return EXIT_CODES[self]

    @staticmethod
    def worst(verdicts: Iterable[Verdict | str]) -> Verdict:
        """The most severe of ``verdicts`` (``SEVERITY``): the verdict of a run over several
        models. Raises ``ValueError`` for an empty sequence."""
        return min((Verdict(v) for v in verdicts), key=SEVERITY.index)


SEVERITY = (Verdict.FAIL, Verdict.ENGINE_ERROR, Verdict.NOT_COMPARABLE, Verdict.INVALID, Verdict.UNMEASURED, Verdict.PASS)
"""Verdicts from most to least severe: a wrong result beats a failure to produce one, which beats
bad input, which beats nothing measured."""

EXIT_CODES = {
    Verdict.PASS: 0,
    Verdict.FAIL: 1,
    Verdict.INVALID: 2,
    Verdict.ENGINE_ERROR: 3,
    Verdict.NOT_COMPARABLE: 4,
    Verdict.UNMEASURED: 5,
}


class HarnessError(Exception):
    """Base class: a user-facing error with a verdict and an exit code.

    ``str(err)`` is the one-line message the CLI prints.
    """

    verdict: Verdict = Verdict.INVALID

    @property
    def exit_code(self) -> int:
        return self.verdict.exit_code


class InvalidInput(HarnessError):
    """Bad arguments, invalid contract/config, threshold without basis, unreadable or
    truncated file, unsupported architecture (exit 2)."""

    verdict = Verdict.INVALID


class EngineError(HarnessError):
    """An engine could not load, crashed, timed out or returned malformed output (exit 3).

    ``stderr_tail`` holds the engine's last stderr lines when there are any.
    """

    verdict = Verdict.ENGINE_ERROR

    def __init__(self, message: str, stderr_tail: str = ""):
        super().__init__(message)
        self.stderr_tail = stderr_tail


class NotComparable(HarnessError):
    """Token ids, vocab size or model differ between the two sides (exit 4)."""

    verdict = Verdict.NOT_COMPARABLE


class Unmeasured(HarnessError):
    """Too few positions, or nothing could be judged (exit 5)."""

    verdict = Verdict.UNMEASURED
