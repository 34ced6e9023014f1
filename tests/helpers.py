"""Helpers shared by several test modules (fixtures live in conftest.py): a scratch copy of the
repository to edit contracts in, and a ``$HARNESS_CONFIG`` of fake command engines."""

from __future__ import annotations

import shutil
import textwrap
from pathlib import Path
from typing import Iterable, Mapping

import pytest

REPO = Path(__file__).resolve().parent.parent
MAX_TRACKED_BYTES = 10 * 2**20
"""The most bytes a file git tracks may have (tests/test_tracked_sizes.py, tests/test_trained_mtp.py)."""


def repo_copy(tmp_path: Path, contracts: Iterable[str] = ()) -> Path:
    """A minimal copy of the repository under ``tmp_path/repo`` (pyproject, thresholds,
    tests/conftest.py, the bound tests and the named contract files) to edit without touching the
    real one."""
    root = tmp_path / "repo"
    (root / "contracts").mkdir(parents=True)
    for f in ("pyproject.toml", "thresholds.yaml", "tests/conftest.py"):
        (root / f).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(REPO / f, root / f)
    shutil.copytree(REPO / "tests" / "contracts", root / "tests" / "contracts", ignore=shutil.ignore_patterns("__pycache__"))
    for c in contracts:
        shutil.copy(REPO / "contracts" / c, root / "contracts" / c)
    return root


def fake_engines_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, bodies: Mapping[str, str], n_vocab: int,
                        timeout_s: float, preamble: str = "") -> Path:
    """Write one fake command engine per ``bodies`` entry (``[engines.NAME]``) and point
    ``$HARNESS_CONFIG`` at them. Each body runs with ``req`` (the request), ``out`` (the output
    dir), ``V`` = ``n_vocab``, ``np``, ``sys`` and whatever ``preamble`` defines."""
    tables = []
    for name, body in bodies.items():
        script = tmp_path / f"fake_engine_{name}.py"  # prefixed: a script named pickle.py would shadow the stdlib
        script.write_text(textwrap.dedent("""
            import json, sys
            import numpy as np
            req = json.load(open(sys.argv[1])); out = sys.argv[2]; V = {V}
        """).format(V=n_vocab) + textwrap.dedent(preamble) + textwrap.dedent(body) + "\n")
        tables.append(f'[engines.{name}]\ncommand = ["{{python}}", "{script}", "{{request}}", "{{out_dir}}"]\ntimeout_s = {timeout_s}\n')
    cfg = tmp_path / "harness.toml"
    cfg.write_text("\n".join(tables))
    monkeypatch.setenv("HARNESS_CONFIG", str(cfg))
    return cfg


def command_table_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, toml: str, match: str) -> None:
    """With ``toml`` as the harness config, reading the command engines raises ``InvalidInput``
    whose message matches ``match``."""
    from harness.engines.command import configured_commands
    from harness.errors import InvalidInput

    cfg = tmp_path / "harness.toml"
    cfg.write_text(toml)
    monkeypatch.setenv("HARNESS_CONFIG", str(cfg))
    with pytest.raises(InvalidInput, match=match):
        configured_commands()


