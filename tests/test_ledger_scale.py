"""Evidence at scale: paged renderings equal to a full render, streaming and incremental verify,
the sharded receipt layout (and the flat one still read), file modes, 16 concurrent writers, and a
kill -9 during an append."""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import os
import signal
import stat
import sys
import time
from pathlib import Path

import pytest
from test_receipts import make_receipt

from harness.evidence import index as I
from harness.evidence import ledger as L
from harness.evidence.receipts import iter_receipt_files, load_receipt, migrate_receipts, receipt_file, write_receipt
from harness.evidence.report import default_report_dir

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
from _grow_ledger import grow  # noqa: E402


@pytest.fixture
def paths(tmp_path):
    root = tmp_path / "repo"
    return root / "evidence" / "parity" / "ledger.jsonl", root / "evidence" / "parity" / "receipts", root / "LEDGER.md"


@pytest.fixture
def small_pages(monkeypatch):
    monkeypatch.setattr(L, "PAGE_ROWS", 4)


def append_measured(ledger_path: Path, receipts_dir: Path, seed: int) -> dict:
    receipt, arrays = make_receipt(seed=seed)
    jp, _ = write_receipt(receipt, arrays, receipts_dir)
    return L.append_row(ledger_path, L.row_from_receipt(json.loads(jp.read_text())), receipt_path=jp)


def _template(receipts_dir: Path) -> tuple[dict, Path]:
    receipt, arrays = make_receipt(seed=99)
    jp, npz = write_receipt(receipt, arrays, receipts_dir / "_template")
    return json.loads(jp.read_text()), npz


def _pages_text(md: Path, top: int) -> list[str]:
    return [L.page_path(md, p).read_text() for p in range(top - 1, 0, -1)]


def test_incremental_pages_equal_a_full_render_with_a_supersede_of_an_old_page(paths, small_pages):
    ledger_path, receipts_dir, md = paths
    for seed in range(9):  # pages of 4: 1-4, 5-8, 9
        append_measured(ledger_path, receipts_dir, seed)
    before = L.page_path(md, 1).read_text()
    L.append_row(ledger_path, L.supersede_row(2, "wrong build"))  # seq 10 withdraws a row of page 1
    after = L.page_path(md, 1).read_text()
    assert before != after and "~~PASS~~ (superseded by #10)" in after  # the old page was re-rendered
    for seed in range(9, 12):
        append_measured(ledger_path, receipts_dir, seed)  # seq 11-13: page 3 fills, page 4 begins
    rows = L.read_rows(ledger_path)
    full = L.render_markdown(rows, ledger_path, md)
    assert L.join_pages(md.read_text(), _pages_text(md, L.page_of(13))) == full
    assert sorted(p.name for p in L.pages_dir(md).iterdir()) == ["page-000001.md", "page-000002.md", "page-000003.md"]
    assert len([ln for ln in md.read_text().splitlines() if ln.startswith("| 1")]) == 1  # LEDGER.md: seq 13 only
    # a full re-render writes the same bytes the appends left
    texts = {p: p.read_text() for p in [md, *L.pages_dir(md).iterdir()]}
    L.render_pages(ledger_path, md, full=True)
    assert {p: p.read_text() for p in texts} == texts
    assert L.verify_ledger(ledger_path, receipts_dir) == []

    # the index: its pages' tables, concatenated, are the full index's table
    I.refresh_index(ledger_path)
    out = I.reports_dir(ledger_path)
    def table(text):
        return [ln for ln in text.splitlines() if ln.startswith("| ") and not ln.startswith(("| # |", "| \\# |"))]
    pages = [(out / I.INDEX_MD).read_text()] + [(out / I.INDEX_PAGES / f"page-{n:06d}.md").read_text() for n in (3, 2, 1)]
    assert sum((table(t) for t in pages), []) == table(I.build_index(ledger_path).to_markdown())
    assert "withdrawn by \\#10" in (out / I.INDEX_PAGES / "page-000001.md").read_text()


def test_the_head_page_links_a_bounded_number_of_older_pages(paths, small_pages, monkeypatch):
    monkeypatch.setattr(L, "PAGE_LINKS", 3)
    assert L.linked_pages(2) == [1] and L.linked_pages(5) == [4, 3, 2, 1] and L.linked_pages(9) == [8, 7, 6, None, 1]
    ledger_path, receipts_dir, md = paths
    template, npz = _template(receipts_dir)
    grow(ledger_path, 33, template, npz)  # 9 pages of 4
    links = next(ln for ln in md.read_text().splitlines() if ln.startswith("Older rows"))
    assert links == ("Older rows, newest first: [8](LEDGER-pages/page-000008.md), [7](LEDGER-pages/page-000007.md), "
                     "[6](LEDGER-pages/page-000006.md), …, [1](LEDGER-pages/page-000001.md).")
    assert "The rows before these: [page 4](page-000004.md)." in L.page_path(md, 5).read_text()
    assert "The rows before these" not in L.page_path(md, 1).read_text()
    full = L.render_markdown(L.read_rows(ledger_path), ledger_path, md)
    assert L.join_pages(md.read_text(), _pages_text(md, 9)) == full
    assert L.verify_ledger(ledger_path, receipts_dir, deep=False) == []
    index = (I.reports_dir(ledger_path) / I.INDEX_MD).read_text()
    assert "page-000005" not in index and "page-000006" in index and "page-000001" in index


def test_the_index_reads_no_receipt_twice(paths, monkeypatch):
    ledger_path, receipts_dir, _ = paths
    for seed in range(3):
        append_measured(ledger_path, receipts_dir, seed)
    I.refresh_index(ledger_path, full=True)
    read = []
    real = I._summary
    monkeypatch.setattr(I, "_summary", lambda d, rid: read.append(rid) or real(d, rid))
    append_measured(ledger_path, receipts_dir, 3)
    I.refresh_index(ledger_path)
    row = L.read_rows(ledger_path)[-1]
    assert read == [row["receipt_id"]]  # only the new row's receipt


def _edit_row(ledger_path: Path, index: int, old: bytes, new: bytes) -> None:
    lines = ledger_path.read_bytes().splitlines(keepends=True)
    assert old in lines[index]
    lines[index] = lines[index].replace(old, new)
    ledger_path.write_bytes(b"".join(lines))


@pytest.mark.parametrize("where", ["old", "newest"])
def test_full_mode_finds_tampering_in_an_old_row_and_in_the_newest(paths, small_pages, where):
    ledger_path, receipts_dir, md = paths
    template, npz = _template(receipts_dir)
    grow(ledger_path, 30, template, npz)
    st = L.VerifyStats()
    assert L.verify_ledger(ledger_path, receipts_dir, deep=True, stats=st) == []
    assert (st.rows, st.receipts, st.deep) == (30, 30, 30)
    cp = L.Checkpoint(str(ledger_path), st.seq, st.row_hash, st.offset, st.prefix_sha256)
    i = 2 if where == "old" else 29
    _edit_row(ledger_path, i, b'"positions":64', b'"positions":65')
    found = L.verify_ledger(ledger_path, receipts_dir, checkpoint=cp)
    assert ("EDITED", i + 1, i + 1) in {(p.code, p.seq, p.line) for p in found}
    assert any(p.code == "CHECKPOINT" for p in found)  # the checkpoint no longer vouches for anything


def test_full_mode_finds_an_edited_receipt_the_checkpoint_vouched_for(paths):
    ledger_path, receipts_dir, _ = paths
    template, npz = _template(receipts_dir)
    grow(ledger_path, 5, template, npz)
    st = L.VerifyStats()
    assert L.verify_ledger(ledger_path, receipts_dir, stats=st) == []
    cp = L.Checkpoint(str(ledger_path), st.seq, st.row_hash, st.offset, st.prefix_sha256)
    rid = L.read_rows(ledger_path)[1]["receipt_id"]
    rp = receipt_file(receipts_dir, rid)
    rp.write_text(rp.read_text() + " ")
    st2 = L.VerifyStats()
    found = L.verify_ledger(ledger_path, receipts_dir, checkpoint=cp, stats=st2)
    assert [(p.code, p.seq) for p in found] == [("RECEIPT-HASH", 2)] and st2.deep == 0  # hashed, not re-loaded


def test_full_mode_hashes_every_receipt_across_batches_in_flight(paths, monkeypatch):
    # receipts are hashed in batches on threads while the pass goes on: with batches of 2, many
    # are in flight and collected mid-pass; each edited or missing receipt is still named on its row
    monkeypatch.setattr(L._ReceiptHasher, "BATCH", 2)
    ledger_path, receipts_dir, _ = paths
    template, npz = _template(receipts_dir)
    grow(ledger_path, 41, template, npz)
    rows = L.read_rows(ledger_path)
    for i in (0, 17, 40):
        rp = receipt_file(receipts_dir, rows[i]["receipt_id"])
        rp.write_bytes(rp.read_bytes().replace(b'"ci-', b'"CI-', 1))
    receipt_file(receipts_dir, rows[25]["receipt_id"]).unlink()
    st = L.VerifyStats()
    found = L.verify_ledger(ledger_path, receipts_dir, deep=False, stats=st)
    assert [(p.code, p.seq) for p in found] == [("RECEIPT-HASH", 1), ("RECEIPT-HASH", 18), ("RECEIPT-MISSING", 26), ("RECEIPT-HASH", 41)]
    assert (st.rows, st.receipts) == (41, 40)


def test_a_receipt_larger_than_the_read_buffer_hashes_whole(tmp_path):
    p = tmp_path / "big.json"
    p.write_bytes(os.urandom((1 << 20) * 2 + 12345))  # over two buffers' worth: three reads
    assert L._sha256_of(str(p)) == hashlib.sha256(p.read_bytes()).hexdigest()
    (tmp_path / "empty.json").write_bytes(b"")
    assert L._sha256_of(str(tmp_path / "empty.json")) == hashlib.sha256(b"").hexdigest()


def test_deep_mode_names_every_row_whose_shared_array_file_was_edited(paths):
    # grown receipts share one hard-linked sidecar: an edit of that one file is an edit of every
    # row's arrays, and --deep (which loads each receipt's arrays) names each row, not only the first.
    # Full mode hashes the receipts' JSON only (the row binds those bytes; arrays cost milliseconds
    # a receipt to decode), so it does not see this edit: that is --deep's job.
    ledger_path, receipts_dir, _ = paths
    template, npz = _template(receipts_dir)
    grow(ledger_path, 3, template, npz)
    rows = L.read_rows(ledger_path)
    shared = receipt_file(receipts_dir, rows[0]["receipt_id"], ".npz")
    assert shared.stat().st_nlink >= 3
    loaded = load_receipt(receipt_file(receipts_dir, rows[0]["receipt_id"]))
    arrays = dict(loaded.arrays)
    name = sorted(arrays)[0]
    arrays[name] = arrays[name].copy()
    arrays[name].flat[0] = not arrays[name].flat[0] if arrays[name].dtype == bool else arrays[name].flat[0] + 1
    import numpy as np
    with open(shared, "r+b") as f:  # in place: every hard link sees it
        f.truncate(0)
        np.savez_compressed(f, **arrays)
    found = L.verify_ledger(ledger_path, receipts_dir, deep=True)
    assert [(p.code, p.seq) for p in found] == [("RECEIPT-INVALID", 1), ("RECEIPT-INVALID", 2), ("RECEIPT-INVALID", 3)]
    assert all("arrays do not match" in p.message for p in found)
    assert L.verify_ledger(ledger_path, receipts_dir, deep=False) == []


def test_incremental_checks_the_new_rows_and_refuses_an_edited_prefix_or_checkpoint(paths, small_pages):
    ledger_path, receipts_dir, md = paths
    template, npz = _template(receipts_dir)
    grow(ledger_path, 10, template, npz)
    st = L.VerifyStats()
    assert L.verify_ledger(ledger_path, receipts_dir, stats=st) == []
    cp = L.Checkpoint(str(ledger_path), st.seq, st.row_hash, st.offset, st.prefix_sha256)
    append_measured(ledger_path, receipts_dir, 1)
    st2 = L.VerifyStats()
    assert L.verify_ledger(ledger_path, receipts_dir, checkpoint=cp, incremental=True, stats=st2) == []
    assert (st2.rows, st2.skipped, st2.deep, st2.seq) == (1, 10, 1, 11)

    # a tampered checkpoint (it names another row hash, or more bytes) is refused, never OK
    for bad in (L.Checkpoint(cp.ledger, cp.seq, "0" * 64, cp.offset, cp.prefix_sha256),
                L.Checkpoint(cp.ledger, cp.seq, cp.row_hash, cp.offset, "f" * 64),
                L.Checkpoint(cp.ledger, cp.seq + 5, cp.row_hash, cp.offset + 10_000, cp.prefix_sha256)):
        found = L.verify_ledger(ledger_path, receipts_dir, checkpoint=bad, incremental=True)
        assert [p.code for p in found] == ["CHECKPOINT"], bad

    # an edit of the checked prefix, even with every hash recomputed, is refused
    rows = L.read_rows(ledger_path)
    rows[3]["min_cosine"] = 0.5
    prev = rows[2]["row_hash"]
    for r in rows[3:]:
        r["prev_hash"] = prev
        r["row_hash"] = L.row_hash(r)
        prev = r["row_hash"]
    ledger_path.write_bytes(b"".join(L.canonical_json(r) + b"\n" for r in rows))
    L.render_pages(ledger_path, md, full=True)
    found = L.verify_ledger(ledger_path, receipts_dir, checkpoint=cp, incremental=True)
    assert [p.code for p in found] == ["CHECKPOINT"]


def test_incremental_verify_from_the_command_line_keeps_its_checkpoint_outside_the_evidence(paths, tmp_path, monkeypatch):
    from click.testing import CliRunner

    from harness.cli import cli

    ledger_path, receipts_dir, _ = paths
    template, npz = _template(receipts_dir)
    grow(ledger_path, 4, template, npz)
    state = tmp_path / "state"
    monkeypatch.setenv("HARNESS_VERIFY_STATE", str(state))
    r = CliRunner().invoke(cli, ["ledger", "verify", "--ledger", str(ledger_path), "--quiet"])
    assert r.exit_code == 0, r.output
    # full mode hashes every receipt file and parses none (the row's receipt_sha256 binds its bytes)
    assert "OK (4 rows" in r.output and "4 receipts hashed, 0 loaded and matched" in r.output and "rows/s" in r.output
    r = CliRunner().invoke(cli, ["ledger", "verify", "--ledger", str(ledger_path), "--quiet", "--deep"])
    assert r.exit_code == 0 and "4 receipts hashed, 4 loaded and matched" in r.output, r.output
    cp = next(state.iterdir())
    assert not str(cp).startswith(str(ledger_path.parent.parent))
    append_measured(ledger_path, receipts_dir, 7)
    r = CliRunner().invoke(cli, ["ledger", "verify", "--ledger", str(ledger_path), "--incremental", "--quiet"])
    assert r.exit_code == 0 and "incremental" in r.output and "1 rows in" in r.output, r.output
    assert "1 receipts hashed, 1 loaded and matched" in r.output  # the new row's receipt is loaded
    doc = json.loads(cp.read_text())
    doc["row_hash"] = "1" * 64
    cp.write_text(json.dumps(doc))
    r = CliRunner().invoke(cli, ["ledger", "verify", "--ledger", str(ledger_path), "--incremental", "--quiet"])
    assert r.exit_code == 1 and "CHECKPOINT" in r.output


