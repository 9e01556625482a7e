# Two commands on a fresh machine: `make train` and `make test`. Both build .venv first.
PYTHON ?= python3.11
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.installed
DATA   ?= data/synthetic_small
PYTEST_ARGS ?=

RUN_DIR ?= runs/make-train-$(shell date +%Y%m%d-%H%M%S)
NPROC ?= 2

.PHONY: venv redis-server train serve test test-all data data-tiny bench-quick clean

venv: $(STAMP)

$(STAMP): pyproject.toml Makefile
	@test -x $(PY) || $(PYTHON) -m venv $(VENV) || python3 -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	# torch first: its CPU wheel is pinned, so nothing later pulls a CUDA build.
	$(PIP) install --quiet torch==2.13.0 fbgemm-gpu-cpu==1.8.0
	$(PIP) install --quiet -e '.[test]'
	# torchrec's metadata asks for the CUDA fbgemm-gpu; its real requirements are in pyproject.
	$(PIP) install --quiet --no-deps torchrec==1.8.0
	@touch $(STAMP)

# redis-server backs the spill tier and the lookup service; tests start their own instances.
redis-server:
	@if command -v redis-server >/dev/null 2>&1; then :; \
	elif [ "$$(id -u)" = "0" ]; then \
		echo "installing redis-server from the OS packages"; \
		(apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server >/dev/null) \
		|| { echo "could not install redis-server"; exit 1; }; \
	else \
		echo "redis-server is missing; install it with: sudo apt-get install -y redis-server"; exit 1; \
	fi

# The default batch job: small synthetic data (generated once), 2 processes on CPU, then an
# evaluation of the final checkpoint printed next to the data's oracle AUC, and the run's
# report (curves as PNG and report.md in RUN_DIR/report).
train: venv data
	$(VENV)/bin/recsys train --config jobs/synthetic_small.toml --nproc $(NPROC) --run-dir $(RUN_DIR)
	$(VENV)/bin/recsys eval --checkpoint $(RUN_DIR) --oracle $(DATA)/oracle.json --json $(RUN_DIR)/eval.json
	$(VENV)/bin/recsys report $(RUN_DIR)
	@echo "run directory: $(RUN_DIR)"

# The lookup service's embedded default: serve the newest run's latest checkpoint from memory
# (no Redis). With no run yet, train the default job first. Stop it with Ctrl-C.
PORT ?= 8000
SERVE_RUN ?= $(shell ls -td runs/*/checkpoints/latest 2>/dev/null | head -1 | xargs -r dirname | xargs -r dirname)
serve: venv data
	@run="$(SERVE_RUN)"; \
	if [ -z "$$run" ]; then run=runs/make-serve; \
		$(VENV)/bin/recsys train --config jobs/synthetic_small.toml --nproc $(NPROC) --run-dir $$run || exit 1; fi; \
	echo "serving $$run/checkpoints/latest on http://127.0.0.1:$(PORT) (docs: /docs)"; \
	$(VENV)/bin/recsys serve --checkpoint $$run --port $(PORT)

test: venv redis-server
	$(PY) -m pytest -m "not slow" $(PYTEST_ARGS)

test-all: venv redis-server
	$(PY) -m pytest $(PYTEST_ARGS)

data: venv
	@if [ -f $(DATA)/oracle.json ]; then echo "$(DATA) exists"; \
	else $(VENV)/bin/recsys gen-synthetic --preset small --out $(DATA); fi

data-tiny: venv
	$(VENV)/bin/recsys gen-synthetic --preset tiny --out data/synthetic_tiny

bench-quick: venv
	$(VENV)/bin/recsys bench reader --quick --json bench-out/reader-quick.json

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
