"""Train small Qwen3.5 models on real text so the harness has real-behaving inputs.

Random-weight fixtures are fine for shapes and plumbing, but their next-token distributions are
flat and fragile (a 0.1 % weight perturbation already moves logit cosine to 0.90), so any
threshold measured on them means nothing. A model trained on real text is peaked and stable like
a real one. No weights can be downloaded here, so the project trains its own:

- corpus: the installed Python standard library's top-level ``*.py`` files (present on every
  machine), sorted by name; every ``HELDOUT_EVERY``-th file is held out. The list's hash (names
  and contents) goes into the recipe, with the Python version that supplied it;
- tokens: exactly the ids llama.cpp produces with the fixtures' own vocabulary (every fixture
  shares it), so every token the reference can emit has a trained embedding;
- model: transformers ``Qwen3_5ForCausalLM`` / ``Qwen3_5MoeForCausalLM`` on CPU (torch, 2
  threads), AdamW with warmup and cosine decay, random windows of ``seq_len`` tokens;
- output: ``harness/data/fixtures/NAME.gguf`` via ``harness.convert`` and ``NAME.recipe.json``
  (corpus hash, versions, seed, steps, losses, held-out mean top-1 probability, sha256).

Needs the ``hf`` extra (``pip install -e .[hf]``); nothing else in the harness imports this.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import sysconfig
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from harness.errors import InvalidInput

HELDOUT_EVERY = 10  # file i is held out when i % HELDOUT_EVERY == HELDOUT_EVERY // 2
RECIPE_SCHEMA = "harness-trained-fixture-recipe/v1"


@dataclass(frozen=True)
class TrainSpec:
    """Everything that determines a trained fixture (besides the corpus and library versions).

    Sizes are element counts. DeltaNet: ``ssm_n_group`` key heads (n_k) < ``ssm_dt_rank`` value
    heads (n_v), head size ``ssm_d_state`` for both k and v. ``n_expert`` > 0 makes a qwen35moe.
    ``heldout_tokens`` caps the held-out evaluation. ``out_type`` is the GGUF's type (F32, F16).
    """

    name: str
    description: str
    seed: int = 0
    steps: int = 800
    n_embd: int = 96
    n_layer: int = 8
    n_ff: int = 256
    n_head: int = 4
    n_head_kv: int = 2
    head_dim: int = 32
    partial_rotary_factor: float = 0.25
    mrope_section: tuple[int, int, int] = (2, 1, 1)
    rope_theta: float = 10_000_000.0
    rms_eps: float = 1e-6
    full_attention_interval: int = 4
    ssm_n_group: int = 2
    ssm_dt_rank: int = 4
    ssm_d_state: int = 32
    ssm_d_conv: int = 4
    n_expert: int = 0
    n_expert_used: int = 0
    n_ff_exp: int = 0
    n_ff_shexp: int = 0
    router_aux_loss_coef: float = 0.01
    batch_size: int = 8
    seq_len: int = 256
    lr: float = 3e-3
    warmup: int = 50
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    heldout_tokens: int = 65_536
    out_type: str = "F32"
    threads: int = 2
    context_length: int = 4096

    @property
    def arch(self) -> str:
        return "qwen35moe" if self.n_expert else "qwen35"

    def config(self, n_vocab: int) -> dict[str, Any]:
        """transformers text-config kwargs (with ``model_type``) for a vocabulary of ``n_vocab``."""
        cfg: dict[str, Any] = {
            "model_type": "qwen3_5_moe_text" if self.n_expert else "qwen3_5_text",
            "vocab_size": n_vocab,
            "hidden_size": self.n_embd,
            "num_hidden_layers": self.n_layer,
            "num_attention_heads": self.n_head,
            "num_key_value_heads": self.n_head_kv,
            "head_dim": self.head_dim,
            "rms_norm_eps": self.rms_eps,
            "max_position_embeddings": self.context_length,
            "tie_word_embeddings": False,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": self.rope_theta,
                "partial_rotary_factor": self.partial_rotary_factor,
                "mrope_section": list(self.mrope_section),
                "mrope_interleaved": True,
            },
            "linear_conv_kernel_dim": self.ssm_d_conv,
            "linear_key_head_dim": self.ssm_d_state,
            "linear_value_head_dim": self.ssm_d_state,
            "linear_num_key_heads": self.ssm_n_group,
            "linear_num_value_heads": self.ssm_dt_rank,
            "layer_types": [
                "full_attention" if (i + 1) % self.full_attention_interval == 0 else "linear_attention"
                for i in range(self.n_layer)
            ],
        }
        if self.n_expert:
            cfg.update(
                num_experts=self.n_expert,
                num_experts_per_tok=self.n_expert_used,
                moe_intermediate_size=self.n_ff_exp,
                shared_expert_intermediate_size=self.n_ff_shexp,
                router_aux_loss_coef=self.router_aux_loss_coef,
            )
        else:
            cfg["intermediate_size"] = self.n_ff
        return cfg


def _specs() -> dict[str, TrainSpec]:
    dense = TrainSpec(
        name="trained-qwen35",
        description=(
            "qwen35 trained on Python stdlib source: 8 layers (full attention at 3, 7), d 96, ff 256, "
            "4/2 heads x 32, DeltaNet n_k 2 < n_v 4 x 32, F32"
        ),
        seed=1,
    )
    moe = replace(
        dense,
        name="trained-qwen35moe",
        description=(
            "qwen35moe trained on Python stdlib source: the trained-qwen35 trunk with MoE FFN "
            "(4 experts x 64, 2 used, gated shared expert 64), F32"
        ),
        seed=2,
        n_expert=4,
        n_expert_used=2,
        n_ff_exp=64,
        n_ff_shexp=64,
    )
    k256 = replace(
        dense,
        name="trained-qwen35-256",
        description=(
            "qwen35 trained on Python stdlib source with every matmul input width a multiple of 256 "
            "(d 256, ff 512, 4 heads x 64, DeltaNet 4 v heads x 64) so K-quants apply: 4 layers "
            "(full attention at 3), F16"
        ),
        seed=3,
        steps=600,
        n_embd=256,
        n_layer=4,
        n_ff=512,
        head_dim=64,
        mrope_section=(4, 2, 2),
        ssm_d_state=64,
        out_type="F16",
    )
    return {s.name: s for s in (dense, moe, k256)}


SPECS: dict[str, TrainSpec] = _specs()
DEFAULT_FOR_ARCH = {"qwen35": "trained-qwen35", "qwen35moe": "trained-qwen35moe"}


# ---------------------------------------------------------------------------------------------
# Corpus
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Corpus:
    """The stdlib corpus split by file: train and held-out texts, the file list and its hash."""

    root: Path
    train_files: list[str]
    heldout_files: list[str]
    train_text: str
    heldout_text: str
    sha256: str


def stdlib_corpus() -> Corpus:
    """Top-level ``*.py`` files of the running Python's standard library, sorted by name.

    File i is held out when ``i % HELDOUT_EVERY == HELDOUT_EVERY // 2``. ``sha256`` covers every
    file's relative name and the sha256 of its bytes, in order, so it changes with the Python
    version. Files are joined with a blank line. Raises ``InvalidInput`` when none are found.
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(root.glob("*.py"), key=lambda p: p.name)
    if not files:
        raise InvalidInput(f"no *.py files under the standard library path {root}")
    h = hashlib.sha256()
    train, held, train_names, held_names = [], [], [], []
    for i, p in enumerate(files):
        data = p.read_bytes()
        h.update(p.name.encode() + b"\0" + hashlib.sha256(data).hexdigest().encode() + b"\n")
        text = data.decode("utf-8", errors="replace")
        if i % HELDOUT_EVERY == HELDOUT_EVERY // 2:
            held.append(text)
            held_names.append(p.name)
        else:
            train.append(text)
            train_names.append(p.name)
    return Corpus(root, train_names, held_names, "\n\n".join(train), "\n\n".join(held), h.hexdigest())


def tokenize(text: str) -> np.ndarray:
    """Token ids (int64 [N]) of ``text`` by llama.cpp with the fixtures' vocabulary (no BOS,
    specials not parsed). Raises ``EngineError`` if the llama.cpp worker fails."""
    from harness.engines.llamacpp import LlamaCppEngine
    from harness.fixtures import build

    return np.asarray(LlamaCppEngine(build("tiny-qwen35")).tokenize(text), dtype=np.int64)


# ---------------------------------------------------------------------------------------------
# Training and evaluation
# ---------------------------------------------------------------------------------------------
def _import_torch():
    try:
        import torch
        import transformers  # noqa: F401
    except ImportError:
        raise InvalidInput("training needs torch and transformers: pip install -e .[hf]") from None
    return torch


def _lr_at(step: int, spec: TrainSpec) -> float:
    """Linear warmup over ``warmup`` steps, then cosine decay to 10 % of ``lr``."""
    if step < spec.warmup:
        return spec.lr * (step + 1) / spec.warmup
    frac = (step - spec.warmup) / max(1, spec.steps - spec.warmup)
    return spec.lr * (0.1 + 0.9 * 0.5 * (1 + np.cos(np.pi * frac)))


def evaluate(model: Any, tokens: np.ndarray, seq_len: int, max_tokens: int) -> dict[str, float]:
    """Held-out next-token loss and confidence of ``model`` over consecutive windows.

    ``tokens`` int64 [N]; windows of ``seq_len + 1`` tokens, each scored from its own start
    (no carried state), up to ``max_tokens`` scored positions. Returns ``loss`` (mean nats per
    token), ``n`` (positions scored), ``mean_top1_prob`` (mean over positions of the largest
    next-token probability) and ``top1_accuracy``.
    """
    torch = _import_torch()
    total = 0.0
    n = 0
    top1 = 0.0
    hits = 0
    model.eval()
    with torch.no_grad():
        for start in range(0, len(tokens) - seq_len - 1, seq_len):
            if n >= max_tokens:
                break
            w = torch.from_numpy(tokens[start : start + seq_len + 1]).unsqueeze(0)
            logits = model(input_ids=w[:, :-1]).logits[0].double()
            logp = torch.log_softmax(logits, dim=-1)
            target = w[0, 1:]
            total += float(-logp.gather(1, target[:, None]).sum())
            p = logp.exp()
            top1 += float(p.max(dim=-1).values.sum())
            hits += int((logits.argmax(-1) == target).sum())
            n += seq_len
    return {"loss": total / n, "n": n, "mean_top1_prob": top1 / n, "top1_accuracy": hits / n}


