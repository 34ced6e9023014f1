"""Serving scenarios as data: a YAML file of scenarios, each a list of requests with arrivals
(schema ``harness-serving-scenarios/v1``, ``harness/schemas/serving-scenarios.schema.json``;
the shipped set is ``harness/data/scenarios/serving.yaml``; docs/engine-protocol.md, "Op serve").

A request's prompt is a list of *segments*, each ``tokens`` ids of one of the run's prompts
(``prompt``: its id, or its index in the prompt set taken modulo the set's size, so the shipped
scenarios run on any prompt set), from ``offset`` on, cycled when the prompt is shorter. So a
shared chat header is the same first segment in several requests, a prompt of exactly 64 tokens
is one segment of 64, and a continuation's new turn is its own segments after the history the
engine keeps. ``expect`` states what must happen for the scenario to be measured at all (the
serving probe checks it in the engine's step log): ``overlap: [A, B]`` B's prefill shares a step
with A's decode; ``slot_reuse: [A, B]`` B runs in the slot A had, after A ended; ``cache_hit``:
some of these requests report prefix tokens reused from a cache; ``in_flight: N`` some step runs
N requests; ``speculated``: each of these requests verified drafts in some step (it asked to
speculate with ``draft_max``, capability ``speculative``); ``verify_together``: some step in which
all of these requests verified drafts.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any, Sequence

import yaml

from harness.engines.serving import Arrival, ServeRequest, ServeScenario
from harness.errors import InvalidInput
from harness.fschecks import read_utf8
from harness.measure.prompts import PromptTokens
from harness.validation import best_error, schema_validator
from harness.yamlnodes import duplicate_keys, line_of, load_bounded

SCHEMA_ID = "harness-serving-scenarios/v1"


def shipped_scenarios_path() -> Path:
    """The shipped scenario set, ``harness/data/scenarios/serving.yaml``."""
    return Path(str(resources.files("harness") / "data" / "scenarios" / "serving.yaml"))


def speculative_scenarios_path() -> Path:
    """The shipped speculation-under-traffic set, ``harness/data/scenarios/serving-speculative.yaml``
    (requests with ``draft_max``; for a model with an MTP block)."""
    return Path(str(resources.files("harness") / "data" / "scenarios" / "serving-speculative.yaml"))


@dataclass(frozen=True)
class Scenario:
    """One scenario as written: ``name``, ``why`` (the public bug class it stands for), the raw
    ``requests`` (schema-checked dicts) and ``expect``."""

    name: str
    why: str
    requests: list[dict[str, Any]]
    expect: dict[str, Any]

    def resolve(self, prompts: Sequence[PromptTokens]) -> ServeScenario:
        """The scenario with every prompt segment made token ids from ``prompts`` (the run's
        prompts, tokenized by the reference). Raises ``InvalidInput`` for a prompt id not in the
        set."""
        return ServeScenario(self.name, [ServeRequest(
            id=r["id"], tokens=[t for seg in r["prompt"] for t in _segment(seg, prompts, self.name, r["id"])],
            n_tokens=int(r["n_tokens"]),
            arrival=Arrival(int(r.get("arrival", {}).get("step", 0)), r.get("arrival", {}).get("after"),
                            int(r.get("arrival", {}).get("tokens", 0))),
            abort_after=r.get("abort_after"), continues=r.get("continues"), draft_max=r.get("draft_max")) for r in self.requests])

    @property
    def speculative(self) -> bool:
        """Whether a request of the scenario is served with speculative decoding (``draft_max``)."""
        return any(r.get("draft_max") is not None for r in self.requests)

    def history_tokens(self) -> int:
        """The most positions any request's history reaches (its continued histories, prompt and
        generated tokens but the last): what the model's context must hold."""
        lengths: dict[str, int] = {}
        for r in self.requests:
            prompt = sum(int(s["tokens"]) for s in r["prompt"]) + (lengths[r["continues"]] + 1 if r.get("continues") else 0)
            lengths[r["id"]] = prompt + min(int(r["n_tokens"]), int(r.get("abort_after") or r["n_tokens"])) - 1
        return max(lengths.values())


def _segment(seg: dict[str, Any], prompts: Sequence[PromptTokens], scenario: str, rid: str) -> list[int]:
    which = seg["prompt"]
    if isinstance(which, int):
        p = prompts[which % len(prompts)]
    else:
        p = next((q for q in prompts if q.id == which), None)
        if p is None:
            raise InvalidInput(f"scenario {scenario!r}, request {rid!r}: prompt {which!r} is not in the prompt set "
                               f"({', '.join(q.id for q in prompts)})")
    offset = int(seg.get("offset", 0)) % len(p.tokens)
    return list(itertools.islice(itertools.cycle(p.tokens[offset:] + p.tokens[:offset]), int(seg["tokens"])))


