"""Parity receipts: schema ``harness-parity-receipt/v1``, content-hash ids, atomic writes.

A receipt is one JSON document (``<id>.json``) plus a sidecar ``<id>.npz`` of per-position
arrays, both in one shard folder named by the id's first two hex digits
(``evidence/parity/receipts/<id[:2]>/``: 256 folders, so a year of CI's 100,000 receipts is
about 400 per folder, not one flat folder of 200,000 files). Receipts of the earlier flat
layout (``receipts/<id>.json``) are still read (``receipt_file``) and ``migrate_receipts``
(``harness ledger migrate-receipts``) moves them into their shards. Its fields are in
``harness/schemas/receipt.schema.json`` and docs/design.md, "Evidence formats".

- ``id`` is the sha256 of the canonical JSON (``canonical_json``) of the receipt without ``id``,
  ``created`` and ``timings``: rewriting the same content gives the same id, and any edit of
  the rest changes it (an edit of the timings changes the file's bytes, which the ledger row
  hashes).
- ``arrays.sha256`` (``arrays_sha256``) hashes the arrays' names, dtypes, shapes and bytes, not the
  npz file (whose zip headers carry timestamps), so the id binds the sidecar's contents.
- Writes are atomic and exclusive: each file goes to a temporary file in the same directory, is
  fsynced and hard-linked into place, the npz first, so a visible ``.json`` always has its
  ``.npz``; a ``.json`` that exists is never replaced (a ledger row hashed its bytes).
- Files get the mode the process's umask gives a new file (0644 under the usual 022), as the
  committed ones have, so a reviewer's account or a web server can read them
  (``harness.fschecks.new_file_mode``).
"""

from __future__ import annotations

import datetime
import hashlib
import json
import math
import os
import platform
import re
import socket
import sys
import tempfile
from functools import lru_cache
from pathlib import Path
from typing import Any, Mapping, NamedTuple

import numpy as np

from harness.errors import InvalidInput
from harness.fschecks import new_file_mode
from harness.paths import IS_CHECKOUT, SCHEMA_DIR, SOURCE_ROOT
from harness.provenance import git_state, numbers_sha256, sha256_bytes, suite_pins
from harness.rundir import pid_alive
from harness.validation import best_error, schema_validator

SCHEMA_ID = "harness-parity-receipt/v1"
SCHEMA_PATH = SCHEMA_DIR / "receipt.schema.json"
PROBE_SCHEMA_ID = "harness-probe-receipt/v1"
CALIBRATION_SCHEMA_ID = "harness-calibration-receipt/v1"
MTP_SCHEMA_ID = "harness-mtp-receipt/v1"
TOKENIZER_SCHEMA_ID = "harness-tokenizer-receipt/v1"
DISCHARGE_SCHEMA_ID = "harness-discharge-receipt/v1"
CHAT_PARSERS_SCHEMA_ID = "harness-chat-parsers-receipt/v1"
SCHEMAS = {
    SCHEMA_ID: SCHEMA_PATH,
    PROBE_SCHEMA_ID: SCHEMA_DIR / "probe-receipt.schema.json",
    CALIBRATION_SCHEMA_ID: SCHEMA_DIR / "calibration-receipt.schema.json",
    MTP_SCHEMA_ID: SCHEMA_DIR / "mtp-receipt.schema.json",
    TOKENIZER_SCHEMA_ID: SCHEMA_DIR / "tokenizer-receipt.schema.json",
    DISCHARGE_SCHEMA_ID: SCHEMA_DIR / "discharge-receipt.schema.json",
    CHAT_PARSERS_SCHEMA_ID: SCHEMA_DIR / "chat-parsers-receipt.schema.json",
}
"""Receipt kinds by ``schema`` field: parity cells, self-consistency probe runs, the
calibrated tier measured on a subject, a candidate's own tokenization against llama.cpp's, and a
contract's discharge for one GREEN subject build (binding its obligation records by sha256), and a
server's reasoning and tool-call parsers on the scripted fixture's texts (``harness chat-parsers``)."""
HASH_EXCLUDED = ("id", "created", "timings")
"""Top-level fields left out of the content hash: the hash itself, the wall-clock time and the
engines' timings (speed measured in this run: identical runs keep one id; the ledger row of
each run, whose hash covers the receipt file's bytes, carries that run's own timings)."""


