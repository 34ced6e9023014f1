"""The sign-off ledger: hash chain, LEDGER.md head, receipts, concurrency, summaries."""

from __future__ import annotations

import json
import multiprocessing
from pathlib import Path

import pytest
from test_receipts import make_receipt

from harness.errors import InvalidInput
from harness.evidence import ledger as L
from harness.evidence.receipts import canonical_json, receipt_file, write_receipt


@pytest.fixture
def paths(tmp_path):
    root = tmp_path / "repo"
    return root / "evidence" / "parity" / "ledger.jsonl", root / "evidence" / "parity" / "receipts", root / "LEDGER.md"


def append_measured(ledger_path: Path, receipts_dir: Path, seed: int, **overrides) -> dict:
    receipt, arrays = make_receipt(seed=seed, **overrides)
    jp, _ = write_receipt(receipt, arrays, receipts_dir)
    return L.append_row(ledger_path, L.row_from_receipt(json.loads(jp.read_text())), receipt_path=jp)


@pytest.fixture
def three(paths):
    ledger_path, receipts_dir, _ = paths
    rows = [append_measured(ledger_path, receipts_dir, seed) for seed in range(3)]
    return rows


def lines(ledger_path: Path) -> list[bytes]:
    return ledger_path.read_bytes().splitlines(keepends=True)


def codes(problems) -> set[tuple[str, int | None, int | None]]:
    return {(p.code, p.seq, p.line) for p in problems}


def test_rows_chain_and_render(paths, three):
    ledger_path, receipts_dir, md = paths
    assert [r["seq"] for r in three] == [1, 2, 3]
    assert three[0]["prev_hash"] == L.GENESIS
    assert [r["prev_hash"] for r in three[1:]] == [r["row_hash"] for r in three[:2]]
    assert all(r["row_hash"] == L.row_hash(r) for r in three)
    on_disk = [json.loads(x) for x in lines(ledger_path)]
    assert on_disk == three
    assert lines(ledger_path)[0] == canonical_json(three[0]) + b"\n"
    r = three[1]
    assert (r["kind"], r["model"], r["quant"], r["candidate"], r["reference"], r["verdict"], r["basis_kind"]) == (
        "parity", "fixture:tiny", "F32", "oracle 0.1.0", "llama.cpp b7000", "PASS", "measured")  # the shipped gate's basis
    assert r["positions"] == 64 and 0.99 < r["min_cosine"] < 1 and r["argmax_agreement"] == 1.0
    assert (receipts_dir / r["receipt_id"][:2] / f"{r['receipt_id']}.json").exists()  # sharded by id prefix

    text = md.read_text()  # LEDGER.md at the repo root: ledger is <root>/evidence/parity/ledger.jsonl
    assert f"Head: seq 3 · row_hash `{three[2]['row_hash']}`" in text
    assert "`evidence/parity/ledger.jsonl`" in text
    table = [ln for ln in text.splitlines() if ln.startswith("| 2 |")][0]
    assert "fixture:tiny" in table and f"{r['min_cosine']:.6f}" in table and "| 0 / 0 |" in table
    assert f"`{r['receipt_id'][:12]}`" in table
    assert L.verify_ledger(ledger_path, receipts_dir) == []


def test_one_edited_byte_is_named(paths, three):
    ledger_path, receipts_dir, _ = paths
    rows = lines(ledger_path)
    assert b'"positions":64' in rows[1]
    rows[1] = rows[1].replace(b'"positions":64', b'"positions":65')  # one byte, still valid JSON
    ledger_path.write_bytes(b"".join(rows))
    problems = L.verify_ledger(ledger_path)
    assert ("EDITED", 2, 2) in codes(problems)
    assert {p.seq for p in problems if p.code != "MARKDOWN"} == {2}  # the chain after it still holds
    with_receipts = L.verify_ledger(ledger_path, receipts_dir)
    mismatch = [p for p in with_receipts if p.code == "RECEIPT-MISMATCH"]
    assert len(mismatch) == 1 and mismatch[0].seq == 2 and "positions: row 65 vs receipt 64" in mismatch[0].message


def test_edited_byte_that_breaks_json_is_named_by_line_and_seq(paths, three):
    ledger_path, _, _ = paths
    rows = lines(ledger_path)
    rows[1] = rows[1].replace(b'"kind":"parity"', b'"kind":"parity', 1)
    ledger_path.write_bytes(b"".join(rows))
    problems = L.verify_ledger(ledger_path)
    assert ("MALFORMED", 2, 2) in codes(problems)


def test_removed_last_row_is_detected_by_the_markdown_head(paths, three):
    ledger_path, _, _ = paths
    ledger_path.write_bytes(b"".join(lines(ledger_path)[:2]))
    problems = L.verify_ledger(ledger_path)
    assert [p.code for p in problems] == ["HEAD"]
    assert "shows head seq 3 but the ledger ends at seq 2" in problems[0].message
    assert "1 row(s) removed from the end" in problems[0].message


def test_removed_middle_row_is_detected(paths, three):
    ledger_path, _, _ = paths
    rows = lines(ledger_path)
    ledger_path.write_bytes(rows[0] + rows[2])
    assert {("SEQUENCE", 3, 2), ("CHAIN", 3, 2)} <= codes(L.verify_ledger(ledger_path))


def test_reordered_rows_are_detected(paths, three):
    ledger_path, _, _ = paths
    rows = lines(ledger_path)
    ledger_path.write_bytes(rows[0] + rows[2] + rows[1])
    found = codes(L.verify_ledger(ledger_path))
    assert {("SEQUENCE", 3, 2), ("CHAIN", 3, 2), ("SEQUENCE", 2, 3), ("CHAIN", 2, 3)} <= found
    assert not any(code == "EDITED" for code, _, _ in found)  # each row is intact, only misplaced


def test_forged_row_with_recomputed_hashes_is_caught_by_its_receipt(paths, three):
    ledger_path, receipts_dir, md = paths
    # A forger who recomputes row_hash, chains it and re-renders LEDGER.md passes the chain
    # checks; the row still has to match a receipt whose bytes hash to it.
    forged = dict(three[2], seq=4, prev_hash=three[2]["row_hash"], verdict="PASS", min_cosine=0.9999, time="2026-12-01T00:00:00Z")
    forged["row_hash"] = L.row_hash(forged)
    with open(ledger_path, "ab") as f:
        f.write(canonical_json(forged) + b"\n")
    md.write_text(L.render_markdown(three + [forged], ledger_path, md))
    assert L.verify_ledger(ledger_path) == []
    problems = L.verify_ledger(ledger_path, receipts_dir)
    assert [(p.code, p.seq, p.line) for p in problems] == [("RECEIPT-MISMATCH", 4, 4)]
    assert "min_cosine: row 0.9999" in problems[0].message

    invented = dict(forged, seq=5, prev_hash=forged["row_hash"], receipt_id="9" * 64)
    invented["row_hash"] = L.row_hash(invented)
    with open(ledger_path, "ab") as f:
        f.write(canonical_json(invented) + b"\n")
    assert ("RECEIPT-MISSING", 5, 5) in codes(L.verify_ledger(ledger_path, receipts_dir))


def test_altered_receipt_file_is_detected(paths, three):
    ledger_path, receipts_dir, _ = paths
    rp = receipt_file(receipts_dir, three[0]["receipt_id"])
    rp.write_text(rp.read_text() + " ")
    assert codes(L.verify_ledger(ledger_path, receipts_dir)) == {("RECEIPT-HASH", 1, 1)}


def test_hand_edited_markdown_and_missing_markdown_are_detected(paths, three):
    ledger_path, _, md = paths
    md.write_text(md.read_text().replace("| PASS |", "| FAIL |", 1))
    assert [p.code for p in L.verify_ledger(ledger_path)] == ["MARKDOWN"]
    md.unlink()
    assert [p.code for p in L.verify_ledger(ledger_path)] == ["HEAD"]


def test_supersede_names_its_row_and_shows_in_the_table(paths, three):
    ledger_path, receipts_dir, md = paths
    row = L.append_row(ledger_path, L.supersede_row(2, "reference built with the wrong n_ubatch"))
    assert (row["seq"], row["kind"], row["supersedes"], row["verdict"]) == (4, "supersede", 2, None)
    text = md.read_text()
    assert "~~PASS~~ (superseded by #4)" in text
    assert "supersedes #2: reference built with the wrong n_ubatch" in text
    assert L.verify_ledger(ledger_path, receipts_dir) == []
    with pytest.raises(InvalidInput, match="cannot supersede seq 9"):
        L.append_row(ledger_path, L.supersede_row(9, "no such row"))
    with pytest.raises(InvalidInput, match="supersedes"):
        L.append_row(ledger_path, {"kind": "supersede", "reason": "names nothing"})
    df = L.ledger_frame(ledger_path)
    assert df.loc[df["seq"] == 2, "superseded_by"].item() == 4
    summary = L.summarize_ledger(ledger_path)
    assert summary["runs"].tolist() == [2] and summary["pass"].tolist() == [2]


def test_append_refuses_to_extend_an_edited_head(paths, three):
    ledger_path, receipts_dir, _ = paths
    rows = lines(ledger_path)
    rows[2] = rows[2].replace(b'"verdict":"PASS"', b'"verdict":"FAIL"')
    ledger_path.write_bytes(b"".join(rows))
    with pytest.raises(InvalidInput, match=r"ledger.jsonl:3: last row \(seq 3\) does not match its row_hash"):
        append_measured(ledger_path, receipts_dir, seed=9)
    ledger_path.write_bytes(b"".join(lines(ledger_path)) + b'{"seq": 4')
    with pytest.raises(InvalidInput, match="partial row"):
        L.append_row(ledger_path, {"kind": "probe"})


def test_row_must_name_the_receipt_it_is_given(paths, three):
    ledger_path, receipts_dir, _ = paths
    other = next(receipts_dir.glob("*/*.json"))
    with pytest.raises(InvalidInput, match="row names receipt"):
        L.append_row(ledger_path, dict(L.row_from_receipt(json.loads(other.read_text())), receipt_id="a" * 64), receipt_path=other)


