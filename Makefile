# omnistage developer entry points. Everything installs itself on first use:
#   make demo   - local control plane + localnode + operator + two tiny CPU stages, with a hand-over
#   make test   - lint, generated-file checks and the whole test suite (what CI runs)
#   make images - the operator and worker images, built here with buildah (no daemon, no registry)
#   make images-vllm - the worker image's vLLM flavour (several GB more)
#   make e2e-node - a real kubelet + containerd node beside the local control plane, with the images
SHELL := /bin/bash
.SHELLFLAGS := -eu -o pipefail -c
PYTHON ?= python3
VENV ?= .venv
export OMNISTAGE_CACHE ?= $(HOME)/.cache/omnistage
BIN := $(VENV)/bin
PY := $(BIN)/python
PIP_CACHE := $(OMNISTAGE_CACHE)/pip
PYTEST_ARGS ?=
# The chart's templated CRDs (helm upgrade applies templates/, never crds/).
CHART_CRDS := charts/omnistage-operator/templates/crds

.PHONY: setup cluster-bin node-bin images images-ci images-vllm e2e-node generate check-generated lint test test-unit demo clean

setup: $(VENV)/.installed

# constraints.txt pins the versions the images install too (torch: the GPU host's).
$(VENV)/.installed: pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade --cache-dir $(PIP_CACHE) pip
	$(PY) -m pip install --cache-dir $(PIP_CACHE) --constraint constraints.txt -e '.[worker,operator,dev]'
	touch $@

# Builds (or reuses from $(OMNISTAGE_CACHE)) kube-apiserver, kube-scheduler,
# kube-controller-manager, kubectl, etcd and helm.
cluster-bin: setup
	$(PY) -m tests.cluster.build

# Builds (or reuses) the kubelet (same Kubernetes release), the NetworkPolicy enforcer
# (kube-network-policies), containerd 1.7 (CDI) and the simulated GPUs' DRA plugin for the
# real-node lane.
node-bin: setup
	$(PY) -m tests.cluster.build --node
	$(PY) -m tests.node.gotools

# The pause, operator and worker images (buildah; base made from Debian's packages; cached
# under $(OMNISTAGE_CACHE)/containers). Prints each image's build time and size. Needs root.
images: setup
	$(PY) -m tests.node.images

# What CI builds for the real-node tests it runs: the pause and operator images.
images-ci: setup
	$(PY) -m tests.node.images pause operator

# The worker image's vLLM flavour (worker_image/Dockerfile's "vllm" target, tagged
# <version>-vllm): vLLM and the dependencies it pins, several GB more than the worker image.
images-vllm: setup
	$(PY) -m tests.node.images vllm

# A real kubelet + containerd node beside the local control plane, running the built images.
e2e-node: setup cluster-bin node-bin images
	$(PY) -m pytest -m node tests/node $(PYTEST_ARGS)

generate: setup
	protos/generate.sh $(PY)
	mkdir -p $(CHART_CRDS)
	crds/chart-template.sh crds/omnistages.omnistage.io.yaml >$(CHART_CRDS)/omnistages.omnistage.io.yaml
	crds/chart-template.sh crds/omnipipelines.omnistage.io.yaml >$(CHART_CRDS)/omnipipelines.omnistage.io.yaml

check-generated: generate
	git diff --exit-code -- protos/gen $(CHART_CRDS) || \
	  { echo "generated files differ from a fresh generation: run 'make generate' and commit" >&2; exit 1; }
	test -z "$$(git status --porcelain -- protos/gen $(CHART_CRDS))" || \
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

# CI runs the real-node tests but the worker image's (its 5.5 GB build: make e2e-node runs it).
test: setup cluster-bin node-bin images-ci check-generated lint
	rc=0; $(PY) -m pytest -m "not worker_image" $(PYTEST_ARGS) || rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "pytest collected no tests: failing" >&2; exit 1; fi; exit $$rc

demo: setup cluster-bin
	$(PY) examples/local_demo.py

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache
