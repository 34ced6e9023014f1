"""thresholds.yaml: every gate has a basis or the file refuses to load (exit 2)."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from harness.errors import InvalidInput, Unmeasured
from harness.gates.thresholds import load_thresholds

REPO = Path(__file__).resolve().parents[1]
SHA_A = "a" * 64
SHA_B = "b" * 64

DECLARED = "{kind: declared, who: release team, why: not calibrated yet}"
MEASURED_ON_A = (
    "{kind: measured, command: 'harness parity --model m.gguf', n: 2048, model: '" + SHA_A + "',"
    " date: 2026-11-20, known_good_floor: 0.9991, known_bad: [{value: 0.41, what: scrambled position}]}"
)


def write(tmp_path: Path, text: str, name: str = "thresholds.yaml") -> Path:
    p = tmp_path / name
    p.write_text(textwrap.dedent(text).lstrip())
    return p


def base(extra: str = "", min_cosine: str = f"{{value: 0.98, basis: {DECLARED}}}") -> str:
    return (
        "schema: harness-thresholds/v1\n"
        "gates:\n"
        f"  min_positions: {{value: 64, basis: {DECLARED}}}\n"
        f"  min_cosine: {min_cosine}\n" + extra
    )


def test_shipped_file_carries_calibrated_gates():
    """The shipped thresholds come from `harness calibrate`: measured on the trained model, with
    per-quant rows that apply to any model of that type (flagged when measured on another)."""
    t = load_thresholds(REPO / "thresholds.yaml")
    r = t.for_model("fixture:trained-qwen35")
    assert (r.min_positions, r.near_tie_margin) == (64, 0.25)
    assert 0.98 <= r.min_cosine < 1
    g = r.gates["min_cosine"]
    assert g.basis_kind == "measured" and g.basis["model"] == "fixture:trained-qwen35" and g.basis_model_differs is False
    assert g.basis["known_good_floor"] >= r.min_cosine > max(k["value"] for k in g.basis["known_bad"])
    assert {"max_kld_mean", "max_kld_p99"} <= set(r.gates)
    assert r.basis_mismatches == []
    assert len(t.sha256) == 64
    q = t.for_model("0" * 64, "fixture:someone-else", "quant:Q4_K_M")
    assert q.min_cosine < r.min_cosine  # activation quantization: a looser per-quant row
    assert "gates.min_cosine" not in q.basis_mismatches or q.gates["min_cosine"].basis_model_differs


@pytest.mark.parametrize(
    "min_cosine, line",
    [
        ("0.98", 4),  # a bare number
        ("{value: 0.98}", 4),  # a value without its basis
    ],
)
def test_gate_without_basis_is_invalid_and_names_key_and_line(tmp_path, min_cosine, line):
    p = write(tmp_path, base(min_cosine=min_cosine))
    with pytest.raises(InvalidInput) as err:
        load_thresholds(p)
    assert err.value.exit_code == 2
    msg = str(err.value)
    assert msg.startswith(f"{p}:{line}: gates.min_cosine has no basis")


def test_override_without_basis_names_the_override(tmp_path):
    p = write(tmp_path, base('models:\n  "fixture:tiny":\n    gates:\n      min_cosine: {value: 0.99}\n'))
    with pytest.raises(InvalidInput, match=r":8: models\.fixture:tiny\.gates\.min_cosine has no basis"):
        load_thresholds(p)


def test_probe_without_basis_is_invalid(tmp_path):
    p = write(tmp_path, base("probes:\n  split_prompt_cosine: 0.9999\n"))
    with pytest.raises(InvalidInput, match=r":6: probes\.split_prompt_cosine has no basis"):
        load_thresholds(p)


def test_incomplete_measured_basis_is_invalid(tmp_path):
    p = write(tmp_path, base(min_cosine="{value: 0.99, basis: {kind: measured, command: x, n: 10}}"))
    with pytest.raises(InvalidInput) as err:
        load_thresholds(p)
    msg = str(err.value)
    assert msg.startswith(f"{p}:4: gates.min_cosine.basis: invalid basis:")
    for missing in ("model", "date", "known_good_floor", "known_bad"):
        assert f"'{missing}' is a required property" in msg


def test_declared_basis_needs_who_and_why(tmp_path):
    p = write(tmp_path, base(min_cosine="{value: 0.99, basis: {kind: declared, who: me}}"))
    with pytest.raises(InvalidInput, match="'why' is a required property"):
        load_thresholds(p)


def test_yaml_syntax_error_names_file_and_line(tmp_path):
    p = write(
        tmp_path,
        """
        schema: harness-thresholds/v1
        gates:
          min_positions: {value: 64, basis: {kind: declared, who: a, why: b}
          min_cosine: {value: 0.98, basis: {kind: declared, who: a, why: b}}
        """,
    )
    with pytest.raises(InvalidInput) as err:
        load_thresholds(p)
    assert str(err.value).startswith(f"{p}:4:")
    assert "YAML syntax error" in str(err.value)


def test_duplicate_key_is_rejected_with_both_lines(tmp_path):
    p = write(tmp_path, base(f"  min_cosine: {{value: 0.5, basis: {DECLARED}}}\n"))
    with pytest.raises(InvalidInput, match=r":5: duplicate key 'min_cosine' \(first at line 4\)"):
        load_thresholds(p)


@pytest.mark.parametrize(
    "text, match",
    [
        (base(min_cosine=f"{{value: 1.5, basis: {DECLARED}}}"), "1.5 is greater than the maximum of 1"),
        (base(min_cosine=f"{{value: .nan, basis: {DECLARED}}}"), "gates need finite numbers"),
        (base().replace("value: 64", "value: 6.5"), "6.5 is not of type 'integer'"),
        (base().replace("v1", "v2"), "harness-thresholds/v1"),
        (base('models:\n  "m.gguf": {}\n'), "does not match"),
        (base("extra: 1\n"), "Additional properties"),
    ],
)
def test_schema_violations_are_invalid(tmp_path, text, match):
    with pytest.raises(InvalidInput, match=match):
        load_thresholds(write(tmp_path, text))


def test_missing_and_unreadable_files_are_invalid(tmp_path):
    with pytest.raises(InvalidInput, match="cannot read"):
        load_thresholds(tmp_path / "absent.yaml")
    (tmp_path / "bin.yaml").write_bytes(b"\xff\xfe\x00")
    with pytest.raises(InvalidInput, match="not UTF-8"):
        load_thresholds(tmp_path / "bin.yaml")


def test_measured_and_declared_parse_and_per_model_override(tmp_path):
    p = write(
        tmp_path,
        base(
            "report_only: {near_tie_margin: 0.5}\n"
            "probes:\n"
            f"  split_prompt_cosine: {{value: 0.99999, basis: {DECLARED}}}\n"
            "models:\n"
            f"  '{SHA_A}':\n"
            "    gates:\n"
            f"      min_cosine: {{value: 0.9985, basis: {MEASURED_ON_A}}}\n"
            "  'fixture:tiny':\n"
            "    gates:\n"
            f"      min_cosine: {{value: 0.95, basis: {DECLARED}}}\n"
            "    probes:\n"
            f"      split_prompt_cosine: {{value: 0.999, basis: {MEASURED_ON_A}}}\n"
        ),
    )
    t = load_thresholds(p)

    a = t.for_model(SHA_A)  # measured on itself: not flagged
    g = a.gates["min_cosine"]
    assert (g.value, g.basis_kind, g.basis_model, g.basis_model_differs) == (0.9985, "measured", SHA_A, False)
    assert g.basis["n"] == 2048 and g.basis["date"] == "2026-11-20"  # unquoted YAML date kept as text
    assert g.basis["known_bad"] == [{"value": 0.41, "what": "scrambled position"}]
    assert g.source == f'models["{SHA_A}"].gates'
    assert a.min_positions == 64 and a.gates["min_positions"].source == "gates"
    assert a.near_tie_margin == 0.5

    b = t.for_model(SHA_B)  # no override: the declared default
    assert b.min_cosine == 0.98 and b.gates["min_cosine"].basis_kind == "declared"

    # Both the fixture name and the sha256 have overrides: the primary id (sha256) wins for
    # min_cosine, the fixture name's probe override still applies, and its measured basis was
    # taken on model A, not this subject: flagged.
    tiny = t.for_model(SHA_B, "fixture:tiny")
    assert tiny.min_cosine == 0.95
    probe = tiny.gate("split_prompt_cosine", "probes")
    assert (probe.value, probe.basis_model_differs) == (0.999, True)
    assert tiny.basis_mismatches == ["probes.split_prompt_cosine"]
    both = t.for_model(SHA_A, "fixture:tiny")
    assert both.min_cosine == 0.9985

    receipt = tiny.to_receipt()
    assert receipt["gates"]["min_cosine"]["value"] == 0.95
    assert receipt["probes"]["split_prompt_cosine"]["basis_model_differs"] is True
    assert receipt["sha256"] == t.sha256


def test_missing_gate_is_unmeasured_not_pass(tmp_path):
    r = load_thresholds(write(tmp_path, base())).for_model(SHA_A)
    with pytest.raises(Unmeasured) as err:
        r.gate("split_prompt_cosine", "probes")
    assert err.value.exit_code == 5