def _append_from_process(ledger_path: str, receipts_dir: str, seed: int, barrier) -> None:
    barrier.wait()
    append_measured(Path(ledger_path), Path(receipts_dir), seed)


def test_eight_processes_append_concurrently_without_loss(paths):
    ledger_path, receipts_dir, md = paths
    ctx = multiprocessing.get_context("fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn")
    barrier = ctx.Barrier(8)
    procs = [ctx.Process(target=_append_from_process, args=(str(ledger_path), str(receipts_dir), seed, barrier)) for seed in range(8)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    assert [p.exitcode for p in procs] == [0] * 8
    rows = L.read_rows(ledger_path)
    assert [r["seq"] for r in rows] == list(range(1, 9))
    assert len({r["receipt_id"] for r in rows}) == 8  # each process's row exactly once
    assert L.verify_ledger(ledger_path, receipts_dir) == []
    assert f"Head: seq 8 · row_hash `{rows[-1]['row_hash']}`" in md.read_text()


def test_default_markdown_path():
    assert L.default_markdown_path(Path("/r/evidence/parity/ledger.jsonl")) == Path("/r/LEDGER.md")
    assert L.default_markdown_path(Path("/tmp/x/ledger.jsonl")) == Path("/tmp/x/ledger.md")


def test_summary_and_report_only_proposals_wait_for_twenty_records(tmp_path):
    ledger_path = tmp_path / "ledger.jsonl"
    base = {"kind": "parity", "model": "m", "quant": "Q8_0", "candidate": "c 1", "reference": "llama.cpp b1",
            "positions": 100, "min_cosine": 0.999, "verdict": "PASS", "near_tie_flips": 1, "basis_kind": "declared"}
    for i in range(19):
        L.append_row(ledger_path, dict(base, argmax_agreement=0.95 + i / 1000, hard_flips=i % 3, kld_mean=1e-4 * (i + 1)))
    L.append_row(ledger_path, dict(base, verdict="FAIL", min_cosine=0.5, argmax_agreement=0.2, hard_flips=40, kld_mean=2.0))
    proposals = L.proposed_report_only_thresholds(L.ledger_frame(ledger_path))
    assert proposals == {"argmax_agreement": None, "kld_mean": None, "hard_flip_rate": None}  # 19 PASS rows

    L.append_row(ledger_path, dict(base, argmax_agreement=0.97, hard_flips=0, kld_mean=None))
    p = L.proposed_report_only_thresholds(L.ledger_frame(ledger_path))
    assert p["kld_mean"] is None  # 19 records hold a KLD
    a = p["argmax_agreement"]
    assert (a["value"], a["direction"], a["n"], a["seqs"]) == (0.95, "at least", 20, [1, 21])
    assert "Not applied" in a["basis"] and "20 standing PASS parity rows" in a["basis"]
    assert p["hard_flip_rate"]["value"] == pytest.approx(0.02)  # the FAIL row's 0.4 is not known-good

    s = L.summarize_ledger(ledger_path)
    assert len(s) == 1
    row = s.iloc[0]
    assert (row["runs"], row["pass"], row["fail"], row["last_seq"], row["last_verdict"]) == (21, 20, 1, 21, "PASS")
    assert row["min_cosine_worst"] == 0.5
    assert L.verify_ledger(ledger_path) == []


def test_rows_carry_their_runs_speed_shown_and_compared(paths):
    """Each row carries its own run's timings (also when an identical earlier run wrote the
    receipt), LEDGER.md shows the candidate's speed once rows have it, verify still passes, and
    ``summarize_ledger`` compares the last run's speed with the median."""
    from test_receipts import _timing

    ledger_path, receipts_dir, md = paths
    append_measured(ledger_path, receipts_dir, 0)  # a row from before timings existed
    first = [ln for ln in md.read_text().splitlines() if ln.startswith("| 1 |")][0]
    assert first.endswith("| — |")  # the speed column is always there (pages share one layout); a dash before timings
    receipt, arrays = make_receipt(seed=1)
    for wall, tps in ((9.0, 120.0), (10.0, 100.0), (20.0, 50.0)):
        from harness.evidence.record import record_evidence

        rec = record_evidence(dict(receipt, timings={"reference": _timing(3.0, 900.0), "candidate": _timing(wall, tps)}),
                              arrays, ledger_path)
        assert rec.row["candidate_tokens_per_s"] == tps and rec.row["candidate_wall_s"] == wall
    text = md.read_text()
    assert "candidate tok/s (wall s)" in text and "| 50 (20.0) |" in text and "| — |" in text
    assert L.verify_ledger(ledger_path, receipts_dir, md) == []
    s = L.summarize_ledger(ledger_path)
    row = s.iloc[0]
    assert row["runs"] == 4  # the row without timings does not count in the median
    assert row["candidate_tokens_per_s_last"] == 50.0 and row["candidate_tokens_per_s_median"] == 100.0
    assert row["candidate_speed_vs_median"] == 0.5 and row["candidate_wall_s_last"] == 20.0
