# Leasehold — every target does its own set-up on a fresh Debian machine and is idempotent.
# System packages come from apt (as root, or through sudo); Python packages go into .venv at the
# exact versions of constraints.txt (the versions the tests ran with).
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
# the interpreter the venv is made from: the distribution's python3 (Debian builds it with
# profile-guided and link-time optimisation, as the image's python:3.11 is built), not whichever
# python3 comes first on PATH: a pyenv or hand-built CPython without --enable-optimizations runs
# the services' own Python 30-40 % slower. PYTHON=... picks another one. Why:
# docs/decisions/0088-the-venv-is-made-from-the-distributions-optimised-python.md
PYTHON ?= $(firstword $(wildcard /usr/bin/python3) python3)
PIP := $(VENV)/bin/pip
CONSTRAINTS := constraints.txt
# what `make run` needs: the services' own servers, the venv, openssl (TLS helpers of leasehold up),
# curl and jq (the README's examples)
RUN_BINARIES := redis-server redis-cli etcd etcdctl openssl curl jq
RUN_PACKAGES := redis-server redis-tools etcd-server etcd-client openssl python3-venv curl jq
# what `make test` needs besides: redis-sentinel (the Sentinel failover tests), fault injection
# (faketime, iptables, ip), nginx (a gateway under test), docker-compose (validates
# deploy/docker-compose.yml; no container engine needed), prometheus and promtool (the shipped
# scrape config and alert rules, run for real)
TEST_BINARIES := $(RUN_BINARIES) redis-sentinel faketime iptables ip nginx docker-compose prometheus promtool wrk
TEST_PACKAGES := $(RUN_PACKAGES) redis-sentinel faketime iptables iproute2 nginx docker-compose prometheus wrk
PYTEST_ARGS ?=
# make test runs the suite's files on this many pytest-xdist workers, each file whole on one worker
# and in the order they are collected (chaos, e2e, integration, unit: the long files first, the short
# unit files fill the end); TEST_WORKERS=0 runs it in this one process (docs/testing.md); the
# 25 slowest tests are listed at the end of every run
TEST_WORKERS ?= 2

.PHONY: help setup setup-run system-deps-run system-deps venv-demo venv-test run test test-unit \
        test-integration test-e2e fuzz chaos chaos-short bench lint clean doc-tables constraints policies

help:
	@echo "make run    - set up what the demo needs, start the local two-region topology, drive the live demo"
	@echo "make test   - set up everything and run the whole test suite (about 25 minutes on 2 cores)"
	@echo "make bench  - benchmarks (ratios against Redis/etcd/peer ceilings measured in the same run)"
	@echo "make chaos  - the full chaos profile (long; not run by CI)"
	@echo "make fuzz   - the schema fuzz at its full size (long; make test runs a smaller profile)"

# apt-get as root, else through sudo; otherwise say exactly what to install and stop
define apt_install
@missing=""; for b in $(1); do command -v $$b >/dev/null 2>&1 || missing="$$missing $$b"; done; \
$(PYTHON) -c 'import ensurepip, venv' >/dev/null 2>&1 || missing="$$missing python3-venv"; \
if [ -n "$$missing" ]; then \
  echo "installing system packages (missing:$$missing)"; \
  if [ "$$(id -u)" = 0 ]; then SUDO=""; \
  elif command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then SUDO="sudo -n"; \
  else echo "make needs these Debian packages: $(2)" >&2; \
       echo "run make as root or with password-less sudo, or install them first: apt-get install $(2)" >&2; \
       exit 1; fi; \
  $$SUDO env DEBIAN_FRONTEND=noninteractive apt-get update -qq && \
  $$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $(2) >/dev/null; \
fi
endef

system-deps-run:
	$(call apt_install,$(RUN_BINARIES),$(RUN_PACKAGES))

system-deps:
	$(call apt_install,$(TEST_BINARIES),$(TEST_PACKAGES))

# the checkout's root on the venv's path: chaos/, devtools/ and bench are not in the
# wheel (nor in its editable mapping) but run from here
define venv_base
@test -x $(PY) || $(PYTHON) -m venv $(VENV)
@echo "$(CURDIR)" > "$$($(PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/leasehold-checkout.pth"
endef

# xds-protos ships its own, older copy of opentelemetry/proto/*: whichever of it and
# opentelemetry-proto pip installs last wins, and with xds-protos' copy the OTLP exporter cannot
# import (tracing on fails at start). opentelemetry-proto's files are put back last.
define otel_proto_last
$(PIP) install -q -c $(CONSTRAINTS) --no-deps --force-reinstall opentelemetry-proto
endef

venv-demo: $(VENV)/.installed-demo
$(VENV)/.installed-demo: pyproject.toml $(CONSTRAINTS)
	$(venv_base)
	$(PIP) install -q -c $(CONSTRAINTS) -e '.[demo]'
	$(otel_proto_last)
	@touch $@

venv-test: $(VENV)/.installed-test
$(VENV)/.installed-test: pyproject.toml $(CONSTRAINTS)
	$(venv_base)
	$(PIP) install -q -c $(CONSTRAINTS) -e '.[test]'
	$(otel_proto_last)
	@touch $@ $(VENV)/.installed-demo

setup-run: system-deps-run venv-demo

setup: system-deps venv-test

run: setup-run
	$(VENV)/bin/leasehold demo

test: setup
	$(PY) -m pytest -q -p no:cacheprovider -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=25 $(PYTEST_ARGS)

test-unit: setup
	$(PY) -m pytest -q tests/unit $(PYTEST_ARGS)

test-integration: setup
	$(PY) -m pytest -q tests/integration $(PYTEST_ARGS)

test-e2e: setup
	$(PY) -m pytest -q tests/e2e $(PYTEST_ARGS)

# the schema fuzz at its full size (>= 2,000 requests per service; make test runs >= 400)
fuzz: setup
	FUZZ_PROFILE=full $(PY) -m pytest -q -p no:cacheprovider tests/integration/security/test_fuzz.py $(PYTEST_ARGS)

chaos: setup
	$(PY) -m chaos run --profile full --seeds 3

chaos-short: setup
	$(PY) -m chaos run --profile short

BENCH_ARGS ?=
bench: setup
	$(call apt_install,redis-benchmark wrk,redis-tools wrk)
	@[ $(VENV)/.bench-installed -nt $(CONSTRAINTS) ] || { $(PIP) install -q -c $(CONSTRAINTS) -e '.[test,bench]' && touch $(VENV)/.bench-installed; }
	$(PY) -m bench $(BENCH_ARGS)

doc-tables: setup
	$(PY) -m devtools.doc_tables --write

# rewrite constraints.txt from this venv after a deliberate upgrade (then run make test)
constraints: setup
	@[ $(VENV)/.bench-installed -nt $(CONSTRAINTS) ] || $(PIP) install -q -e '.[test,bench]'
	$(PY) -m devtools.constraints --write

# the sample bundles compiled from their sources, and the JSON Schemas (docs/schema/)
policies: setup
	$(PY) policies/build.py

lint: setup
	$(VENV)/bin/ruff check .
	$(PY) -m mypy

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .hypothesis .run bench-results chaos-reports