def _versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {"python": platform.python_version()}
    for pkg in ("torch", "transformers", "gguf", "llama-cpp-python", "numpy"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            out[pkg] = "absent"
    return out


def train_spec(spec: TrainSpec, out_dir: str | os.PathLike | None = None, log: Any = print) -> dict[str, Any]:
    """Train ``spec`` on the stdlib corpus, write ``NAME.gguf`` and ``NAME.recipe.json`` into
    ``out_dir`` (default ``harness/data/fixtures``), and return the recipe dict.

    Deterministic for a given spec, corpus and library versions on one machine (seeded torch,
    ``spec.threads`` CPU threads). Raises ``InvalidInput`` without the ``hf`` extra.
    """
    torch = _import_torch()
    from harness import convert
    from harness.fixtures import TRAINED_DIR, build_vocab, sha256_of

    torch.set_num_threads(spec.threads)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    out = Path(out_dir) if out_dir is not None else TRAINED_DIR
    corpus = stdlib_corpus()
    t0 = time.time()
    train_ids = tokenize(corpus.train_text)
    held_ids = tokenize(corpus.heldout_text)
    log(f"{spec.name}: corpus {len(corpus.train_files)}+{len(corpus.heldout_files)} files, "
        f"{len(train_ids)} train / {len(held_ids)} held-out tokens ({time.time() - t0:.0f} s)")
    n_vocab = len(build_vocab()[0])

    torch.manual_seed(spec.seed)
    cfg = spec.config(n_vocab)
    config = convert.transformers_config(cfg)
    model = convert.causal_lm_class(cfg)(config)
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        (no_decay if p.ndim < 2 or "norm" in name else decay).append(p)
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": spec.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=spec.lr, betas=(0.9, 0.95),
    )
    gen = torch.Generator().manual_seed(spec.seed)
    data = torch.from_numpy(train_ids)
    moe = bool(spec.n_expert)
    losses: list[float] = []
    t_train = time.time()
    model.train()
    for step in range(spec.steps):
        for group in opt.param_groups:
            group["lr"] = _lr_at(step, spec)
        starts = torch.randint(0, len(data) - spec.seq_len - 1, (spec.batch_size,), generator=gen)
        batch = torch.stack([data[s : s + spec.seq_len + 1] for s in starts.tolist()])
        outp = model(input_ids=batch[:, :-1], output_router_logits=True) if moe else model(input_ids=batch[:, :-1])
        loss = torch.nn.functional.cross_entropy(outp.logits.flatten(0, 1), batch[:, 1:].flatten())
        if moe:  # load balancing keeps every expert in use, so routing faults show in the logits
            loss_total = loss + spec.router_aux_loss_coef * outp.aux_loss
        else:
            loss_total = loss
        opt.zero_grad(set_to_none=True)
        loss_total.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), spec.grad_clip)
        opt.step()
        losses.append(loss.item())
        if step % 50 == 0 or step == spec.steps - 1:
            log(f"{spec.name}: step {step} loss {losses[-1]:.4f} ({time.time() - t_train:.0f} s)")
    train_seconds = time.time() - t_train

    ev = evaluate(model, held_ids, spec.seq_len, spec.heldout_tokens)
    held_bytes_per_token = len(corpus.heldout_text.encode("utf-8")) / len(held_ids)
    log(f"{spec.name}: held-out loss {ev['loss']:.4f} nats/token, top-1 prob {ev['mean_top1_prob']:.3f}")

    out.mkdir(parents=True, exist_ok=True)
    gguf_path = out / f"{spec.name}.gguf"
    convert.hf_to_gguf(config, model.state_dict(), gguf_path, name=spec.name, out_type=spec.out_type)
    recipe = {
        "schema": RECIPE_SCHEMA,
        "name": spec.name,
        "description": spec.description,
        "arch": spec.arch,
        "quant": spec.out_type,
        "seed": spec.seed,
        "steps": spec.steps,
        "spec": asdict(spec),
        "corpus": {
            "source": "Python standard library, top-level *.py files sorted by name (sysconfig stdlib path)",
            "heldout_rule": f"file i held out when i % {HELDOUT_EVERY} == {HELDOUT_EVERY // 2}",
            "files_sha256": corpus.sha256,
            "python_version": platform.python_version(),
            "n_train_files": len(corpus.train_files),
            "n_heldout_files": len(corpus.heldout_files),
            "heldout_files": corpus.heldout_files,
            "train_tokens": int(len(train_ids)),
            "heldout_tokens": int(len(held_ids)),
            "tokenizer": "llama.cpp with the fixtures' byte-level BPE vocabulary (harness.fixtures.build_vocab)",
        },
        "versions": _versions(),
        "threads": spec.threads,
        "training_seconds": round(train_seconds, 1),
        "results": {
            "final_train_loss": float(np.mean(losses[-20:])),
            "heldout_loss_nats_per_token": ev["loss"],
            "heldout_loss_nats_per_byte": ev["loss"] / held_bytes_per_token,
            "heldout_mean_top1_prob": ev["mean_top1_prob"],
            "heldout_top1_accuracy": ev["top1_accuracy"],
            "heldout_positions": ev["n"],
        },
        "gguf_sha256": sha256_of(gguf_path),
        "gguf_bytes": gguf_path.stat().st_size,
    }
    recipe_path = out / f"{spec.name}.recipe.json"
    tmp = recipe_path.with_name(f".{recipe_path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(recipe, indent=2) + "\n")
    os.replace(tmp, recipe_path)
    return recipe


def train(
    arch: str | None = None,
    steps: int | None = None,
    seed: int | None = None,
    out_dir: str | os.PathLike | None = None,
    name: str | None = None,
    log: Any = print,
    **sizes: Any,
) -> dict[str, Any]:
    """Train the fixture ``name`` (default: ``trained-qwen35`` or ``trained-qwen35moe`` by
    ``arch``, itself defaulting to qwen35) with optional ``steps``, ``seed`` and size overrides
    (``TrainSpec`` fields such as ``n_embd``), writing it to ``out_dir``. Returns the recipe.

    Raises ``InvalidInput`` for an unknown name, arch or option, or an arch the spec is not.
    """
    if name is None:
        if (arch or "qwen35") not in DEFAULT_FOR_ARCH:
            raise InvalidInput(f"unknown arch {arch!r}; use one of {', '.join(DEFAULT_FOR_ARCH)}")
        name = DEFAULT_FOR_ARCH[arch or "qwen35"]
    if name not in SPECS:
        raise InvalidInput(f"unknown trained fixture {name!r}; known: {', '.join(SPECS)}")
    changes = {k: v for k, v in {"steps": steps, "seed": seed, **sizes}.items() if v is not None}
    try:
        spec = replace(SPECS[name], **changes)
    except TypeError as e:
        raise InvalidInput(f"bad training option: {e}") from None
    if arch is not None and spec.arch != arch:
        raise InvalidInput(f"{name} is a {spec.arch} model, not {arch}")
    return train_spec(spec, out_dir, log)


def read_recipe(gguf_path: str | os.PathLike) -> dict[str, Any]:
    """The recipe committed next to a trained fixture (``NAME.recipe.json``); ``InvalidInput``
    when it is missing or not JSON."""
    p = Path(gguf_path).with_suffix(".recipe.json")
    try:
        return json.loads(p.read_text())
    except (OSError, ValueError) as e:
        raise InvalidInput(f"{p}: cannot read recipe ({e})") from None