def write_qwen35_tokenizer_folder(gguf_path: str | Path, out_dir: str | Path) -> Path:
    """Write ``out_dir``: the tokenizer files of a Qwen3.5 model folder for the GGUF at
    ``gguf_path`` (its ``tokenizer.ggml.tokens``, ``token_type`` and ``merges``), as a Qwen3.5
    checkpoint ships them: ``config.json`` (``model_type`` ``qwen3_5``), ``tokenizer.json``
    (written by the HF ``tokenizers`` library: a byte-level BPE with the normal tokens as its
    vocabulary, the merges in rank order, Qwen's pipeline: NFC normalizer, the Qwen3.5 split regex,
    ``ByteLevel``; the control tokens as added special tokens) and ``tokenizer_config.json``
    (Qwen's: no BOS, ``<|im_end|>`` EOS, ``<|endoftext|>`` padding). Returns ``out_dir``.

    Why this judges transformers' tokenizer and not the harness's: these files carry only data
    (the vocabulary and merges a checkpoint carries, the same the GGUF holds). What tokenizes is
    what ``AutoTokenizer.from_pretrained`` builds from them: transformers picks
    ``Qwen3_5Tokenizer`` from ``model_type`` (``models/auto/tokenization_auto.py``: qwen3_5's hub
    tokenizer class is overridden) and that class rebuilds the normalizer, pre-tokenizer and
    decoder itself (``models/qwen3_5/tokenization_qwen3_5.py``; ``convert_to_native_format``
    takes only the vocabulary, merges and post-processor from ``tokenizer.json``), so the
    pipeline judged is transformers' own source, not anything written here. No harness code runs
    on the candidate side. Needs ``tokenizers`` (installed with transformers) and ``gguf``."""
    import json

    from gguf import GGUFReader
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers
    from tokenizers.models import BPE

    def field(reader: GGUFReader, key: str) -> list:
        f = reader.fields[key]
        if f.types[-1].name == "STRING":
            return [bytes(f.parts[i]).decode("utf-8") for i in f.data]
        return [f.parts[i].tolist()[0] for i in f.data]

    r = GGUFReader(str(gguf_path))
    tokens, types = field(r, "tokenizer.ggml.tokens"), field(r, "tokenizer.ggml.token_type")
    merges = [tuple(m.split(" ", 1)) for m in field(r, "tokenizer.ggml.merges")]
    control = [(i, t) for i, t in enumerate(tokens) if types[i] == 3]  # llama.cpp LLAMA_TOKEN_TYPE_CONTROL
    vocab = {t: i for i, t in enumerate(tokens) if types[i] != 3}
    tok = Tokenizer(BPE(vocab=vocab, merges=merges, dropout=None, unk_token=None, continuing_subword_prefix="",
                        end_of_word_suffix="", fuse_unk=False, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    qwen35_split = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(qwen35_split), behavior="isolated", invert=False),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for _, t in control])
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    added = {str(i): {"content": t, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False, "special": True}
             for i, t in control}
    (out / "tokenizer_config.json").write_text(json.dumps({
        "added_tokens_decoder": added, "bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
        "unk_token": None, "errors": "replace", "split_special_tokens": False, "add_prefix_space": False,
        "clean_up_tokenization_spaces": False, "model_max_length": 262144, "tokenizer_class": "Qwen2Tokenizer"}, indent=1))
    (out / "config.json").write_text(json.dumps({"model_type": "qwen3_5"}))
    return out


def unscaled_twin(name: str, folder: Path) -> Path:
    """Fixture ``name`` drawn with ``layer_gain`` and ``qk_norm_gain`` 1, written under ``folder``:
    the trunk-only twin of the MTP and lint fixtures, which are drawn from the unscaled tiny shape
    (``tiny-qwen35`` and ``tiny-qwen35moe`` themselves are scaled to peaked logits)."""
    from dataclasses import replace

    from harness.fixtures import synthetic as fx

    return fx.build_fixture(replace(fx.SPECS[name], layer_gain=1.0, qk_norm_gain=1.0), folder / f"{name}-unscaled.gguf")


@pytest.fixture
def fresh_engine_processes() -> Iterable[None]:
    """Every protocol-2 engine process closed and the start counts cleared, before and after
    the test (use as ``pytestmark = pytest.mark.usefixtures("fresh_engine_processes")`` after
    importing it)."""
    from harness.engines import persistent

    persistent.close_all()
    persistent.STARTS.clear()
    yield
    persistent.close_all()


def engine_starts() -> int:
    """Protocol-2 engine processes started since ``fresh_engine_processes`` cleared the count."""
    from harness.engines import persistent

    return sum(persistent.STARTS.values())