class LoadedReceipt(NamedTuple):
    """``load_receipt``'s result; unpacks as ``receipt, arrays = load_receipt(p)[:2]``."""

    receipt: dict[str, Any]
    arrays: dict[str, np.ndarray]
    json_path: Path
    npz_path: Path


# ------------------------------------------------------------------------------ hashing


def _plain(obj: Any) -> Any:
    """json.dumps hook: NumPy scalars as their Python values (so hashes survive a round trip)."""
    if isinstance(obj, np.bool_):
        return bool(obj)
    if isinstance(obj, np.integer):
        return int(obj)
    if isinstance(obj, np.floating):
        return float(obj)
    if isinstance(obj, Path):
        return str(obj)
    raise TypeError(f"{type(obj).__name__} is not JSON serialisable")


def _find_nonfinite(obj: Any, path: str = "") -> str | None:
    if isinstance(obj, float) and not math.isfinite(obj):
        return path or "(root)"
    if isinstance(obj, Mapping):
        for k, v in obj.items():
            hit = _find_nonfinite(v, f"{path}.{k}" if path else str(k))
            if hit:
                return hit
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            hit = _find_nonfinite(v, f"{path}[{i}]")
            if hit:
                return hit
    return None


def canonical_json(obj: Any) -> bytes:
    """UTF-8 JSON with sorted keys and no whitespace: the form every hash here is taken over.

    Raises ``InvalidInput`` naming the field when ``obj`` holds NaN or ±Inf (not JSON; record
    undefined numbers as null) or a value JSON cannot hold.
    """
    try:
        return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False, default=_plain).encode("utf-8")
    except (TypeError, ValueError) as e:
        # Only now walk the object (it costs more than the encoding): name the non-finite field.
        bad = _find_nonfinite(obj)
        if bad:
            raise InvalidInput(f"{bad} is not a finite number; evidence records undefined values as null") from None
        raise InvalidInput(f"cannot serialise to JSON: {e}") from e


def receipt_id(receipt: Mapping[str, Any]) -> str:
    """Content hash of a receipt: sha256 of ``canonical_json`` without ``HASH_EXCLUDED`` (``id``,
    ``created``, ``timings``)."""
    return sha256_bytes(canonical_json({k: v for k, v in receipt.items() if k not in HASH_EXCLUDED}))


def arrays_sha256(arrays: Mapping[str, np.ndarray]) -> str:
    """sha256 over the arrays in name order: each one's name, dtype, shape and C-order bytes.

    Raises ``InvalidInput`` for object arrays (an npz read with ``allow_pickle=False`` cannot
    hold them).
    """
    h = hashlib.sha256()
    for name in sorted(arrays):
        a = np.ascontiguousarray(arrays[name])
        if a.dtype.hasobject:
            raise InvalidInput(f"array {name!r} has dtype object; receipts hold numeric arrays only")
        head = json.dumps([name, a.dtype.str, list(a.shape)]).encode()
        h.update(len(head).to_bytes(8, "little") + head)
        h.update(a.nbytes.to_bytes(8, "little"))
        h.update(a.tobytes())
    return h.hexdigest()


def arrays_manifest(arrays: Mapping[str, np.ndarray]) -> dict[str, Any]:
    """The receipt's ``arrays`` field: content sha256 and each array's dtype and shape."""
    return {
        "sha256": arrays_sha256(arrays),
        "keys": {n: {"dtype": np.asarray(a).dtype.str, "shape": list(np.shape(a))} for n, a in sorted(arrays.items())},
    }


# ------------------------------------------------------------------------------ provenance


def host_info() -> dict[str, Any]:
    """The receipt's ``host`` field: hostname, platform, Python version, CPU count and ``cpu``, the
    CPU's model name (``cpu_model``)."""
    return {
        "hostname": socket.gethostname(),
        "platform": platform.platform(),
        "python": sys.version.split()[0],
        "cpu_count": os.cpu_count(),
        "cpu": cpu_model(),
    }


@lru_cache(maxsize=1)
def cpu_model() -> str | None:
    """The CPU's model name: the first ``model name`` line of Linux ``/proc/cpuinfo`` (``Intel(R)
    Xeon(R) Processor``, ``AMD EPYC 7B13``), else ``platform.processor()``; None when neither
    names one."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name" and value.strip():
                    return value.strip()
    except OSError:
        pass
    return platform.processor() or None


def harness_info(repo_dir: str | Path | None = None) -> dict[str, Any]:
    """The receipt's ``harness`` field: package version, the git commit of ``repo_dir`` (default:
    the harness checkout this package runs from; None from an installed wheel, so a virtual
    environment inside another repository never lends the harness that repository's commit) with
    whether the tree has uncommitted changes, ``suite``: the shipped contracts' versions and
    the suite's sha256 (``harness.provenance.suite_pins``), and ``numbers``: the sha256 of the
    sources that affect numbers (``harness.provenance.numbers_sha256``; what a sweep keys cells by)."""
    pins = suite_pins()
    repo = Path(repo_dir) if repo_dir else (SOURCE_ROOT if IS_CHECKOUT else None)
    git = _cached_git_state(repo) if repo is not None else {"commit": None, "dirty": None}
    return {"version": pins["version"], "git_commit": git["commit"], "git_dirty": git["dirty"],
            "suite": {k: pins[k] for k in ("version", "source", "contracts", "sha256")}, "numbers": numbers_sha256()}


_cached_git_state = lru_cache(maxsize=8)(git_state)
"""``git_state`` once per checkout and process: a run writes several receipts from one tree."""


def utc_now() -> str:
    """Current UTC time, ISO 8601 with seconds and a ``Z``."""
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


# ------------------------------------------------------------------------------ schema


def validate_receipt(receipt: Mapping[str, Any], where: str = "receipt") -> None:
    """Check a receipt against the schema its ``schema`` field names (parity receipts by
    default); ``InvalidInput`` names the first bad field."""
    schema_id = receipt.get("schema", SCHEMA_ID) if isinstance(receipt, Mapping) else SCHEMA_ID
    if schema_id not in SCHEMAS:
        raise InvalidInput(f"{where}: unknown receipt schema {schema_id!r}; known: {', '.join(SCHEMAS)}")
    err = best_error(schema_validator(SCHEMAS[schema_id].name).iter_errors(receipt))
    if err:
        field, message = err
        raise InvalidInput(f"{where}: {field or '(top level)'}: {message} (schema {schema_id})")


def report_only_headline(summary: Mapping[str, Any]) -> dict[str, Any]:
    """One number each for the report-only quantities of a summary (``metrics.summarize``'s output
    or a receipt's ``report_only``), under the names per-prompt entries and ledger rows use:
    ``argmax_agreement`` (rate), ``near_tie_flips``, ``hard_flips``, ``kld_mean`` (None without KLD)."""
    return {
        "argmax_agreement": summary["argmax_agreement"]["rate"],
        "near_tie_flips": summary["flips"]["near_tie"],
        "hard_flips": summary["flips"]["hard"],
        "kld_mean": (summary.get("kld") or {}).get("mean"),
    }


def acceptance_rows(details: Mapping[str, Any]) -> list[dict[str, Any]]:
    """One row per speculative case with draft counts (``details["cases"]`` and ``details["given"]``
    of the speculative probe): ``case``, ``accepted``, ``proposed``, ``acceptance`` (None when
    nothing was proposed), ``counts`` (what they count), ``reference`` (the reference head's
    first drafts at the case's steps, where measured) and ``gate`` (the case's ``acceptance_gate``
    record, ``harness.runs.spec_acceptance.judge``; None for a given-draft case). Empty for another probe."""
    out = []
    for r in list(details.get("cases") or []) + list(details.get("given") or []):
        if isinstance(r, dict) and "accepted" in r and "proposed" in r:
            out.append({"case": r.get("case", ""), "accepted": int(r["accepted"]), "proposed": int(r["proposed"]),
                        "acceptance": r.get("acceptance"), "counts": r.get("counts", ""), "reference": r.get("reference_acceptance"),
                        "gate": r.get("acceptance_gate") if isinstance(r.get("acceptance_gate"), dict) else None})
    return out


OLD_PER_PROMPT_NAMES = {"flips_near_tie": "near_tie_flips", "flips_hard": "hard_flips"}
"""Per-prompt fields that parity receipts written before the names were unified (the ledger's
``near_tie_flips`` / ``hard_flips``) call by their old names; receipts are never rewritten."""


def per_prompt_rows(receipt: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The receipt's ``per_prompt`` entries with today's field names (old receipts' names read
    through ``OLD_PER_PROMPT_NAMES``)."""
    return [{OLD_PER_PROMPT_NAMES.get(k, k): v for k, v in p.items()} for p in receipt.get("per_prompt", [])]


# ------------------------------------------------------------------------------ layout

SHARD_CHARS = 2
"""Hex digits of the id that name a receipt's shard folder (``receipts/<id[:2]>/``)."""
_ID_RE = re.compile(r"^[0-9a-f]{64}$")
_SHARD_RE = re.compile(r"^[0-9a-f]{%d}$" % SHARD_CHARS)


def shard_dir(receipts_dir: str | Path, rid: str) -> Path:
    """The folder receipt ``rid`` (64 hex digits) is written to: ``receipts_dir/<rid[:2]>``."""
    return Path(receipts_dir) / rid[:SHARD_CHARS]


def receipt_file(receipts_dir: str | Path, rid: str, suffix: str = ".json") -> Path:
    """Where receipt ``rid``'s ``.json`` (or ``suffix``, e.g. ``.npz``) is: in its shard
    (``receipts_dir/<rid[:2]>/<rid>.json``), else in the earlier flat layout
    (``receipts_dir/<rid>.json``) when only that exists; the shard path when neither does (where
    it would be written). Two ``stat`` calls at most; nothing is read."""
    sharded = shard_dir(receipts_dir, rid) / f"{rid}{suffix}"
    if sharded.exists():
        return sharded
    flat = Path(receipts_dir) / f"{rid}{suffix}"
    return flat if flat.exists() else sharded


def receipts_root(json_path: str | Path) -> Path:
    """The receipts folder a receipt file lies in: its folder's parent for a sharded receipt
    (``receipts/ab/ab….json``), its folder for a flat one. Reports and the ledger are found beside
    this folder."""
    p = Path(json_path)
    if _SHARD_RE.match(p.parent.name) and p.name.startswith(p.parent.name) and _ID_RE.match(p.stem):
        return p.parent.parent
    return p.parent


def iter_receipt_files(receipts_dir: str | Path) -> list[Path]:
    """Every receipt ``.json`` under ``receipts_dir``, both layouts (shards and flat), sorted by
    path; temporary files (``.*.tmp``) and other names are left out. Empty when the folder does
    not exist."""
    d = Path(receipts_dir)
    if not d.is_dir():
        return []
    out = [p for p in d.glob("*.json") if _ID_RE.match(p.stem)]
    for sub in d.iterdir():
        if sub.is_dir() and _SHARD_RE.match(sub.name):
            out += [p for p in sub.glob("*.json") if _ID_RE.match(p.stem) and p.name.startswith(sub.name)]
    return sorted(out)


def migrate_receipts(receipts_dir: str | Path) -> tuple[int, int]:
    """Move flat-layout receipts (``receipts_dir/<id>.json`` and ``.npz``) into their shards;
    return ``(moved, kept)``: receipts moved, and flat receipts left where they are because the
    shard already holds a file of that name with other bytes (``harness ledger verify`` tells
    which is the evidence). Each file is hard-linked into the shard, then its flat name removed,
    the sidecar first, so at every moment each receipt can be found by ``receipt_file``. The
    ledger hashes receipt bytes, not paths, so rows stay valid. Raises ``InvalidInput`` when a
    file cannot be moved."""
    d = Path(receipts_dir)
    moved = kept = 0
    for jp in sorted(p for p in d.glob("*.json") if _ID_RE.match(p.stem)) if d.is_dir() else []:
        dest = shard_dir(d, jp.stem)
        pairs = [(src, dest / src.name) for src in (jp.with_suffix(".npz"), jp) if src.exists()]
        if any(dst.exists() and dst.read_bytes() != src.read_bytes() for src, dst in pairs):
            kept += 1
            continue
        try:
            dest.mkdir(exist_ok=True)
            for src, dst in pairs:
                if not dst.exists():
                    os.link(src, dst)
                src.unlink()
            _fsync_dir(dest)
        except OSError as e:
            raise InvalidInput(f"{jp}: cannot move into {dest}: {e.strerror or e}") from e
        moved += 1
    _fsync_dir(d)
    return moved, kept


# ------------------------------------------------------------------------------ write / load


def _synced_temp(directory: Path, name: str, write) -> str:
    """A temporary file ``.<name>.<pid>.*.tmp`` in ``directory`` holding ``write(file)``'s bytes,
    fsynced; its path. The pid lets ``sweep_temp_files`` remove it once its writer is gone.
    Raises ``OSError`` after removing the temporary file."""
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{name}.{os.getpid()}.", suffix=".tmp")
    try:
        os.fchmod(fd, new_file_mode())  # mkstemp makes 0600; evidence follows the umask
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        _unlink_quiet(tmp)
        raise
    return tmp


def _unlink_quiet(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def write_new(directory: Path, name: str, write) -> bool:
    """Create ``directory/name`` with ``write(file)``'s bytes, never replacing an existing file.

    The bytes go to a temporary file in ``directory`` (fsynced), which is then hard-linked to
    ``name`` (``link`` fails with EEXIST when the name exists: the check and the write are one
    atomic step, so two writers racing cannot both succeed) and unlinked. Returns False, writing
    nothing, when ``name`` already exists. Raises ``OSError``; no temporary file is left behind.
    """
    tmp = _synced_temp(directory, name, write)
    try:
        os.link(tmp, directory / name)
    except FileExistsError:
        return False
    finally:
        _unlink_quiet(tmp)
    return True


def _replace_file(directory: Path, name: str, write) -> None:
    """Write via a temporary file in ``directory``, fsync, rename over ``name`` (used only for a
    sidecar whose existing copy does not hold the receipt's arrays)."""
    tmp = _synced_temp(directory, name, write)
    try:
        os.replace(tmp, directory / name)
    except BaseException:
        _unlink_quiet(tmp)
        raise


_TEMP_NAME = re.compile(r"^\.[0-9a-f]{64}\.(?:json|npz)\.(\d+)\.[^/]*\.tmp$")


def sweep_temp_files(directory: Path) -> list[Path]:
    """Remove the temporary files (``.<id>.<ext>.<pid>.*.tmp``) that writers killed before they
    could clean up left in ``directory``: those whose process is gone. Returns what was removed.
    A temporary file is never evidence (only linked names are); a live writer's are kept."""
    removed = []
    try:
        names = [p for p in directory.iterdir() if p.name.endswith(".tmp")]
    except OSError:
        return removed
    for p in names:
        m = _TEMP_NAME.match(p.name)
        if m and int(m.group(1)) != os.getpid() and not pid_alive(int(m.group(1))):
            try:
                p.unlink()
                removed.append(p)
            except OSError:
                pass
    return removed


def _fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def prepare_receipt(receipt: Mapping[str, Any], arrays: Mapping[str, np.ndarray]) -> dict[str, Any]:
    """The receipt exactly as ``write_receipt`` would write it, validated, without writing.

    Sets ``schema`` (kept if given), ``arrays`` (``arrays_manifest``), ``created`` (kept if
    given, else now) and ``id`` (the content hash); NumPy scalars become plain JSON values. A dry
    run (``--no-evidence``) calls this too, so a receipt that could not be recorded fails the dry
    run the same way. Raises ``InvalidInput`` when the receipt breaks its schema, holds NaN/Inf,
    names an unknown ``schema`` or holds object arrays.
    """
    schema_id = receipt.get("schema", SCHEMA_ID)
    if schema_id not in SCHEMAS:
        raise InvalidInput(f"receipt schema {schema_id!r}; this writer writes {', '.join(SCHEMAS)}")
    r = {k: v for k, v in receipt.items() if k != "id"}
    r["schema"] = schema_id
    r["arrays"] = arrays_manifest(arrays)
    r.setdefault("created", utc_now())
    rid = receipt_id(r)
    r["id"] = rid
    # Round-trip through canonical JSON: NumPy scalars become plain values before validation.
    r = json.loads(canonical_json(r))
    validate_receipt(r, where=f"receipt {rid[:12]}")
    return r


def _sidecar_holds(npz_path: Path, sha: str) -> bool:
    try:
        with np.load(npz_path, allow_pickle=False) as z:
            return arrays_sha256({k: z[k] for k in z.files}) == sha
    except (OSError, ValueError, EOFError):
        return False


def _write_documents(documents: Mapping[Path, bytes], rid: str) -> None:
    """Write each file a receipt ``rid`` binds (``write_receipt``'s ``documents``) through an
    fsynced temporary file renamed over its path; ``InvalidInput`` naming the first that fails."""
    for path, data in documents.items():
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            _replace_file(path.parent, path.name, lambda f, data=data: f.write(data))
        except OSError as e:
            raise InvalidInput(f"{path}: cannot write it for receipt {rid[:12]}: {e.strerror or e}") from e


def write_receipt(receipt: Mapping[str, Any], arrays: Mapping[str, np.ndarray], directory: str | Path,
                  documents: Mapping[Path, bytes] | None = None) -> tuple[Path, Path]:
    """Write ``<id>.npz`` then ``<id>.json`` into the shard of the receipts folder ``directory``
    (``directory/<id[:2]>/``); return their paths. A receipt already there in the flat layout
    (``directory/<id>.json``) counts as existing and its paths are returned.

    ``documents``: other files the receipt binds by the sha256 of their bytes (a discharge's
    obligation records, ``harness-discharge-receipt/v1``), written first, each through an fsynced
    temporary file renamed over its path (a re-discharge replaces the build's record), so a
    receipt never names a file that is not on disk. Raises ``InvalidInput`` when one cannot be
    written (the receipt is then not written).

    The caller's ``receipt`` is not modified; what is written is ``prepare_receipt``'s result.
    Arrays must be numeric NumPy arrays (e.g. ``metrics.position_metrics`` output plus
    ``prompt_index`` and ``position``).

    A receipt, once written, is never replaced: a ledger row holds the sha256 of its bytes, and
    the bytes include ``created``, so the same content written again later differs. The json is
    created with link semantics (``write_new``): when ``<id>.json`` exists — an earlier run, or
    an identical run racing this one — it is left as it is and, if it loads and checks, its paths
    are returned; if it does not, ``InvalidInput`` says so (it is evidence: ``harness ledger
    verify`` tells whether a row names it). The sidecar is hashed by content, not bytes: an
    existing one holding the same arrays is kept, a missing or damaged one is (re)written.

    Raises ``InvalidInput`` when the receipt breaks the schema, holds NaN/Inf or object arrays,
    names an unknown ``schema``, the directory cannot be written, or an existing ``<id>.json``
    is damaged.
    """
    arrays = {str(k): np.asarray(v) for k, v in arrays.items()}
    r = prepare_receipt(receipt, arrays)
    rid = r["id"]
    _write_documents(documents or {}, rid)
    flat = Path(directory) / f"{rid}.json"
    if flat.exists():  # the earlier flat layout: that receipt is the evidence
        try:
            loaded = load_receipt(flat)
        except InvalidInput as e:
            raise InvalidInput(f"{flat} already exists and is damaged ({e}); it is evidence and is not replaced: "
                               "run `harness ledger verify`, then move it aside") from None
        return loaded.json_path, loaded.npz_path
    directory = shard_dir(directory, rid)
    json_path, npz_path = directory / f"{rid}.json", directory / f"{rid}.npz"
    try:
        text = json.dumps(r, indent=2, sort_keys=True, ensure_ascii=False, allow_nan=False) + "\n"
        directory.mkdir(parents=True, exist_ok=True)
        sweep_temp_files(directory)
        save = lambda f: np.savez_compressed(f, **arrays)  # noqa: E731  (deflated: a 1,479-position cell 126 -> 43 KB)
        if not write_new(directory, npz_path.name, save) and not _sidecar_holds(npz_path, r["arrays"]["sha256"]):
            _replace_file(directory, npz_path.name, save)
        created = write_new(directory, json_path.name, lambda f: f.write(text.encode("utf-8")))
        _fsync_dir(directory)
    except OSError as e:
        raise InvalidInput(f"{directory}: cannot write receipt {rid}: {e.strerror or e}") from e
    if not created:
        try:
            load_receipt(json_path)
        except InvalidInput as e:
            raise InvalidInput(f"{json_path} already exists and is damaged ({e}); it is evidence and is not replaced: "
                               "run `harness ledger verify`, then move it aside") from None
    return json_path, npz_path


def load_receipt(path: str | Path) -> LoadedReceipt:
    """Load and check a receipt: ``path`` is its ``.json`` (or ``.npz``; the other is beside it).

    Checks the schema, that the id is the content hash and the file's name, and that the npz
    (read with ``allow_pickle=False``) holds exactly the arrays the receipt's ``arrays.sha256``
    names. Raises ``InvalidInput`` on any failure, naming the file.
    """
    path = Path(path)
    json_path = path.with_suffix(".json")
    npz_path = path.with_suffix(".npz")
    try:
        receipt = json.loads(json_path.read_text(encoding="utf-8"))
    except OSError as e:
        raise InvalidInput(f"{json_path}: cannot read receipt: {e.strerror or e}") from e
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise InvalidInput(f"{json_path}: not a JSON receipt: {e}") from e
    if not isinstance(receipt, dict):
        raise InvalidInput(f"{json_path}: not a JSON receipt (top level is {type(receipt).__name__})")
    validate_receipt(receipt, where=str(json_path))
    rid = receipt_id(receipt)
    if receipt["id"] != rid:
        raise InvalidInput(f"{json_path}: id {receipt['id'][:12]}… is not the content hash {rid[:12]}… (receipt edited?)")
    if json_path.stem != rid:
        raise InvalidInput(f"{json_path}: file name does not match receipt id {rid}")
    try:
        with np.load(npz_path, allow_pickle=False) as z:
            arrays = {k: z[k] for k in z.files}
    except FileNotFoundError as e:
        raise InvalidInput(f"{npz_path}: receipt's arrays file is missing") from e
    except (OSError, ValueError) as e:  # ValueError: pickled content or a damaged zip
        raise InvalidInput(f"{npz_path}: cannot read receipt arrays: {e}") from e
    if arrays_sha256(arrays) != receipt["arrays"]["sha256"]:
        raise InvalidInput(f"{npz_path}: arrays do not match the receipt's arrays.sha256 (sidecar replaced or edited?)")
    return LoadedReceipt(receipt, arrays, json_path, npz_path)
