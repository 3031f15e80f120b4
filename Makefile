# omnistage developer entry points. Everything installs itself on first use:
#   make demo   - local control plane + localnode + operator + two tiny CPU stages, with a hand-over
#   make test   - lint, generated-file checks and the whole test suite (what CI runs)
SHELL := /bin/bash
.SHELLFLAGS := -eu -o pipefail -c
PYTHON ?= python3
VENV ?= .venv
export OMNISTAGE_CACHE ?= $(HOME)/.cache/omnistage
BIN := $(VENV)/bin
PY := $(BIN)/python
PIP_CACHE := $(OMNISTAGE_CACHE)/pip
PYTEST_ARGS ?=

.PHONY: setup cluster-bin generate check-generated lint test test-unit demo clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade --cache-dir $(PIP_CACHE) pip
	$(PY) -m pip install --cache-dir $(PIP_CACHE) -e '.[worker,operator,dev]'
	touch $@

# Builds (or reuses from $(OMNISTAGE_CACHE)) kube-apiserver, kube-scheduler,
# kube-controller-manager, kubectl, etcd and helm.
cluster-bin: setup
	$(PY) -m tests.cluster.build

generate: setup
	protos/generate.sh $(PY)
	mkdir -p charts/omnistage-operator/crds
	cp crds/omnistages.omnistage.io.yaml charts/omnistage-operator/crds/omnistages.omnistage.io.yaml

check-generated: generate
	git diff --exit-code -- protos/gen charts/omnistage-operator/crds || \
	  { echo "generated files differ from a fresh generation: run 'make generate' and commit" >&2; exit 1; }
	test -z "$$(git status --porcelain -- protos/gen charts/omnistage-operator/crds)" || \
	  { echo "untracked generated files: run 'make generate' and commit" >&2; exit 1; }

lint: setup cluster-bin
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy
	cd protos && ../$(BIN)/buf lint
	$$($(PY) -m tests.cluster.build --print-bin helm) lint --strict charts/omnistage-operator
	$(BIN)/hadolint operator/Dockerfile worker_image/Dockerfile

test-unit: setup
	$(PY) -m pytest tests/unit $(PYTEST_ARGS)

test: setup cluster-bin check-generated lint
	rc=0; $(PY) -m pytest $(PYTEST_ARGS) || rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "pytest collected no tests: failing" >&2; exit 1; fi; exit $$rc

demo: setup cluster-bin
	$(PY) examples/local_demo.py

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache
