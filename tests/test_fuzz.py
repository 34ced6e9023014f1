"""Fuzzing (issue 9): mutated GGUF bytes and generated YAML raise only the project's documented
errors, never another exception (which the CLI would report as INTERNAL-ERROR, exit 70).

- ``GGUFModel`` + ``lint_model`` on a real fixture (tiny-qwen35) after bit flips, interesting
  integers written over length/count/type fields, truncations, and splices (a chunk of the file
  copied over, inserted into or cut out of another place): ``InvalidInput`` or a lint report.
  The harness's faster reader parses every mutant exactly as ``gguf.GGUFReader`` does, except
  that it refuses reads past the end of the file (where gguf-py can loop until memory runs out).
- ``load_thresholds`` on generated YAML (the shipped thresholds.yaml with a sub-tree replaced or
  deleted, text-level edits of it, arbitrary text and bytes): ``InvalidInput`` or a loaded file
  whose gates resolve.
- ``load_contracts`` on a committed contract with a sub-tree replaced or deleted, or text-level
  edits: ``ContractsInvalid`` naming file and line, or a loaded contract.
- the engine-output reader (``harness.engines.command``: ``load_logits``, ``load_info``,
  ``load_activations``) on generated output folders: valid, truncated and lying ``.npy`` headers,
  wrong dtypes, zip bombs, NaN in info.json, FIFOs, sockets, directories and links to devices:
  ``EngineError`` / ``NotComparable`` or the outputs as the protocol says, never a hang.
- ``load_prompt_set`` on generated prompt files (valid and mutated JSON lines, deep nesting, long
  numbers, stray bytes): ``InvalidInput`` or exactly the prompts the file holds.

Budget: ``$HARNESS_FUZZ_EXAMPLES`` examples per test (default 60) with a fixed seed
(``derandomize``), so the default suite is fast and reproducible. ``make fuzz`` runs a longer,
randomly seeded campaign (``HARNESS_FUZZ_EXAMPLES=2000 HARNESS_FUZZ_RANDOM=1``). A failure prints
the mutation list as its reproducer; bugs found so far are the regular tests at the end.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import numpy as np
import pytest
import yaml
from _hostile_util import Alarm, load_prompts_or_refusal, make_non_regular
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from harness.errors import InvalidInput, Unmeasured
from harness.fixtures import synthetic as fx
from harness.judge.thresholds import load_thresholds
from harness.judge.tiers import Subject
from harness.model.gguf_model import GGUFModel, PlainReader
from harness.model.lint import lint_model

EXAMPLES = int(os.environ.get("HARNESS_FUZZ_EXAMPLES", "60"))
RANDOM = os.environ.get("HARNESS_FUZZ_RANDOM") == "1"
FUZZ = settings(max_examples=EXAMPLES, deadline=None, derandomize=not RANDOM, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.function_scoped_fixture])

TINY = fx.build("tiny-qwen35")
TINY_BYTES = TINY.read_bytes()


def _structure_end() -> int:
    """End of the tensor-info records: everything before it is header, metadata and infos."""
    import gguf

    r = gguf.GGUFReader(TINY)
    return int(r.data_offset)


STRUCT_END = _structure_end()  # ~18.5 KB of 2.2 MB: where parsing decisions are made

# An offset mostly inside the structured prefix, sometimes anywhere (tensor data: value checks).
offsets = st.one_of(st.integers(0, STRUCT_END - 1), st.integers(0, STRUCT_END - 1), st.integers(0, STRUCT_END - 1),
                    st.integers(0, len(TINY_BYTES) - 1))
INTERESTING = [0, 1, 2, 3, 4, 7, 8, 12, 16, 31, 32, 255, 256, 0x7FFF, 0xFFFF, 0x7FFFFFFF, 0x80000000, 0xFFFFFFFF,
               1 << 32, 1 << 40, (1 << 63) - 1, 1 << 63, (1 << 64) - 1]

in_place = st.one_of(
    st.tuples(st.just("flip"), offsets, st.integers(0, 7)),
    st.tuples(st.just("u32"), offsets, st.sampled_from(INTERESTING).map(lambda v: v & 0xFFFFFFFF)),
    st.tuples(st.just("u64"), offsets, st.sampled_from(INTERESTING)),
    st.tuples(st.just("copy"), offsets, offsets, st.integers(1, 256)),
)
reshaping = st.one_of(
    st.tuples(st.just("truncate"), st.integers(0, len(TINY_BYTES) - 1)),
    st.tuples(st.just("insert"), offsets, offsets, st.integers(1, 64)),
    st.tuples(st.just("delete"), offsets, st.integers(1, 64)),
)
mutation = st.one_of(in_place, in_place, in_place, reshaping)  # most mutants keep their length and parse further


def mutate(data: bytes, ops: list[tuple]) -> bytes:
    """Apply ``ops`` (see ``mutation``) in order; offsets wrap to the current length."""
    b = bytearray(data)
    for op, *args in ops:
        if not b:
            break
        n = len(b)
        if op == "flip":
            b[args[0] % n] ^= 1 << args[1]
        elif op in ("u32", "u64"):
            at = args[0] % n
            b[at : at + (4 if op == "u32" else 8)] = struct.pack("<I" if op == "u32" else "<Q", args[1])
        elif op == "truncate":
            del b[args[0] % n :]
        elif op == "copy":
            src, dst, k = args[0] % n, args[1] % n, args[2]
            b[dst : dst + k] = b[src : src + k]
        elif op == "insert":
            src, dst, k = args[0] % n, args[1] % n, args[2]
            b[dst:dst] = b[src : src + k]
        elif op == "delete":
            del b[args[0] % n : args[0] % n + args[1]]
    return bytes(b)


def check_gguf(path: Path) -> None:
    """Open and lint ``path``; only the documented outcomes are allowed."""
    try:
        model = GGUFModel(path)
    except InvalidInput as e:
        assert str(e) and "\n" not in str(e)
        event("refused on open")
        return
    try:
        report = lint_model(model)
    except InvalidInput as e:  # unsupported or missing architecture
        assert str(e) and "\n" not in str(e)
        event("refused by lint")
        return
    assert report.exit_code in (0, 1)
    event(f"linted: exit {report.exit_code}")
    for f in report.findings:
        assert f.code and f.message
    try:
        model.hparams
        model.describe()
    except InvalidInput:
        pass


@pytest.fixture(scope="module")
def scratch(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("fuzz") / "mutant.gguf"


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # lint's value checks on garbage tensor bytes
@FUZZ
@given(ops=st.lists(mutation, min_size=1, max_size=3))
def test_gguf_reader_and_lint_on_mutated_bytes(scratch, ops):
    scratch.write_bytes(mutate(TINY_BYTES, ops))
    check_gguf(scratch)


def _parse(reader_cls, path: Path):
    """Everything a reader parsed, as plain values, or the exception type it raised
    (``PAST-END`` for the harness reader's refusal to read past the end of the file)."""
    try:
        r = reader_cls(path, "r")
    except Exception as e:  # noqa: BLE001  (the comparison is of which errors, not of their kind)
        return "PAST-END" if str(e).startswith("truncated:") else type(e).__name__
    fields = [(k, f.offset, list(f.data), [t.name for t in f.types], [(p.dtype.str, p.tobytes()) for p in f.parts])
              for k, f in r.fields.items()]
    tensors = [(t.name, t.tensor_type, t.shape.tolist(), t.n_bytes, t.data_offset, np.asarray(t.data).tobytes())
               for t in r.tensors]
    return fields, tensors, r.data_offset


@FUZZ
@given(ops=st.lists(mutation, min_size=1, max_size=3))
def test_harness_reader_parses_exactly_as_gguf_py(scratch, ops):
    """``GGUFModel``'s reader (gguf-py's parse on a plain view of the map, long arrays parsed when
    read) and ``gguf.GGUFReader`` agree on every mutant: the same fields, parts, tensors and
    bytes, or both refuse. Where the
    harness reader refuses a read past the end of the file, gguf-py is not run: it returns short
    arrays there, and on an array whose length runs past the end it never stops."""
    from gguf import GGUFReader

    scratch.write_bytes(mutate(TINY_BYTES, ops))
    ours = _parse(PlainReader, scratch)
    event(f"harness reader: {ours if isinstance(ours, str) else 'parsed'}")
    if ours == "PAST-END":
        return
    theirs = _parse(GGUFReader, scratch)
    assert (ours == theirs) if not isinstance(theirs, str) else isinstance(ours, str)


@pytest.mark.parametrize("name", ["tiny-qwen35", "tiny-qwen35moe", "tiny-qwen35-mtp"])
def test_harness_reader_parses_fixtures_exactly_as_gguf_py(name):
    from gguf import GGUFReader

    lazy = PlainReader(fx.build(name), "r").fields["tokenizer.ggml.tokens"]
    assert type(lazy).__name__ == "LazyArrayField" and lazy.length > 64  # parsed only when read
    assert _parse(PlainReader, fx.build(name)) == _parse(GGUFReader, fx.build(name))


# ---------------------------------------------------------------------------------------------
# thresholds.yaml
# ---------------------------------------------------------------------------------------------
SHIPPED = Path(__file__).resolve().parents[1] / "thresholds.yaml"
SHIPPED_TEXT = SHIPPED.read_text()
SHIPPED_DATA = yaml.safe_load(SHIPPED_TEXT)
KEYS = ["schema", "release", "calibrated", "gates", "probes", "weights", "class", "basis_models", "n_layer", "n_embd", "file_type", "report_only", "near_tie_margin", "min_cosine", "min_positions", "value",
        "basis", "kind", "measured", "declared", "who", "why", "command", "n", "model", "date", "known_good_floor",
        "known_bad", "what", "note", "fixture:tiny-qwen35", "0" * 64]
scalars = st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(allow_nan=True, allow_infinity=True),
                    st.sampled_from(KEYS + ["harness-thresholds/v2", "F32", "f32", "bf16", "2026-11-29", ""]), st.text(max_size=12))
