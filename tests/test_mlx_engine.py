"""The mlx engine (mlx-lm) and the torch-free transformers folder it loads.

The folder tests need safetensors only; the engine tests need the mlx extra (CI installs it:
.ci/run). Everything here runs on the tiny random-weight fixtures in seconds; the acceptance
runs on the trained fixtures (parity at float32 and bfloat16, every probe) are recorded in
evidence/engines/ and rendered on docs/engines.md.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from harness.engines.base import gather
from harness.errors import EngineError, InvalidInput
from harness.fixtures import convert
from harness.model.gguf_model import GGUFModel

pytest.importorskip("safetensors", reason="the mlx extra is not installed: pip install -e .[mlx]")


def _cos(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    a, b = a.astype(np.float64), b.astype(np.float64)
    return (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)


# -- the folder ------------------------------------------------------------------------------
@pytest.mark.parametrize("which", ["tiny_path", "tiny_moe_path"])
def test_folder_round_trip_gives_back_the_gguf_tensors_bit_for_bit(which, request, tmp_path):
    src = GGUFModel(request.getfixturevalue(which))
    folder = convert.write_transformers_folder(src, tmp_path / "hf")
    top = json.loads((folder / "config.json").read_text())
    assert top["model_type"] == ("qwen3_5_moe" if src.hparams.is_moe else "qwen3_5")
    assert top["text_config"]["model_type"].endswith("_text")
    assert top["text_config"]["full_attention_interval"] == 4
    cfg, sd = convert.read_transformers_folder(folder)
    assert sd.keys() == convert.folder_state_dict(src).keys()
    # back to a GGUF through the converter: every tensor equals the original's bytes, except
    # 1 + w and -exp(A_log) where the random fixture's value has no float32 preimage (one ulp off)
    back = GGUFModel(convert.hf_to_gguf(cfg, sd, tmp_path / "back.gguf", "back"))
    assert sorted(back.tensor_names) == sorted(src.tensor_names)
    shifted = 0
    for name in src.tensor_names:
        a = np.asarray(src.tensor(name, dtype=np.float32)).reshape(-1)
        b = np.asarray(back.tensor(name, dtype=np.float32)).reshape(-1)
        if convert._match(convert._GGUF_INDEX, name)[0].transform in (convert.NORM_SHIFT, convert.A_LOG):
            shifted += 1
            assert np.allclose(a, b, rtol=2.5e-7, atol=0), name
        else:
            assert np.array_equal(a, b), name
    assert shifted >= 2 * src.hparams.n_layer
    # and the folder of that GGUF is the first folder, bit for bit (the converter's values have preimages)
    _, sd2 = convert.read_transformers_folder(convert.write_transformers_folder(back, tmp_path / "hf2"))
    assert sd2.keys() == sd.keys() and all(np.array_equal(sd[k], sd2[k]) for k in sd)
    assert back.hparams.recurrent == src.hparams.recurrent


def test_folder_writer_does_not_import_torch(tiny_path, tmp_path):
    code = ("import sys; sys.modules['torch'] = None\n"
            "from harness.fixtures import convert; from harness.model.gguf_model import GGUFModel\n"
            f"convert.write_transformers_folder(GGUFModel({str(tiny_path)!r}), {str(tmp_path / 'hf')!r})\n"
            "print('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


def test_interval_of_layer_types_reproduces_regular_schedules_and_flags_irregular_ones():
    regular = convert.schedule_from_interval(8, 4)
    assert regular[3] == regular[7] == "full_attention" and regular.count("full_attention") == 2
    assert convert.interval_of_layer_types(regular) == 4
    irregular = ["linear_attention", "full_attention", "linear_attention", "linear_attention", "full_attention", "linear_attention"]
    k = convert.interval_of_layer_types(irregular)
    assert k == 2 and convert.schedule_from_interval(6, k) != irregular


# -- the engine ------------------------------------------------------------------------------
from harness.engines import mlx_engine  # noqa: E402  (imports no mlx itself)
pytest.importorskip("mlx_lm", reason="the mlx extra is not installed: pip install -e .[mlx]")

TOKENS = [int(t) for t in np.random.default_rng(7).integers(3, 200, size=40)]


@pytest.fixture(scope="module")
def engines(tmp_path_factory, tiny_path, tiny_moe_path):
    from harness.engines.registry import resolve_engine

    return {p: (resolve_engine("mlx", p), resolve_engine("oracle", p)) for p in (tiny_path, tiny_moe_path)}


@pytest.mark.parametrize("which", ["tiny_path", "tiny_moe_path"])
def test_mlx_f32_logits_match_the_oracle_and_chunks_match_whole(which, request, engines):
    mlx, oracle = engines[request.getfixturevalue(which)]
    whole = gather(mlx.logits(TOKENS), len(TOKENS))
    ref = gather(oracle.logits(TOKENS), len(TOKENS))
    assert whole.shape == ref.shape == (len(TOKENS), mlx.n_vocab)
    assert 1 - _cos(whole, ref).min() < 1e-6
    pieces = gather(mlx.logits(TOKENS, chunks=[7, 1, 1, 31]), len(TOKENS))
    assert 1 - _cos(pieces, whole).min() < 1e-6
    assert mlx.info.compute_class == "f32" and {"chunks", "generate", "prefix_reuse"} <= set(mlx.info.capabilities)


def test_mlx_generate_is_the_argmax_of_its_own_teacher_forced_logits(engines, tiny_path):
    mlx, _ = engines[tiny_path]
    out = mlx.generate(TOKENS[:10], 6)
    assert len(out) == 6
    forced = gather(mlx.logits(TOKENS[:10] + out[:-1]), 15)
    assert [int(np.argmax(r)) for r in forced[9:]] == out


def test_mlx_session_fork_and_continue_equal_fresh_runs(engines, tiny_path):
    mlx, _ = engines[tiny_path]
    A, B, C = TOKENS[:20], TOKENS[20:30], TOKENS[30:]
    ab = gather(mlx.session_logits(A + B, session="s", checkpoints=[20]), 30)
    forked = gather(mlx.session_logits(C, session="f", parent="s", after=20), len(C))
    cont = gather(mlx.session_logits(C, session="s", parent="s", after=30), len(C))
    fresh_ac = gather(mlx.logits(A + C), 20 + len(C))[20:]
    fresh_abc = gather(mlx.logits(A + B + C), len(TOKENS))
    assert 1 - _cos(ab, fresh_abc[:30]).min() < 1e-6
    assert 1 - _cos(forked, fresh_ac).min() < 1e-6
    assert 1 - _cos(cont, fresh_abc[30:]).min() < 1e-6
    # the fork saw A only: it differs from C after A+B
    assert 1 - _cos(forked, cont).min() > 1e-4
    with pytest.raises(EngineError, match="no state after 5 tokens"):
        list(mlx.session_logits(C, session="g", parent="s", after=5))
    mlx.drop_sessions()


def test_mlx_bf16_is_close_but_not_f32(tiny_path, engines):
    mlx32, _ = engines[tiny_path]
    bf = mlx_engine.load_mlx(tiny_path, dtype="bfloat16")
    assert bf.info.compute_class == "bf16"
    a, b = gather(bf.logits(TOKENS), len(TOKENS)), gather(mlx32.logits(TOKENS), len(TOKENS))
    assert 0.9 < _cos(a, b).min() < 1 - 1e-7
    with pytest.raises(InvalidInput, match="float64"):
        mlx_engine.load_mlx(tiny_path, dtype="float64")


# -- the pitfalls it names -------------------------------------------------------------------
def _user_folder(src_path, tmp_path, edit):
    from safetensors.numpy import load_file, save_file

    folder = convert.write_transformers_folder(GGUFModel(src_path), tmp_path / "user")
    sd = load_file(str(folder / "model.safetensors"))
    edit(sd, folder)
    save_file(sd, str(folder / "model.safetensors"))
    return folder


def test_a_folder_whose_norms_hold_one_plus_w_is_named_shifted_twice(tiny_path, tmp_path):
    def shift(sd, folder):
        for k in list(sd):
            if k.endswith(("layernorm.weight", "model.norm.weight", "q_norm.weight", "k_norm.weight")):
                sd[k] = sd[k] + np.float32(1)

    folder = _user_folder(tiny_path, tmp_path, shift)
    with pytest.raises(EngineError, match="shifted twice.*remedy"):
        mlx_engine.load_mlx(tiny_path, folder=folder).model


def test_a_folder_with_mlx_conv_layout_and_unshifted_norms_is_named_shift_missing(tiny_path, tmp_path):
    def mlx_layout(sd, folder):
        for k in list(sd):
            if k.endswith("conv1d.weight"):
                sd[k] = np.ascontiguousarray(np.moveaxis(sd[k], 2, 1))

    folder = _user_folder(tiny_path, tmp_path, mlx_layout)
    with pytest.raises(EngineError, match="shift is missing.*remedy"):
        mlx_engine.load_mlx(tiny_path, folder=folder).model


def test_a_schedule_mlx_cannot_build_is_named_before_loading(tiny_path, tmp_path):
    def interval_8(sd, folder):
        cfg = json.loads((folder / "config.json").read_text())
        cfg["text_config"]["full_attention_interval"] = 8
        (folder / "config.json").write_text(json.dumps(cfg))

    folder = _user_folder(tiny_path, tmp_path, interval_8)
    with pytest.raises(EngineError, match=r"full attention at layers \[7\].*at \[3, 7\].*ignores layer_types"):
        mlx_engine.load_mlx(tiny_path, folder=folder).model
    assert mlx_engine.schedule_mismatch([True, False, True, True, False, True], 2) is not None
    assert mlx_engine.schedule_mismatch([True, True, True, False] * 2, 4) is None


def test_cli_mlx_options_apply_to_mlx_only():
    from harness.cli import _dtype_settings

    assert _dtype_settings("bfloat16", "mlx", "/x") == {"dtype": "bfloat16", "folder": "/x"}
    with pytest.raises(InvalidInput, match="--mlx-folder applies to the mlx engine"):
        _dtype_settings(None, "oracle", "/x")


# -- MoE below float32: the routed experts' product (ExpertMatmul) ---------------------------
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_expert_matmul_is_a_bf16_gemm_with_f32_accumulation_bit_for_bit(dtype):
    """mlx-cpu's GatherMM refuses bf16/f16; ExpertMatmul's product must equal, bit for bit,
    mlx's own dense ``mx.matmul`` in that dtype on the same gathered expert weights (a GEMM whose
    inputs are the bf16 values, accumulated in float32, rounded once to the dtype), and not the
    unrounded float32 product."""
    import mlx.core as mx
    import mlx.nn as nn
    from mlx_lm.models.switch_layers import SwitchGLU, SwitchLinear

    mx.set_default_device(mx.cpu)
    dt = getattr(mx, dtype)
    rng = np.random.default_rng(3)
    E, d_in, d_out, T, k = 5, 96, 40, 70, 2  # T * k >= 64: SwitchGLU's sorted path as well
    lin = SwitchLinear(d_in, d_out, E, bias=False)
    lin.weight = mx.array(rng.standard_normal((E, d_out, d_in)).astype(np.float32)).astype(dt)
    x = mx.array(rng.standard_normal((1, T, 1, 1, d_in)).astype(np.float32)).astype(dt)
    idx = mx.array(rng.integers(0, E, (1, T, k)).astype(np.uint32))
    try:  # the pitfall itself (an mlx that learns bf16 GatherMM makes this moot, not wrong)
        mx.eval(mx.gather_mm(x, lin.weight.swapaxes(-1, -2), rhs_indices=idx))
    except (ValueError, RuntimeError) as e:
        assert "float32" in str(e)

    holder = nn.Module()
    holder.lin = lin
    assert mlx_engine.accumulate_experts_in_f32(holder) == 1 and type(lin).__name__ == "ExpertMatmul"
    assert type(SwitchLinear(2, 2, 2)) is SwitchLinear  # mlx-lm's class is untouched
    got = lin(x, idx)
    dense = mx.matmul(x, lin.weight[idx].swapaxes(-1, -2))  # [1, T, k, 1, d_out], in dt
    assert got.dtype == dt and got.shape == dense.shape == (1, T, k, 1, d_out)
    a, b = np.array(got.astype(mx.float32)), np.array(dense.astype(mx.float32))
    assert np.array_equal(a, b)
    f32 = np.array(mx.matmul(x.astype(mx.float32), lin.weight[idx].astype(mx.float32).swapaxes(-1, -2)))
    assert not np.array_equal(a, f32) and np.allclose(a, f32, rtol=2 ** -7, atol=1e-2)  # rounded, once
    # a whole SwitchGLU (sorted and unsorted) runs in dt and equals its dense bf16 equivalent
    glu = SwitchGLU(d_in, d_out, E)
    glu.update({n: {"weight": mx.array(rng.standard_normal(getattr(glu, n).weight.shape).astype(np.float32)).astype(dt)}
                for n in ("gate_proj", "up_proj", "down_proj")})
    mlx_engine.accumulate_experts_in_f32(glu)
    xs = x.reshape(1, T, d_in)
    for n_tok in (T, 5):
        out = glu(xs[:, :n_tok], idx[:, :n_tok])
        sel = idx[:, :n_tok]
        xe = xs[:, :n_tok, None, None, :]
        up = mx.matmul(xe, glu.up_proj.weight[sel].swapaxes(-1, -2))
        gate = mx.matmul(xe, glu.gate_proj.weight[sel].swapaxes(-1, -2))
        want = mx.matmul(nn.silu(gate) * up, glu.down_proj.weight[sel].swapaxes(-1, -2)).squeeze(-2)
        assert out.dtype == dt
        assert np.array_equal(np.array(out.astype(mx.float32)), np.array(want.astype(mx.float32))), n_tok


def test_mlx_moe_runs_in_bf16_through_expert_matmul(tiny_moe_path, engines):
    mlx32, _ = engines[tiny_moe_path]
    bf = mlx_engine.load_mlx(tiny_moe_path, dtype="bfloat16")
    a, b = gather(bf.logits(TOKENS), len(TOKENS)), gather(mlx32.logits(TOKENS), len(TOKENS))
    assert bf.expert_matmuls == 3 * bf.gguf.hparams.n_layer and mlx32.expert_matmuls == 0
    assert bf.info.compute_class == "bf16" and "rounded to bfloat16" in bf.info.settings["expert_matmul"]
    assert 0.9 < _cos(a, b).min() < 1 - 1e-7


# -- tokenize: mlx-lm's own tokenizer of a folder, or UNMEASURED ------------------------------
def _folder_with_own_tokenizer(src_path, folder):
    """A model folder as a Qwen3.5 checkpoint ships one: the weights (the converter's) and the
    tokenizer files of ``tests/helpers.py`` ``write_qwen35_tokenizer_folder`` (``tokenizer.json``
    written with the ``tokenizers`` library from the GGUF's own vocabulary and merges, Qwen3.5's
    split regex: the Qwen2 pattern with ``\\p{M}`` joining letters, as llama.cpp's
    ``LLAMA_VOCAB_PRE_TYPE_QWEN35``; ``tokenizer_config.json`` naming ``Qwen2Tokenizer``). What
    tokenizes is mlx-lm's ``load_tokenizer``: transformers 5 builds ``Qwen3_5Tokenizer`` from the
    folder's ``model_type`` and its own pipeline (NFC included), taking only the data from the files."""
    import shutil

    sys.path.insert(0, str(Path(__file__).parent))
    from helpers import write_qwen35_tokenizer_folder

    files = write_qwen35_tokenizer_folder(src_path, folder.parent / "tokenizer-files")
    folder = convert.write_transformers_folder(GGUFModel(src_path), folder)
    for name in mlx_engine.TOKENIZER_FILES:
        shutil.copy(files / name, folder / name)
    return folder


def _tokenizer_cli(*args):
    from click.testing import CliRunner

    from harness.cli import cli

    res = CliRunner().invoke(cli, ["tokenizer", "--candidate", "mlx", "--no-evidence", "--json", *args])
    return res.exit_code, json.loads(res.output[res.output.index("{"):]) if "{" in res.output else res.output


def test_mlx_tokenizer_of_a_folder_with_its_own_files_is_judged(tmp_path):
    """On the hostile set mlx-lm's tokenizer gives llama.cpp's ids for every text but two kinds:
    the ones NFC changes (split-utf8's and combining-marks' decomposed forms: transformers'
    Qwen3_5Tokenizer composes them, llama.cpp does not), where its ids are llama.cpp's for the NFC
    form (excused: harness/runs/tokenizer.py ``excuse_normalization``), and special-surface, whose
    special tokens' surface forms transformers parses as specials where llama.cpp, asked with
    ``parse_special`` off, reads text: a FAIL naming that prompt; on the other texts every id is equal."""
    import unicodedata

    from harness.fixtures.resolve import resolve_model
    from harness.measure.prompts import load_prompt_set
    from harness.runs.tokenizer import TOKENIZER_PROMPTS

    folder = _folder_with_own_tokenizer(resolve_model("fixture:trained-qwen35"), tmp_path / "own")
    code, rc = _tokenizer_cli("--model", "fixture:trained-qwen35", "--mlx-folder", str(folder))
    assert code == 1 and rc["verdict"] == "FAIL", rc
    assert rc["message"].startswith("prompt 'special-surface': first difference at position ")
    nfc_changes = [p.id for p in load_prompt_set(TOKENIZER_PROMPTS) if unicodedata.normalize("NFC", p.text) != p.text]
    differ = [c["prompt"] for c in rc["comparisons"] if c["first_diff"] is not None]
    assert nfc_changes == [c["prompt"] for c in rc["comparisons"] if c.get("excused")] == ["split-utf8", "combining-marks"]
    assert differ == ["split-utf8", "combining-marks", "special-surface"]
    settings = rc["engines"]["candidate"]["settings"]
    assert settings["folder"] == "user" and settings["tokenizer"] == "tokenizer.json, tokenizer_config.json"
    # the same texts without those three: every id equal, nothing excused
    keep = tmp_path / "nfc-stable.jsonl"
    keep.write_text("".join(line for line in TOKENIZER_PROMPTS.read_text().splitlines(True)
                            if line.strip() and json.loads(line)["id"] not in differ))
    code, rc = _tokenizer_cli("--model", "fixture:trained-qwen35", "--mlx-folder", str(folder), "--prompts", str(keep))
    assert code == 0 and rc["verdict"] == "PASS" and "NFC" not in rc["message"], rc
    assert len(rc["comparisons"]) == 14 and all(c["first_diff"] is None for c in rc["comparisons"]) and rc["positions"] > 500


def test_mlx_tokenizer_of_the_converted_folder_is_unmeasured_with_its_reason(tmp_path):
    code, rc = _tokenizer_cli("--model", "fixture:trained-qwen35")
    assert code == 5 and rc["verdict"] == "UNMEASURED", rc
    assert "the harness writes mlx-lm's folder from the GGUF" in rc["unmeasured"]
    assert "checking its own conversion" in rc["unmeasured"] and "--mlx-folder" in rc["unmeasured"]
    assert rc["comparisons"] == [] and rc["engines"]["candidate"]["settings"]["tokenizer"] == "none of its own"
    # a user folder without tokenizer files has none either
    from harness.fixtures.resolve import resolve_model

    bare = convert.write_transformers_folder(GGUFModel(resolve_model("fixture:trained-qwen35")), tmp_path / "bare")
    code, rc = _tokenizer_cli("--model", "fixture:trained-qwen35", "--mlx-folder", str(bare))
    assert code == 5 and "holds neither tokenizer.json nor tokenizer_config.json" in rc["unmeasured"]


# -- a folder of another model (issue 48) -----------------------------------------------------
def test_a_folder_of_another_model_is_not_comparable_and_named(tiny_path, tmp_path):
    """``--mlx-folder`` holding another model than the GGUF was ENGINE-ERROR (exit 3) without the
    folder's name; the two sides would run different models: NOT-COMPARABLE (exit 4), naming it."""
    from harness.errors import NotComparable
    from harness.fixtures.synthetic import build

    other = convert.write_transformers_folder(GGUFModel(build("small-qwen35")), tmp_path / "small")
    with pytest.raises(NotComparable) as e:
        mlx_engine.load_mlx(tiny_path, folder=other).model
    assert str(e.value) == f"--mlx-folder {other} holds another model than {tiny_path.name}: its config.json has hidden_size 256, the GGUF 64"
    assert e.value.verdict.exit_code == 4

    def other_norms(sd, folder):
        for k in list(sd):
            if k.endswith("model.norm.weight"):
                sd[k] = sd[k] * np.float32(1.5)

    same_shape = _user_folder(tiny_path, tmp_path, other_norms)
    with pytest.raises(NotComparable, match=rf"^--mlx-folder {same_shape} holds another model than {tiny_path.name}: mlx-lm loaded "):
        mlx_engine.load_mlx(tiny_path, folder=same_shape).model


def test_cli_exits_4_for_a_folder_of_another_model(tiny_path, tmp_path):
    from harness.fixtures.synthetic import build

    other = convert.write_transformers_folder(GGUFModel(build("small-qwen35")), tmp_path / "small")
    r = subprocess.run([sys.executable, "-m", "harness", "parity", "--candidate", "mlx", "--mlx-folder", str(other), "--model", str(tiny_path),
                        "--no-evidence", "--greedy-tokens", "0"], capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert r.returncode == 4, r.stdout + r.stderr
    assert r.stderr.strip().splitlines()[-1].startswith(f"harness: NOT-COMPARABLE: --mlx-folder {other} holds another model")