def _check_references(path: Path, root: Any, i: int, sc: dict[str, Any]) -> None:
    """Ids unique; ``after`` and ``continues`` name an earlier request; an arrival's token count
    within what that request emits; ``expect`` names requests of the scenario."""
    seen: dict[str, dict[str, Any]] = {}
    for j, r in enumerate(sc["requests"]):
        where = f"{path}:{line_of(root, ['scenarios', i, 'requests', j])}: scenario {sc['name']!r}, request {r['id']!r}"
        if r["id"] in seen:
            raise InvalidInput(f"{where}: id repeated")
        for field in ("continues",):
            if r.get(field) is not None and r[field] not in seen:
                raise InvalidInput(f"{where}: {field} {r[field]!r} is not an earlier request of the scenario")
        after = r.get("arrival", {}).get("after")
        if after is not None:
            if after not in seen:
                raise InvalidInput(f"{where}: arrival.after {after!r} is not an earlier request of the scenario")
            emits = min(int(seen[after]["n_tokens"]), int(seen[after].get("abort_after") or seen[after]["n_tokens"]))
            if int(r["arrival"]["tokens"]) > emits:
                raise InvalidInput(f"{where}: arrival.tokens {r['arrival']['tokens']} is more than request {after!r} emits ({emits})")
        seen[r["id"]] = r
    ex = sc["expect"]
    for name in [*ex.get("overlap", []), *ex.get("slot_reuse", []), *ex.get("cache_hit", []), *ex.get("speculated", []),
                 *ex.get("verify_together", [])]:
        if name not in seen:
            raise InvalidInput(f"{path}:{line_of(root, ['scenarios', i, 'expect'])}: scenario {sc['name']!r}: expect names "
                               f"request {name!r}, which it does not have")
    for name in [*ex.get("speculated", []), *ex.get("verify_together", [])]:
        if seen[name].get("draft_max") is None:
            raise InvalidInput(f"{path}:{line_of(root, ['scenarios', i, 'expect'])}: scenario {sc['name']!r}: expect names request "
                               f"{name!r} as speculating, but it has no draft_max")
    if ex.get("in_flight", 0) > len(sc["requests"]):
        raise InvalidInput(f"{path}:{line_of(root, ['scenarios', i, 'expect'])}: scenario {sc['name']!r}: expect.in_flight "
                           f"{ex['in_flight']} is more than its {len(sc['requests'])} requests")


def load_scenarios(path: str | Path | None = None) -> list[Scenario]:
    """Read and check a scenario file (default: the shipped set). Raises ``InvalidInput``
    (exit 2), one line naming the file, the line and the field, for an unreadable or non-YAML
    file, a repeated key, a schema violation, a repeated scenario name or request id, or a
    reference (``after``, ``continues``, ``expect``) to a request that is not an earlier one."""
    path = Path(path) if path is not None else shipped_scenarios_path()
    _, text = read_utf8(path, "scenario file", "; scenario files are UTF-8 YAML")
    try:
        root, data = load_bounded(path, text, "a scenario file")
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        raise InvalidInput(f"{path}:{mark.line + 1 if mark else 1}: not YAML ({getattr(e, 'problem', None) or e})") from None
    for keys, line, first in duplicate_keys(root)[:1]:
        raise InvalidInput(f"{path}:{line}: duplicate key {keys[-1]!r} (first at line {first})")
    if not isinstance(data, dict):
        raise InvalidInput(f"{path}:1: a scenario file is a mapping with `schema: {SCHEMA_ID}` and `scenarios:`")
    err = best_error(schema_validator("serving-scenarios.schema.json").iter_errors(data))
    if err is not None:
        field, message = err
        keys = [int(k) if k.isdigit() else k for k in field.split(".")] if field else []
        raise InvalidInput(f"{path}:{line_of(root, keys)}: {field or 'top level'}: {message}")
    names: set[str] = set()
    out = []
    for i, sc in enumerate(data["scenarios"]):
        if sc["name"] in names:
            raise InvalidInput(f"{path}:{line_of(root, ['scenarios', i])}: scenario name {sc['name']!r} repeated")
        names.add(sc["name"])
        _check_references(path, root, i, sc)
        out.append(Scenario(sc["name"], sc["why"], list(sc["requests"]), dict(sc["expect"])))
    return out