values = st.recursive(scalars, lambda kids: st.one_of(st.lists(kids, max_size=4),
                                                      st.dictionaries(st.one_of(st.sampled_from(KEYS), scalars), kids, max_size=4)),
                      max_leaves=16)


def _replace(doc, path_choices: list[int], new, delete: bool):
    """Walk ``doc`` by ``path_choices`` (index into each container's keys) and replace or delete
    the sub-tree there; returns the new document."""
    if not path_choices or not isinstance(doc, (dict, list)) or not doc:
        return new
    keys = list(doc) if isinstance(doc, dict) else list(range(len(doc)))
    k = keys[path_choices[0] % len(keys)]
    out = dict(doc) if isinstance(doc, dict) else list(doc)
    if delete and len(path_choices) == 1:
        del out[k]
    else:
        out[k] = _replace(doc[k], path_choices[1:], new, delete)
    return out


def _dump(doc) -> str:
    try:
        return yaml.safe_dump(doc, sort_keys=False, allow_unicode=True)
    except (yaml.YAMLError, ValueError, TypeError):
        return "{}"


INSERTS = ["", ":", " ", "\n", "\t", "-", "{", "}", "[", "]", "&a ", "*a", "!!python/object:os.system ", "\"", "'", "#", "? ",
           ".nan", "1e999", "~", "!!binary "]