def test_the_flat_receipt_layout_is_still_read_and_can_be_migrated(paths):
    ledger_path, receipts_dir, md = paths
    rows = [append_measured(ledger_path, receipts_dir, seed) for seed in range(3)]
    sharded = list(iter_receipt_files(receipts_dir))
    for jp in sharded:  # put them back as the earlier layout had them
        for p in (jp.with_suffix(".npz"), jp):
            p.rename(receipts_dir / p.name)
    # two receipts can share a shard folder (the first two hex digits of their ids): remove each once
    for shard in {jp.parent for jp in sharded}:
        shard.rmdir()
    flat = receipts_dir / f"{rows[0]['receipt_id']}.json"
    assert flat.is_file() and receipt_file(receipts_dir, rows[0]["receipt_id"]) == flat
    assert L.verify_ledger(ledger_path, receipts_dir) == []
    assert default_report_dir(flat, rows[0]["receipt_id"]) == ledger_path.parent / "reports" / rows[0]["receipt_id"][:16]
    # writing the same receipt again finds the flat one instead of making a second copy
    receipt, arrays = make_receipt(seed=0)
    jp, _ = write_receipt(receipt, arrays, receipts_dir)
    assert jp == flat
    assert migrate_receipts(receipts_dir) == (3, 0)
    moved = receipt_file(receipts_dir, rows[0]["receipt_id"])
    assert moved.parent.name == rows[0]["receipt_id"][:2] and not flat.exists()
    assert load_receipt(moved).receipt["id"] == rows[0]["receipt_id"]
    assert default_report_dir(moved, rows[0]["receipt_id"]) == ledger_path.parent / "reports" / rows[0]["receipt_id"][:16]
    assert L.verify_ledger(ledger_path, receipts_dir) == []


def test_evidence_files_follow_the_umask(paths, tmp_path):
    import yaml

    from harness.paths import SUITE_ROOT
    from harness.runs.calibrate.document import write_thresholds

    ledger_path, receipts_dir, md = paths
    old = os.umask(0o022)
    try:
        append_measured(ledger_path, receipts_dir, 0)
        jp = iter_receipt_files(receipts_dir)[0]
        modes = {p.name.rsplit(".", 1)[-1]: stat.S_IMODE(p.stat().st_mode) for p in (jp, jp.with_suffix(".npz"), ledger_path, md)}
        assert modes == {"json": 0o644, "npz": 0o644, "jsonl": 0o644, "md": 0o644}
        doc = yaml.safe_load((SUITE_ROOT / "thresholds.yaml").read_text())
        out = write_thresholds(doc, tmp_path / "thresholds.yaml")
        assert stat.S_IMODE(out.stat().st_mode) == 0o644
        os.umask(0o077)
        append_measured(ledger_path, receipts_dir, 1)
        newest = receipt_file(receipts_dir, L.read_rows(ledger_path)[-1]["receipt_id"])
        assert stat.S_IMODE(newest.stat().st_mode) == 0o600
    finally:
        os.umask(old)


