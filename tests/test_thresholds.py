"""thresholds.yaml: every gate has a basis or the file refuses to load (exit 2)."""

from __future__ import annotations

from dataclasses import replace

import textwrap
from pathlib import Path

import pytest

from harness.errors import InvalidInput, Unmeasured
from harness.judge.thresholds import load_thresholds
from harness.judge.tiers import Subject

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
        "schema: harness-thresholds/v2\n"
        "release:\n"
        f"  min_positions: {{value: 64, basis: {DECLARED}}}\n"
        f"  min_cosine: {min_cosine}\n" + extra
    )


def row(weights: str = "F32", cls: str = "f32", cos: float = 0.9999, basis: str = MEASURED_ON_A, probes: bool = True,
        n_layer: int = 8, n_embd: int = 96) -> str:
    out = (f"  - weights: {weights}\n    class: {cls}\n    file_type: ALL_F32\n"
           f"    basis_models: [{{name: '{SHA_A}', n_layer: {n_layer}, n_embd: {n_embd}}}]\n"
           f"    gates:\n      min_cosine: {{value: {cos}, basis: {basis}}}\n"
           f"      max_kld_mean: {{value: 1.0e-6, basis: {basis}}}\n")
    if probes:
        out += f"    probes:\n      min_cosine: {{value: 0.99999, basis: {basis}}}\n      max_kld: {{value: 1.0e-5, basis: {basis}}}\n"
    return out


def subject(weights: str = "F32", cls: str = "f32", n_layer: int = 8, n_embd: int = 96, sha: str = SHA_B, declared: bool = True) -> Subject:
    return Subject(weights, "ALL_F32", cls, declared, n_layer, n_embd, sha)


def test_shipped_file_has_the_release_floor_and_measured_rows():
    """The shipped thresholds come from `harness calibrate`: the declared release gate (0.98 over
    64 positions) and measured rows keyed by weights × class, none looser than the floor."""
    t = load_thresholds(REPO / "thresholds.yaml")
    r = t.resolve(subject(sha="0" * 64, cls="f64"), "fixture:trained-qwen35")
    assert (r.release_min_cosine, r.min_positions, r.near_tie_margin) == (0.98, 64, 0.25)
    assert r.release["min_cosine"].basis_kind == "declared"
    assert r.row is not None and (r.row.weights, r.row.compute_class) == ("F32", "f64")
    g = r.row.gates["min_cosine"]
    assert g["basis"]["kind"] == "measured" and 0.98 < g["value"] < 1
    assert g["basis"]["known_good_floor"] >= g["value"] > max(k["value"] for k in g["basis"]["known_bad"])
    assert {"max_kld_mean", "max_kld_p99"} <= set(r.row.gates)
    assert {"min_cosine", "max_kld", "localize_max_nmse", "localize_min_cosine"} <= set(r.probes)
    keys = {(x.weights, x.compute_class) for x in t.rows}
    for ft_key in ("F32", "F32+Q4_K+Q6_K", "F32+Q8_0"):
        assert {(ft_key, c) for c in ("f64", "f32")} <= keys, ft_key
    assert all(float(x.gates["min_cosine"]["value"]) >= 0.98 for x in t.rows)
    assert len(t.sha256) == 64


def test_a_row_is_never_borrowed_by_another_key_or_class(tmp_path):
    t = load_thresholds(write(tmp_path, base("calibrated:\n" + row("F32", "f32") + row("F32+Q4_K+Q6_K", "f32", 0.99))))
    assert t.resolve(subject("F32", "f32")).row.compute_class == "f32"
    other_class = t.resolve(subject("F32", "bf16"))
    assert other_class.row is None and other_class.row_misfit == "no calibrated row for weights F32 (ALL_F32), class bf16"
    other_weights = t.resolve(subject("F32+Q5_K+Q6_K", "f32"))
    assert other_weights.row is None and "F32+Q5_K+Q6_K" in other_weights.row_misfit
    with pytest.raises(Unmeasured, match="class bf16"):
        other_class.gate("min_cosine", "probes")  # no row: the probe tolerances are unmeasured, not borrowed


def test_a_row_fits_models_up_to_twice_its_basis(tmp_path):
    t = load_thresholds(write(tmp_path, base("calibrated:\n" + row(n_layer=8, n_embd=96))))
    assert t.resolve(subject(n_layer=16, n_embd=192)).row is not None
    deep = t.resolve(subject(n_layer=17, n_embd=96))
    assert deep.row is None and "n_layer 8, n_embd 96" in deep.row_misfit and "17 × 96" in deep.row_misfit
    assert t.resolve(subject(n_layer=8, n_embd=193)).row is None


def test_a_row_looser_than_the_release_floor_is_refused_naming_it(tmp_path):
    p = write(tmp_path, base("calibrated:\n" + row("F32", "f32") + row("F32+Q8_0", "bf16", 0.97)))
    with pytest.raises(InvalidInput) as err:
        load_thresholds(p)
    msg = str(err.value)
    assert err.value.exit_code == 2
    assert msg.startswith(f"{p}:") and "calibrated[1] (weights F32+Q8_0, class bf16)" in msg
    assert "0.97 is looser than the release floor 0.98" in msg


def test_two_rows_for_one_key_are_refused(tmp_path):
    with pytest.raises(InvalidInput, match=r"calibrated\[1\] \(weights F32, class f32\) repeats the key of calibrated\[0\]"):
        load_thresholds(write(tmp_path, base("calibrated:\n" + row() + row(cos=0.9998))))


def test_one_key_may_have_a_row_per_architecture_and_each_judges_its_own(tmp_path):
    dense = row(cos=0.9999).replace(f"name: '{SHA_A}'", f"name: '{SHA_A}', arch: qwen35")
    moe = row(cos=0.9995).replace(f"name: '{SHA_A}'", f"name: '{SHA_A}', arch: qwen35moe")
    t = load_thresholds(write(tmp_path, base("calibrated:\n" + dense + moe)))
    assert t.resolve(replace(subject(), arch="qwen35moe")).row.gates["min_cosine"]["value"] == 0.9995
    assert t.resolve(replace(subject(), arch="qwen35")).row.gates["min_cosine"]["value"] == 0.9999
    with pytest.raises(InvalidInput, match=r"repeats the key of calibrated\[0\]; one row per weights × class × architecture"):
        load_thresholds(write(tmp_path, base("calibrated:\n" + moe + moe)))


def test_v1_files_are_refused_with_the_command_that_rewrites_them(tmp_path):
    p = write(tmp_path, base().replace("harness-thresholds/v2", "harness-thresholds/v1").replace("release:", "gates:"))
    with pytest.raises(InvalidInput, match="re-run `harness calibrate`"):
        load_thresholds(p)


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
    assert msg.startswith(f"{p}:{line}: release.min_cosine has no basis")


def test_row_gate_without_basis_names_the_row(tmp_path):
    text = base("calibrated:\n" + row()).replace(f"min_cosine: {{value: 0.9999, basis: {MEASURED_ON_A}}}", "min_cosine: {value: 0.9999}")
    with pytest.raises(InvalidInput, match=r":11: calibrated\.0\.gates\.min_cosine has no basis"):
        load_thresholds(write(tmp_path, text))


def test_probe_without_basis_is_invalid(tmp_path):
    p = write(tmp_path, base("probes:\n  split_prompt_cosine: 0.9999\n"))
    with pytest.raises(InvalidInput, match=r":6: probes\.split_prompt_cosine has no basis"):
        load_thresholds(p)


def test_incomplete_measured_basis_is_invalid(tmp_path):
    p = write(tmp_path, base(min_cosine="{value: 0.99, basis: {kind: measured, command: x, n: 10}}"))
    with pytest.raises(InvalidInput) as err:
        load_thresholds(p)
    msg = str(err.value)
    assert msg.startswith(f"{p}:4: release.min_cosine.basis: invalid basis:")
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
        schema: harness-thresholds/v2
        release:
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
        (base().replace("v2", "v3"), "harness-thresholds/v2"),
        (base("calibrated:\n" + row()).replace("class: f32", "class: f8"), "'f8' is not one of"),
        (base("calibrated:\n" + row()).replace("weights: F32", "weights: f32 weights"), "does not match"),
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


def test_measured_and_declared_parse_and_resolve(tmp_path):
    p = write(tmp_path, base("report_only: {near_tie_margin: 0.5}\n"
                             f"probes:\n  localize_max_nmse: {{value: 0.001, basis: {DECLARED}}}\n"
                             "calibrated:\n" + row()))
    t = load_thresholds(p)
    a = t.resolve(subject(sha=SHA_A))  # measured on itself: not flagged
    g = a.row.gates["min_cosine"]
    assert (g["value"], g["basis"]["kind"], g["basis"]["model"]) == (0.9999, "measured", SHA_A)
    assert g["basis"]["n"] == 2048 and g["basis"]["date"] == "2026-11-20"  # unquoted YAML date kept as text
    assert g["basis"]["known_bad"] == [{"value": 0.41, "what": "scrambled position"}]
    assert a.row.source == f"{p} calibrated[0]"
    assert a.min_positions == 64 and a.release["min_positions"].source == "release"
    assert a.near_tie_margin == 0.5
    probe = a.gate("min_cosine", "probes")
    assert (probe.value, probe.basis_model_differs, probe.source) == (0.99999, False, f"{p} calibrated[0].probes")
    b = t.resolve(subject(sha=SHA_B))  # measured on another model: flagged
    assert b.gate("max_kld", "probes").basis_model_differs is True and "probes.max_kld" in b.basis_mismatches
    receipt = b.to_receipt()
    assert receipt["release"]["min_cosine"]["value"] == 0.98
    assert receipt["calibrated"]["weights"] == "F32" and receipt["calibrated_misfit"] is None
    assert receipt["subject"]["compute_class"] == "f32"
    assert receipt["sha256"] == t.sha256


def test_missing_gate_is_unmeasured_not_pass(tmp_path):
    r = load_thresholds(write(tmp_path, base())).resolve(subject())
    with pytest.raises(Unmeasured) as err:
        r.gate("split_prompt_cosine", "probes")
    assert err.value.exit_code == 5