def text_edits(text: str, inserts: list[str] = INSERTS):
    """Up to four (position, characters cut, text inserted) edits of ``text``."""
    return st.lists(st.tuples(st.integers(0, len(text)), st.integers(0, 8), st.sampled_from(inserts)), min_size=1, max_size=4)


def _edit_text(text: str, edits) -> str:
    for at, cut, ins in edits:
        at = min(at, len(text))
        text = text[:at] + ins + text[at + cut :]
    return text


yaml_docs = st.one_of(
    st.builds(lambda p, v, d: _dump(_replace(SHIPPED_DATA, p, v, d)), st.lists(st.integers(0, 50), min_size=1, max_size=6), values, st.booleans()),
    st.builds(lambda e: _edit_text(SHIPPED_TEXT, e), text_edits(SHIPPED_TEXT)),
    st.builds(_dump, values),
    st.text(max_size=200),
)


def check_thresholds(path: Path) -> None:
    try:
        t = load_thresholds(path)
    except InvalidInput as e:
        assert str(e)
        return
    for cls in ("f64", "f32", "bf16"):
        r = t.resolve(Subject("F32", "ALL_F32", cls, True, 8, 64, "0" * 64), "fixture:tiny-qwen35")
        r.to_receipt()
        assert -1 <= r.release_min_cosine <= 1 and r.min_positions >= 1
        if r.row is not None:
            assert r.release_min_cosine <= float(r.row.gates["min_cosine"]["value"]) <= 1  # no row loosens the floor
    try:
        r.gate("split_min_cosine", "probes")
    except Unmeasured:
        pass


@pytest.fixture(scope="module")
def yaml_scratch(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("fuzz-yaml") / "thresholds.yaml"


@FUZZ
@given(doc=yaml_docs)
def test_thresholds_loader_on_generated_yaml(yaml_scratch, doc):
    yaml_scratch.write_text(doc, encoding="utf-8", errors="surrogatepass")
    check_thresholds(yaml_scratch)


@FUZZ
@given(raw=st.binary(max_size=300))
def test_thresholds_loader_on_arbitrary_bytes(yaml_scratch, raw):
    yaml_scratch.write_bytes(raw)
    check_thresholds(yaml_scratch)


# ---------------------------------------------------------------------------------------------
# contracts
# ---------------------------------------------------------------------------------------------
CONTRACT = Path(__file__).resolve().parents[1] / "contracts" / "qwen35-shapes-v1.yaml"
CONTRACT_TEXT = CONTRACT.read_text()
CONTRACT_DATA = yaml.safe_load(CONTRACT_TEXT)
contract_docs = st.one_of(
    st.builds(lambda p, v, d: _dump(_replace(CONTRACT_DATA, p, v, d)), st.lists(st.integers(0, 50), min_size=1, max_size=6), values, st.booleans()),
    st.builds(lambda e: _edit_text(CONTRACT_TEXT, e), text_edits(CONTRACT_TEXT, [i for i in INSERTS if i not in ("&a ", "*a")])),
)


@pytest.fixture(scope="module")
def contract_scratch(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("fuzz-contract") / "contracts"
    d.mkdir()
    return d / CONTRACT.name


@FUZZ
@given(doc=contract_docs)
def test_contract_loader_on_generated_yaml(contract_scratch, doc):
    """``load_contracts`` (schema and semantic checks; test collection off) raises only
    ``InvalidInput`` (``ContractsInvalid``), each error naming its file."""
    from harness.contracts.loader import ContractsInvalid, load_contracts

    contract_scratch.write_text(doc, encoding="utf-8", errors="surrogatepass")
    try:
        load_contracts([contract_scratch], check_tests=False)
    except ContractsInvalid as e:
        assert e.errors and all(err.file == str(contract_scratch.resolve()) and err.line >= 1 for err in e.errors)
    except InvalidInput as e:
        assert str(e)


@pytest.mark.parametrize("text", ["id: x-v1\nobligations: &a [*a]\n", "id: x-v1\nequations: " + "[" * 3000 + "]" * 3000 + "\n"],
                         ids=["self-list", "deep-3000"])
def test_contract_alias_bombs_and_deep_nesting_are_invalid(tmp_path, text):
    from harness.contracts.loader import load_contracts

    (tmp_path / "contracts").mkdir()
    p = tmp_path / "contracts" / "x-v1.yaml"
    p.write_text(text)
    with pytest.raises(InvalidInput):
        load_contracts([p], check_tests=False)


# ---------------------------------------------------------------------------------------------
# Engine outputs (docs/engine-protocol.md) as a broken or hostile engine leaves them
# ---------------------------------------------------------------------------------------------
T_TOKENS, T_VOCAB, ACT_CAP = 4, 7, 1 << 16


def _npy(arr: np.ndarray, shape_lie: tuple | None = None) -> bytes:
    import io

    buf = io.BytesIO()
    np.save(buf, arr)
    data = buf.getvalue()
    if shape_lie is not None:  # the header claims another shape than the data holds
        data = data.replace(repr(tuple(arr.shape)).encode(), repr(shape_lie).encode(), 1)
    return data


def _npz(arrays: dict[str, np.ndarray], compressed: bool) -> bytes:
    import io

    buf = io.BytesIO()
    (np.savez_compressed if compressed else np.savez)(buf, **arrays)
    return buf.getvalue()


shapes = st.tuples(st.integers(0, 6), st.integers(0, 9))
logits_files = st.one_of(
    st.none(),
    st.builds(lambda sh, dt: _npy(np.ones(sh, dt)), shapes, st.sampled_from([np.float32, np.float64, np.int32, np.float16])),
    st.builds(lambda sh: _npy(np.ones(sh + (2,), np.float32)), shapes),
    st.builds(lambda sh, lie: _npy(np.ones(sh, np.float32), lie), shapes,
              st.sampled_from([(4, 7), (1 << 40, 7), (4, 1 << 40), (2, 2, 2), ()])),
    st.builds(lambda b: _npy(np.ones((T_TOKENS, T_VOCAB), np.float32))[: max(1, len(b))], st.binary(max_size=140)),
    st.binary(max_size=200),
    st.builds(lambda: _npz({"a": np.ones((T_TOKENS, T_VOCAB), np.float32)}, False)),
    st.sampled_from(["fifo", "socket", "directory", "symlink-dev-zero", "dangling-symlink"]),
)
info_files = st.one_of(
    st.none(),
    st.binary(max_size=100),
    st.sampled_from(['{"name": "x", "version": "1", "settings": {"t": 2}}', '{"version": NaN}', '{"settings": {"a": [1, Infinity]}}',
                     '[1, 2]', '{"name": {"nested": 1}}', '{"settings": 3}', '"just a string"', '{"a": ' + "[" * 5000 + "]" * 5000 + "}",
                     '{"a": ' + "[" * 40 + "]" * 40 + "}", '{"x": 1' + " " * (2 << 20) + "}"]),
    st.sampled_from(["fifo", "directory", "symlink-dev-zero"]),
)
activation_files = st.one_of(
    st.none(),
    st.builds(lambda n, c: _npz({f"l_out-{i}": np.ones((T_TOKENS, 3), np.float32) for i in range(n)}, c), st.integers(0, 3), st.booleans()),
    st.builds(lambda c: _npz({"bomb": np.zeros((T_TOKENS, 1 << 18), np.float32)}, c), st.booleans()),
    st.binary(max_size=200),
    st.sampled_from(["fifo", "socket", "symlink-dev-zero"]),
)


def _place(path: Path, content) -> None:
    if content is None:
        return
    if isinstance(content, str) and content in ("fifo", "socket", "directory", "symlink-dev-zero", "dangling-symlink"):
        make_non_regular(path, content)
    else:
        path.write_bytes(content if isinstance(content, bytes) else content.encode())


@FUZZ
@given(logits=logits_files, info=info_files, acts=activation_files)
def test_engine_output_reader_on_generated_outputs(logits, info, acts):
    """The protocol's reader (``load_logits``, ``load_info``, ``load_activations``) on any files,
    special files and lies an engine can leave: ``EngineError`` / ``NotComparable`` or outputs
    exactly as the protocol says (float32 ``[T, V]``, a finite JSON object, bounded arrays);
    never another exception, never a blocked read (an alarm fails the test instead)."""
    import tempfile

    from harness.engines.command import load_activations, load_info, load_logits
    from harness.errors import EngineError, NotComparable
    from harness.evidence.receipts import canonical_json

    with tempfile.TemporaryDirectory(dir="/tmp") as d, Alarm(20):
        out = Path(d)
        _place(out / "logits.npy", logits)
        _place(out / "info.json", info)
        _place(out / "activations.npz", acts)
        try:
            arr = load_logits(out, "command:x", T_TOKENS, T_VOCAB)
            assert arr.dtype == np.float32 and arr.shape == (T_TOKENS, T_VOCAB)
            event("logits read")
        except (EngineError, NotComparable) as e:
            assert str(e) and "\n" not in str(e)
        try:
            canonical_json(load_info(out, "command:x"))
        except EngineError as e:
            assert "info.json" in str(e)
        try:
            got = load_activations(out, "command:x", T_TOKENS, ACT_CAP)
            assert sum(a.nbytes for a in got.values()) <= ACT_CAP
        except EngineError as e:
            assert "activations.npz" in str(e)


# ---------------------------------------------------------------------------------------------
# Prompt files
# ---------------------------------------------------------------------------------------------
prompt_objects = st.fixed_dictionaries(
    {"id": st.one_of(st.text(max_size=8), st.integers(), st.none())},
    optional={"text": st.one_of(st.text(max_size=12), st.integers()),
              "tokens": st.one_of(st.lists(st.one_of(st.integers(-3, 1 << 40), st.booleans(), st.floats(0, 5)), max_size=4), st.text(max_size=3)),
              "meta": values},
).map(lambda o: json.dumps(o, ensure_ascii=False, allow_nan=True))
prompt_line = st.one_of(
    prompt_objects,
    prompt_objects.flatmap(lambda line: st.builds(lambda e: _edit_text(line, e), text_edits(line, ["", "\"", "\\", "}", "[", ",", "\u2028",
                                                                                                 "\r", "\x85", "\ufeff", "NaN", "9" * 5000]))),
    st.integers(1, 50_000).map(lambda n: '{"id": "d", "x": ' + "[" * n + "]" * n + "}"),
    st.integers(1, 6000).map(lambda n: '{"id": "n", "tokens": [' + "7" * n + "]}"),
)
prompt_files = st.one_of(
    st.lists(prompt_line, min_size=0, max_size=5).map(lambda ls: "\n".join(ls).encode("utf-8", errors="surrogatepass")),
    st.lists(prompt_line, min_size=1, max_size=3).flatmap(
        lambda ls: st.binary(min_size=1, max_size=3).map(lambda junk: "\n".join(ls).encode("utf-8", errors="surrogatepass") + junk)),
    st.binary(max_size=120),
)


@FUZZ
@given(raw=prompt_files)
def test_prompt_loader_on_generated_files(tmp_path_factory, raw):
    """``load_prompt_set`` on generated prompt files (valid and mutated JSON lines, deep nesting,
    long numbers, stray bytes, BOMs, U+2028 and CR inside lines): ``InvalidInput`` naming the
    file, or prompts exactly as the file says — unique string ids, int32 token ids, and texts
    equal to the JSON strings (no byte silently replaced)."""
    from harness.measure.prompts import MAX_TOKEN_ID

    ps = load_prompts_or_refusal(tmp_path_factory.mktemp("fuzz-prompts"), raw)
    if ps is None:
        event("refused")
        return
    event("loaded")
    objs = [json.loads(line) for line in raw.decode("utf-8").split("\n") if line.strip()]
    assert [pr.id for pr in ps] == [o["id"] for o in objs] and len({pr.id for pr in ps}) == len(objs)
    for pr, o in zip(ps, objs):
        if pr.tokens is not None:
            assert pr.tokens == o["tokens"] and all(0 <= t <= MAX_TOKEN_ID for t in pr.tokens)
        else:
            assert pr.text == o["text"] and isinstance(pr.text, str) and pr.text


# ---------------------------------------------------------------------------------------------
# Reproducers of bugs the fuzzing found (fixed; kept as regular tests)
# ---------------------------------------------------------------------------------------------
def _limit_memory() -> None:
    import resource

    resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))


@pytest.mark.parametrize("itype, alen", [(0, 1 << 40), (8, 1 << 33), (9, 1 << 30)], ids=["uint8", "string", "nested-array"])
def test_gguf_array_length_past_the_end_is_refused_at_once(tmp_path, itype, alen):
    """Found by ``make fuzz`` (the process grew to 24 GB and was OOM-killed): a metadata array
    whose length field runs past the end of the file made gguf-py's reader walk on forever,
    one empty element read at a time. Now: exit 2 at once, one line."""
    import subprocess
    import sys

    import gguf

    f = gguf.GGUFReader(TINY).fields["tokenizer.ggml.token_type"]
    at = f.offset + 8 + len(f.name) + 4  # key length, key, value type; then item type and length
    b = bytearray(TINY_BYTES)
    b[at : at + 12] = struct.pack("<IQ", itype, alen)
    p = tmp_path / "array-past-end.gguf"
    p.write_bytes(bytes(b))
    r = subprocess.run([sys.executable, "-m", "harness", "lint", str(p)], capture_output=True, text=True, timeout=60,
                       preexec_fn=_limit_memory)
    assert r.returncode == 2, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "truncated:" in lines[0] and "Traceback" not in r.stderr


_HEAD = "schema: harness-thresholds/v2\n"
_LAUGHS = _HEAD + 'a0: &a0 ["x","x","x","x","x","x","x","x","x","x"]\n' + "".join(
    f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]\n" for i in range(1, 9)) + "release: *a8\n"


