"""Failure messages that are reproducers: the one formatter of parity, probe and localize failures.

llama.cpp's ``test-backend-ops`` prints, for every failing case, the op with all the parameters
that reproduce it next to the error it measured and the bound. A harness failure does the same,
in one line (docs/design.md, "Every failure is a reproducer")::

    <the numbers> (candidate C, model M sha256 0123456789ab, prompt 'id', n_tokens N, chunks [..]);
    likely cause: <bug classes>; reproduce: harness ...

- ``Reproducer`` holds the case: candidate, model, the model's sha256 (first 12 hex digits shown),
  prompt id, n_tokens and how the prompt was fed (``chunks``; ``whole`` when in one call).
  ``Reproducer.where()`` is also the reproducer line of the bound tests' failure messages
  (``tests/contracts/conftest.py``, fixture ``where``).
- The likely cause comes from the mutant table (``harness.engines.mutants``): the bug classes of
  the mutants that break the same obligation (``causes_breaking``, for probes) or whose first
  divergence is the same op in the same kind of layer (``causes_first_at``, for localize). When
  no mutant matches, or too many do to narrow anything, the caller's fallback says what to look at.

Strings that came from outside (ids, names, tensor names from an engine) cannot reach a terminal
as control characters: ``failure_message`` passes the whole line through ``printable``, and
commands are ``shlex``-quoted.
"""

from __future__ import annotations

import itertools
import shlex
from dataclasses import dataclass
from typing import Sequence

from harness import display
from harness.config import reproduce_env
from harness.engines.mutants import ALL_MUTANTS, SHOWS_FIRST_AT

MAX_CAUSES = 4
"""More matching bug classes than this do not narrow anything: the fallback is printed instead."""


def printable(s: object) -> str:
    """``str(s)`` with control characters (terminal escapes, newlines) written as ``\\xNN`` escapes:
    ``harness.display.plain``, the harness's one escaping function."""
    return display.plain(s)


def command(*argv: object) -> str:
    """A shell-safe command line (``shlex.quote`` of each ``printable`` argument) to print after
    ``reproduce:``; None arguments are left out."""
    return " ".join(shlex.quote(printable(a)) for a in argv if a is not None)


def format_chunks(chunks: Sequence[int] | None) -> str:
    """How a prompt was fed: ``whole`` (one call), else the piece lengths with runs of four or more
    equal lengths written ``L×count`` (``[16, 1×64]`` is a prefill of 16 then 64 single tokens)."""
    return "[" + ", ".join(_runs(chunks, "×")) + "]" if chunks else "whole"


def _runs(chunks: Sequence[int], times: str) -> list[str]:
    """Piece lengths as text, a run of four or more equal lengths as ``L{times}count``."""
    out: list[str] = []
    for length, group in itertools.groupby(chunks):
        run = len(list(group))
        out.extend([str(length)] * run if run < 4 else [f"{length}{times}{run}"])
    return out


def chunks_arg(chunks: Sequence[int]) -> str:
    """Piece lengths as ``harness localize --chunks`` takes them: comma-separated, runs of four
    or more equal lengths written ``LxCOUNT`` (``16,1x64``); ``parse_chunks_arg`` reads it back."""
    return ",".join(_runs(chunks, "x"))


def parse_chunks_arg(text: str) -> list[int]:
    """``16,1x64`` (or ``16,1×64``) as piece lengths; raises ``ValueError`` for anything else
    (the caller names the option)."""
    out: list[int] = []
    for part in text.replace("×", "x").split(","):
        length, _, count = part.strip().partition("x")
        n = int(count) if count else 1
        if n < 1 or n > 1 << 20:
            raise ValueError(part)
        out.extend([int(length)] * n)
    return out


def chunks_up_to(chunks: Sequence[int], n_tokens: int) -> list[int]:
    """The leading pieces of ``chunks`` that feed the first ``n_tokens`` tokens (the last one cut)."""
    out: list[int] = []
    left = n_tokens
    for c in chunks:
        if left <= 0:
            break
        out.append(min(c, left))
        left -= out[-1]
    return out


CANDIDATE_ARG_COMMANDS = ("parity", "probe")
"""The subcommands that take ``--dtype`` and ``--mlx-folder`` (``harness localize`` runs the candidate
as its engine table makes it)."""


@dataclass(frozen=True)
class Reproducer:
    """The case a failure happened on, enough to run it again by hand.

    ``model`` is what the user named (``fixture:NAME`` or a path); ``sha256`` the file's full hex
    digest; ``overrides`` the ``--override-kv`` flags (``KEY=TYPE:VALUE``) the run applied;
    ``prompt`` a prompt id (or a description when the case spans prompts); ``n_tokens`` the number
    of token ids fed; ``chunks`` the piece lengths (None: fed whole); ``prompts_file`` and
    ``thresholds_file`` the files the run read when not the ones found by default (None);
    ``config`` the config file that defines the engine (``{"path", "sha256"}``:
    ``harness.config.config_record``; None for an engine no config defines), which the
    command carries as ``HARNESS_CONFIG=... HARNESS_CONFIG_SHA256=...``; ``candidate_args`` the
    options that made the candidate (``candidate_flags``: ``--dtype bfloat16``, ``--mlx-folder``).
    """

    candidate: str
    model: str
    sha256: str
    prompt: str | None = None
    n_tokens: int | None = None
    chunks: Sequence[int] | None = None
    overrides: Sequence[str] = ()
    prompts_file: str | None = None
    thresholds_file: str | None = None
    config: dict[str, str] | None = None
    candidate_args: Sequence[str] = ()
    generated: int | None = None
    """Tokens the case generated after the ``n_tokens`` it fed (a generation case: the speculative
    probe); None for a case that compared logits only."""

    def where(self) -> str:
        """``candidate C, model M sha256 0123456789ab[ with --override-kv ...][, prompt 'id',
        n_tokens N, chunks ...][, G generated]``."""
        parts = [f"candidate {printable(self.candidate)}", f"model {printable(self.model)} sha256 {self.sha256[:12]}"]
        if self.overrides:
            parts[-1] += " with " + " ".join(f"--override-kv {printable(o)}" for o in self.overrides)
        if self.prompt is not None:
            parts.append(f"prompt {self.prompt!r}")  # repr escapes control characters
        if self.n_tokens is not None:
            parts += [f"n_tokens {self.n_tokens}", f"chunks {format_chunks(self.chunks)}"]
        if self.generated is not None:
            parts.append(f"{self.generated} generated")
        return ", ".join(parts)

    def harness(self, subcommand: str, *args: object) -> str:
        """The shell-safe ``[HARNESS_CONFIG=FILE HARNESS_CONFIG_SHA256=HEX] harness SUBCOMMAND
        --candidate C --model M [--dtype ...] [--override-kv ...] [--prompts FILE] [--thresholds FILE]
        ARGS`` command line of this case (``command``; the config assignments when ``config`` is
        set; ``candidate_args`` after the model, for the subcommands that take them:
        ``CANDIDATE_ARG_COMMANDS``)."""
        flags = [*(self.candidate_args if subcommand in CANDIDATE_ARG_COMMANDS else ()), *(x for o in self.overrides for x in ("--override-kv", o))]
        flags += ["--prompts", self.prompts_file] if self.prompts_file else []
        flags += ["--thresholds", self.thresholds_file] if self.thresholds_file else []
        env = [printable(a) for a in reproduce_env(self.config)]
        return " ".join([*env, command("harness", subcommand, "--candidate", self.candidate, "--model", self.model, *flags, *args)])


def failure_message(numbers: str, case: Reproducer, causes: Sequence[str], fallback: str, command: str | None = None) -> str:
    """One line: ``numbers (case.where()); likely cause: ...; reproduce: command``.

    ``causes``: bug classes from ``causes_breaking`` / ``causes_first_at``; when there are none, or
    more than ``MAX_CAUSES``, ``fallback`` is the likely cause instead.
    """
    cause = " or ".join(causes) if 0 < len(causes) <= MAX_CAUSES else fallback
    line = f"{numbers} ({case.where()}); likely cause: {cause}"
    return printable(line + (f"; reproduce: {command}" if command else ""))


def _described(names: Sequence[str]) -> list[str]:
    return [f"{ALL_MUTANTS[n].bug_class} (as mutant:{n})" for n in names]


def causes_breaking(obligation: str) -> list[str]:
    """Bug classes of the mutants whose fault breaks contract obligation ``obligation``
    (``Mutant.breaks``), in table order, each naming its mutant."""
    return _described([n for n, m in ALL_MUTANTS.items() if obligation in m.breaks])


def causes_first_at(layer_type: str, op: str) -> list[str]:
    """Bug classes of the mutants whose first divergence is ``op`` in a ``layer_type`` layer
    (``SHOWS_FIRST_AT``), in table order, each naming its mutant."""
    return _described([n for n, at in SHOWS_FIRST_AT.items() if at == (layer_type, op)])