def test_full_mode_compares_every_older_page_in_one_pass(paths, small_pages):
    ledger_path, receipts_dir, md = paths
    template, npz = _template(receipts_dir)
    grow(ledger_path, 13, template, npz)  # pages 1-4, 5-8, 9-12 are files; LEDGER.md shows 13
    L.append_row(ledger_path, L.supersede_row(3, "wrong build"))  # re-renders page 1 after it was written
    assert L.verify_ledger(ledger_path, receipts_dir) == []
    page2 = L.page_path(md, 2)
    page2.write_text(page2.read_text().replace("| 6 |", "| 66 |"))
    found = L.verify_ledger(ledger_path, receipts_dir)
    assert [(p.code, "page-000002.md" in p.message) for p in found] == [("MARKDOWN", True)]
    page2.write_text(L.render_page(2, L.read_rows(ledger_path)[4:8], {}, {"seq": 14}, ledger_path, md))
    assert L.verify_ledger(ledger_path, receipts_dir) == []
    # page 1 without the strike-through of seq 3 (as rendered before the supersede row) is found
    page1 = L.page_path(md, 1)
    page1.write_text(L.render_page(1, L.read_rows(ledger_path)[:4], {}, {"seq": 14}, ledger_path, md))
    assert [p.code for p in L.verify_ledger(ledger_path, receipts_dir)] == ["MARKDOWN"]


def test_a_row_in_another_json_layout_is_judged_by_its_content(paths):
    ledger_path, receipts_dir, _ = paths
    template, npz = _template(receipts_dir)
    grow(ledger_path, 3, template, npz)
    lines = ledger_path.read_bytes().splitlines(keepends=True)
    row = json.loads(lines[1])
    lines[1] = (json.dumps(row, indent=None) + "\n").encode()  # same content, spaces after separators
    ledger_path.write_bytes(b"".join(lines))
    assert L.verify_ledger(ledger_path, receipts_dir) == []
    row["min_cosine"] = 0.5  # an edit in the same layout is still an edit
    lines[1] = (json.dumps(row, indent=None) + "\n").encode()
    ledger_path.write_bytes(b"".join(lines))
    assert ("EDITED", 2) in {(p.code, p.seq) for p in L.verify_ledger(ledger_path, receipts_dir, deep=False)}


def test_the_kept_standing_counts_equal_a_count_from_the_rows(paths):
    from harness.evidence.ledger_cache import LedgerCache, cache_path

    ledger_path, receipts_dir, _ = paths
    for seed in range(4):
        append_measured(ledger_path, receipts_dir, seed)
    L.append_row(ledger_path, L.supersede_row(2, "wrong build"))
    L.append_row(ledger_path, L.supersede_row(2, "twice"))  # a target withdrawn twice counts once
    L.append_row(ledger_path, L.supersede_row(5, "a supersede row withdrawn"))  # not a measurement: nothing to take out
    with LedgerCache.open(ledger_path, L.CACHE_COLUMNS) as cache:
        kept = cache.standing_counts()
        assert kept == cache.standing_counts_scan() and sum(kept.values()) == 3 and cache.count() == 7
    cache_path(ledger_path).unlink()  # rebuilt from scratch: the same counts
    with LedgerCache.open(ledger_path, L.CACHE_COLUMNS) as cache:
        assert cache.standing_counts() == kept and cache.count() == 7


def test_sweep_reads_each_existing_receipt_once(paths, monkeypatch):
    from harness.evidence.record import evidence_paths
    from harness.release import sweep as S
    from harness.release.cells import input_key, receipt_inputs

    ledger_path, receipts_dir, _ = paths
    rows = [append_measured(ledger_path, receipts_dir, seed) for seed in range(3)]
    read = []
    from harness.release import cells as C
    real = C.receipt_keys_of
    monkeypatch.setattr(C, "receipt_keys_of", lambda p: read.append(p.stem) or real(p))
    found, by_id = S.existing_receipts(evidence_paths(ledger_path))
    assert sorted(read) == sorted(r["receipt_id"] for r in rows)
    def read_all():  # what reading every receipt gives: the latest receipt of each key
        best = {}
        for r in rows_now():
            rec = load_receipt(receipt_file(receipts_dir, r["receipt_id"])).receipt
            k = input_key(receipt_inputs(rec))
            if k not in best or rec["created"] >= best[k][0]:
                best[k] = (rec["created"], r["receipt_id"])
        return {k: v[1] for k, v in best.items()}
    rows_now = lambda: L.read_rows(ledger_path)  # noqa: E731
    assert {k: p.stem for k, p in found.items()} == read_all() and found
    seq_of = {r["receipt_id"]: r["seq"] for r in rows}
    assert {rid: r["seq"] for rid, r in by_id.items()} == {p.stem: seq_of[p.stem] for p in found.values()}
    read.clear()
    new = append_measured(ledger_path, receipts_dir, 3)
    found2, by_id2 = S.existing_receipts(evidence_paths(ledger_path))
    assert read == [new["receipt_id"]] and by_id2[new["receipt_id"]]["seq"] == 4  # only the new receipt is read
    assert {k: p.stem for k, p in found2.items()} == read_all()


