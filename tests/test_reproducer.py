"""The one failure formatter: the case line, the likely cause from the mutant table, escaping."""

from __future__ import annotations

from harness.judge.reproducer import (
    MAX_CAUSES,
    Reproducer,
    causes_breaking,
    causes_first_at,
    failure_message,
    format_chunks,
)
from harness.engines.mutants import MUTANTS, SHOWS_FIRST_AT

SHA = "0123456789abcdef" * 4


def test_chunks_are_written_compactly():
    assert format_chunks(None) == format_chunks([]) == "whole"
    assert format_chunks([1, 159]) == "[1, 159]"
    assert format_chunks([16] + [1] * 64) == "[16, 1×64]"
    assert format_chunks([1, 1, 1, 5]) == "[1, 1, 1, 5]"  # runs under four stay spelled out
    assert format_chunks([2, 2, 2, 2, 7, 7, 7, 7, 7]) == "[2×4, 7×5]"


def test_the_case_line_names_what_reruns_it():
    c = Reproducer("mutant:x", "fixture:tiny-qwen35", SHA, "p1", 80, [40, 40], overrides=["qwen35.block_count=int:8"])
    assert c.where() == ("candidate mutant:x, model fixture:tiny-qwen35 sha256 0123456789ab with --override-kv "
                         "qwen35.block_count=int:8, prompt 'p1', n_tokens 80, chunks [40, 40]")
    assert Reproducer("oracle", "m.gguf", SHA).where() == "candidate oracle, model m.gguf sha256 0123456789ab"
    assert c.harness("probe", "--only", "split") == (
        "harness probe --candidate mutant:x --model fixture:tiny-qwen35 --override-kv qwen35.block_count=int:8 --only split")
    spaced = Reproducer("oracle", "/tmp/my model.gguf", SHA, prompts_file="/tmp/p.jsonl", thresholds_file="t.yaml")
    assert spaced.harness("localize") == ("harness localize --candidate oracle --model '/tmp/my model.gguf' "
                                          "--prompts /tmp/p.jsonl --thresholds t.yaml")


def test_likely_causes_come_from_the_mutant_table():
    assert causes_breaking("QE2E-PRB-006") == [f"{MUTANTS[n].bug_class} (as mutant:{n})" for n in ("conv-state-dropped", "ssm-state-reset")]
    assert causes_first_at("attention", "attn_gated") == ["attention output gate dropped (as mutant:attn-output-gate-dropped)"]
    assert causes_first_at("DeltaNet", "attn_gated") == []  # the layer type matters
    assert set(SHOWS_FIRST_AT) == set(MUTANTS)
    c = Reproducer("e", "m", SHA)
    assert failure_message("n", c, ["a", "b"], "fallback") == "n (candidate e, model m sha256 0123456789ab); likely cause: a or b"
    assert failure_message("n", c, [], "fallback").endswith("likely cause: fallback")
    many = [str(i) for i in range(MAX_CAUSES + 1)]
    assert failure_message("n", c, many, "look elsewhere").endswith("likely cause: look elsewhere")
    assert failure_message("n", c, ["a"], "f", "harness x").endswith("likely cause: a; reproduce: harness x")


def test_untrusted_strings_reach_no_terminal_as_control_characters():
    c = Reproducer("evil\x1b[2J", "m", SHA, "p\nq", 3)
    line = failure_message("tensor \x07x", c, [], "f", c.harness("localize"))
    assert all(ch.isprintable() for ch in line), line
    assert "evil\\x1b[2J" in line and "prompt 'p\\nq'" in line and "\\x07" in line
