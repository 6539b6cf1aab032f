# Leasehold — every target does its own set-up on a fresh Debian machine and is idempotent.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.installed
SYSTEM_BINARIES := redis-server redis-cli redis-sentinel etcd etcdctl faketime iptables ip nginx prometheus promtool
APT_PACKAGES := redis-server redis-tools redis-sentinel etcd-server etcd-client faketime iptables iproute2 nginx prometheus
PYTEST_ARGS ?=

.PHONY: help setup system-deps venv run test test-unit test-integration test-e2e chaos chaos-short bench lint clean readme-tables policies

help:
	@echo "make run    - set everything up, start the local two-region topology, drive the live demo"
	@echo "make test   - set everything up and run the whole test suite (unit, integration, e2e, short chaos)"
	@echo "make bench  - benchmarks (ratios against Redis/etcd/peer ceilings measured in the same run)"
	@echo "make chaos  - the full chaos profile (long; not run by CI)"

setup: system-deps venv

system-deps:
	@missing=""; for b in $(SYSTEM_BINARIES); do command -v $$b >/dev/null 2>&1 || missing="$$missing $$b"; done; \
	if [ -n "$$missing" ]; then \
	  echo "installing system packages (missing:$$missing)"; \
	  SUDO=""; [ "$$(id -u)" = 0 ] || SUDO=sudo; \
	  $$SUDO env DEBIAN_FRONTEND=noninteractive apt-get update -qq && \
	  $$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $(APT_PACKAGES) >/dev/null; \
	fi

venv: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q -e '.[test]'
	@touch $(STAMP)

run: setup
	$(VENV)/bin/leasehold demo

test: setup
	$(PY) -m pytest -q -p no:cacheprovider $(PYTEST_ARGS)

test-unit: setup
	$(PY) -m pytest -q tests/unit $(PYTEST_ARGS)

test-integration: setup
	$(PY) -m pytest -q tests/integration $(PYTEST_ARGS)

test-e2e: setup
	$(PY) -m pytest -q tests/e2e $(PYTEST_ARGS)

chaos: setup
	$(PY) -m chaos run --profile full --seeds 3

chaos-short: setup
	$(PY) -m chaos run --profile short

BENCH_ARGS ?=
bench: setup
	@command -v redis-benchmark >/dev/null 2>&1 || { SUDO=""; [ "$$(id -u)" = 0 ] || SUDO=sudo; \
	  $$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-tools >/dev/null; }
	@[ $(VENV)/.bench-installed -nt pyproject.toml ] || { $(PIP) install -q -e '.[test,bench]' && touch $(VENV)/.bench-installed; }
	$(PY) -m leasehold.bench $(BENCH_ARGS)

# the sample bundles compiled from their sources, and the JSON Schemas (docs/schema/)
policies: setup
	$(PY) policies/build.py

readme-tables: setup
	$(PY) -m leasehold.readme_tables --write

lint: setup
	$(VENV)/bin/ruff check .

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis .run bench-results chaos-reports