def _writer(ledger_path: str, receipts_dir: str, seed: int, barrier) -> None:
    barrier.wait()
    append_measured(Path(ledger_path), Path(receipts_dir), seed)


@pytest.mark.parametrize("writers, grown", [
    (4, 120),  # the default suite: a few seconds
    pytest.param(16, 600, marks=pytest.mark.slow),  # the figure (8–30 s on 2 loaded cores): pytest -m slow tests/test_ledger_scale.py
])
def test_concurrent_writers_on_a_large_ledger(paths, small_pages, writers, grown):
    ledger_path, receipts_dir, md = paths
    template, npz = _template(receipts_dir)
    grow(ledger_path, grown, template, npz)  # many pages: the writers render pages, and fill some
    st = L.VerifyStats()
    assert L.verify_ledger(ledger_path, receipts_dir, deep=False, stats=st) == []
    cp = L.Checkpoint(str(ledger_path), st.seq, st.row_hash, st.offset, st.prefix_sha256)
    ctx = multiprocessing.get_context("fork")
    barrier = ctx.Barrier(writers)
    procs = [ctx.Process(target=_writer, args=(str(ledger_path), str(receipts_dir), 1000 + s, barrier)) for s in range(writers)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    assert [p.exitcode for p in procs] == [0] * writers
    rows = L.read_rows(ledger_path)
    assert [r["seq"] for r in rows] == list(range(1, grown + writers + 1))
    assert len({r["receipt_id"] for r in rows[grown:]}) == writers
    st = L.VerifyStats()  # every row re-hashed; the new receipts loaded and matched to their rows
    assert L.verify_ledger(ledger_path, receipts_dir, checkpoint=cp, stats=st) == [] and (st.rows, st.deep) == (grown + writers, writers)
    assert f"Head: seq {grown + writers} · row_hash `{rows[-1]['row_hash']}`" in md.read_text()


def _append_forever(ledger_path: str, receipts_dir: str) -> None:
    seed = 0
    while True:
        append_measured(Path(ledger_path), Path(receipts_dir), 5000 + seed)
        seed += 1


def test_kill_9_during_appends_leaves_a_ledger_the_next_append_extends_or_verify_names(paths):
    ledger_path, receipts_dir, md = paths
    template, npz = _template(receipts_dir)
    grow(ledger_path, 200, template, npz)
    ctx = multiprocessing.get_context("fork")
    outcomes = []
    for k in range(4):
        p = ctx.Process(target=_append_forever, args=(str(ledger_path), str(receipts_dir)))
        p.start()
        time.sleep(0.4 + 0.3 * k)
        os.kill(p.pid, signal.SIGKILL)
        p.join()
        before = len(L.read_rows(ledger_path)) if ledger_path.read_bytes().endswith(b"\n") else None
        try:
            row = append_measured(ledger_path, receipts_dir, 9000 + k)
        except Exception as e:  # refused: verify must name the problem
            problems = L.verify_ledger(ledger_path, receipts_dir, deep=False)
            assert problems and all(p.line or p.seq for p in problems if p.code == "MALFORMED"), (e, problems)
            outcomes.append("named")
            break
        assert before is not None and row["seq"] == before + 1
        assert L.verify_ledger(ledger_path, receipts_dir, deep=False) == []
        outcomes.append("extended")
    assert outcomes
