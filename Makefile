# Setup and entry points. Every target creates its own virtual environment (.venv) first.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp

.PHONY: setup scripted-fixture llama-server llama-tools test-llama-server run test test-slow test-release-slow parity-tests bench bench-evidence bench-serving fuzz clean

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e ".[server,test]"
	touch $(STAMP)

setup: $(STAMP)

## retrain the committed scripted fixture (harness/data/fixtures/scripted/: greedy output = each
## chat script's text; harness.fixtures.scripted), about a minute on one core; needs the hf extra
scripted-fixture: setup
	nice $(PY) -m harness.fixtures.scripted

## llama.cpp's own llama-server (and LLAMA_TARGETS="llama-server llama-quantize llama-imatrix
## llama-perplexity" for the other tools, same build dir) from the installed llama-cpp-python's
## vendored llama.cpp, cached by its commit in ~/.cache/qwen35-harness/llama.cpp-<commit>/ (outside
## the checkout): about 14 minutes on 2 cores the first time, a no-op after (scripts/build_llama_server.sh)
LLAMA_TARGETS ?= llama-server
llama-server: setup
	LLAMA_TARGETS="$(LLAMA_TARGETS)" nice scripts/build_llama_server.sh $(PY)

## all four of llama.cpp's tools the tests use (the real-server tests, the low-bit fixtures), in
## one build: what `make test` builds first (a no-op when cached)
LLAMA_TOOLS := llama-server llama-quantize llama-imatrix llama-perplexity
llama-tools: setup
	LLAMA_TARGETS="$(LLAMA_TOOLS)" nice scripts/build_llama_server.sh $(PY)

## the real llama-server under concurrent clients (issue 51's acceptance: every shipped scenario at
## --parallel 4 and 1 on fixture:trained-qwen35, and llama.cpp #29092 on one slot); a few minutes
test-llama-server: llama-server
	$(PY) -m pytest -q -s -m slow tests/test_llama_server_traffic.py

## the main job on its built-in default: oracle vs llama.cpp on the default model and prompts.
## Its receipt, ledger row, LEDGER.md and report go to out/run/ (git-ignored): the evidence
## committed in evidence/ and LEDGER.md is the project's own record and changes only by a commit,
## so a clone stays clean and later receipts do not record "(uncommitted changes)".
RUN_LEDGER ?= out/run/evidence/parity/ledger.jsonl
run: setup
	$(VENV)/bin/harness parity --ledger $(RUN_LEDGER)

## the test suite (what CI runs): llama.cpp's tools (built once, cached), the layers contract
## (import-linter, pyproject.toml), then pytest
test: setup llama-tools
	$(VENV)/bin/lint-imports --no-cache
	$(PY) -m pytest -q

## slow tests kept out of the default run
test-slow: setup
	$(PY) -m pytest -q -m slow

## the release acceptance run (2 models x 2 candidates, BLOCKED -> sweep -> SIGNED) through the
## local executor and a local Ray instance (installs the dist extra: Ray); a few minutes
test-release-slow: setup
	$(PY) -m pip install -q -e '.[dist]'
	$(PY) -m pytest -q -m slow tests/test_release.py

parity-tests: setup
	$(PY) -m pytest -q -m parity

## the benchmark suite (heavy: tens of minutes, several GB; not CI): writes docs/benchmarks.md
bench: setup
	$(PY) benchmarks/run_all.py

## section 7 of the benchmarks alone (evidence at scale: ledgers of 10, 10,000 and 100,000 rows;
## minutes, about 5 GB of temporary files): rewrites only that section of docs/benchmarks.md
bench-evidence: setup
	$(PY) benchmarks/run_all.py --only evidence

## section 10 alone (the serving probe's cost: concurrency 1 to 7, histories 1K, 4K and 16K; minutes):
## rewrites only that section of docs/benchmarks.md
bench-serving: setup
	$(PY) benchmarks/run_all.py --only serving

## a longer, randomly seeded fuzzing campaign (the default suite runs a few fixed-seed examples per
## target): GGUF reader + lint, thresholds and contract loaders, the engine-output reader, the prompt
## loader, and every hostile-input strategy of tests/test_hostile.py
fuzz: setup
	HARNESS_FUZZ_EXAMPLES=2000 HARNESS_FUZZ_RANDOM=1 $(PY) -m pytest -q -p no:cacheprovider tests/test_fuzz.py tests/test_hostile.py

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