@pytest.mark.parametrize("text, needle", [
    (_HEAD + "gates: &a [*a]\n", "recursive YAML alias"),                 # was RecursionError (INTERNAL-ERROR)
    (_HEAD + "gates: &a {x: *a}\n", "recursive YAML alias"),              # was RecursionError
    (_LAUGHS, "more than 100,000 nodes"),                                 # was a hang: 10^9 nodes walked
    (_HEAD + "gates: " + "[" * 3000 + "]" * 3000 + "\n", "nested too deeply"),  # was RecursionError in the composer
    (_HEAD + "gates: " + "[" * 100 + "]" * 100 + "\n", "more than 64 levels"),
], ids=["self-list", "self-map", "billion-laughs", "deep-3000", "deep-100"])
def test_thresholds_alias_bombs_and_deep_nesting_are_invalid(tmp_path, text, needle):
    p = tmp_path / "t.yaml"
    p.write_text(text)
    with pytest.raises(InvalidInput, match=needle):
        load_thresholds(p)


def test_thresholds_aliases_that_share_a_basis_still_load(tmp_path):
    p = tmp_path / "t.yaml"
    p.write_text(_HEAD + "release:\n  min_positions: {value: 64, basis: &b {kind: declared, who: me, why: shared}}\n"
                 "  min_cosine: {value: 0.98, basis: *b}\n")
    r = load_thresholds(p).resolve(Subject("F32", "ALL_F32", "f32", True, 8, 64, "0" * 64), "fixture:x")
    assert r.release["min_cosine"].basis == r.release["min_positions"].basis == {"kind": "declared", "who": "me", "why": "shared"}
