# Two commands on a fresh machine: `make train` and `make test`. Both build .venv first.
PYTHON ?= python3.11
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.installed
DATA   ?= data/synthetic_small
PYTEST_ARGS ?= --durations=25

RUN_DIR ?= runs/make-train-$(shell date +%Y%m%d-%H%M%S)
# Two processes by default (one on a one-core host): the data-parallel trainer with the
# sharded store, whose ranks on one host exchange through shared memory, trains a 2-core host
# faster than one process of 2 threads (BENCHMARKS.md, "Trainer": 2 processes vs 1; the default
# job's `recsys train` alone: README). The job's batch is per process: NPROC=1 trains 2048 rows a step.
NPROC ?= $(shell [ "$$(nproc 2>/dev/null || echo 1)" -ge 2 ] && echo 2 || echo 1)

.PHONY: venv venv-cuda redis-server train serve test test-slow test-all data data-tiny bench-quick gpu-wheels gpu-check clean

venv: $(STAMP)

$(STAMP): pyproject.toml Makefile
	@test -x $(PY) || $(PYTHON) -m venv $(VENV) || python3 -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	# torch first: its CPU wheel is pinned, so nothing later pulls a CUDA build.
	$(PIP) install --quiet torch==2.13.0 fbgemm-gpu-cpu==1.8.0
	$(PIP) install --quiet -e '.[test,bench,cpu]'
	# torchrec's metadata asks for the CUDA fbgemm-gpu; its real requirements are in pyproject.
	$(PIP) install --quiet --no-deps torchrec==1.8.0
	# ISLP ships Bikeshare.csv, `recsys bench quality`'s bikeshare set; only the file is read
	# (never imported), so none of its requirements (lightning, pygam, ...) is installed and
	# it is not in the bench extra.
	$(PIP) install --quiet --no-deps islp==0.6.0
	@touch $(STAMP)

# The CUDA environment, on a machine with NVIDIA's driver: torch's CUDA build, the CUDA
# fbgemm-gpu instead of fbgemm-gpu-cpu, torchrec. The first install reads no pip config file
# and no PIP_FIND_LINKS, so a CPU wheel of the same torch version lying in a local wheel
# folder (e.g. a find-links of the machine's config) is not taken instead.
VENV_CUDA := .venv-cuda
venv-cuda: $(VENV_CUDA)/.installed

$(VENV_CUDA)/.installed: pyproject.toml Makefile
	@test -x $(VENV_CUDA)/bin/python || $(PYTHON) -m venv $(VENV_CUDA) || python3 -m venv $(VENV_CUDA)
	$(VENV_CUDA)/bin/python -m pip install --quiet --upgrade pip
	PIP_CONFIG_FILE=/dev/null PIP_FIND_LINKS= $(VENV_CUDA)/bin/python -m pip install --quiet torch==2.13.0 fbgemm-gpu==1.8.0
	$(VENV_CUDA)/bin/python -m pip install --quiet -e '.[test,bench,cuda]'
	$(VENV_CUDA)/bin/python -m pip install --quiet --no-deps torchrec==1.8.0
	$(VENV_CUDA)/bin/python scripts/check_cuda_env.py
	@touch $@

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

# The default batch job: small synthetic data (generated once), NPROC processes on CPU, then an
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

# The tests marked slow (long fault and elastic runs, the quick benches end to end): what
# `make test` leaves out; CI (.ci/run) runs both. `make test-all` is both in one pytest.
test-slow: venv redis-server
	$(PY) -m pytest -m slow $(PYTEST_ARGS)

test-all: venv redis-server
	$(PY) -m pytest $(PYTEST_ARGS)

data: venv
	@if [ -f $(DATA)/oracle.json ]; then echo "$(DATA) exists"; \
	else $(VENV)/bin/recsys gen-synthetic --preset small --out $(DATA); fi

data-tiny: venv
	$(VENV)/bin/recsys gen-synthetic --preset tiny --out data/synthetic_tiny

bench-quick: venv
	$(VENV)/bin/recsys bench reader --quick --json bench-out/reader-quick.json

# A GPU machine without network (docs/gpu.md): the wheels its image lacks, for its Python
# (GPU_PY, default 3.12), fetched here into .whl/; `make gpu-check` there installs them.
GPU_PY ?= 3.12
# (pytest, hypothesis, psutil, tqdm... are in the image; a second pytest there would shadow its plugins)
GPU_WHEELS := torchrec==1.6.1 fbgemm-gpu-cpu==1.6.0 tensordict==0.12.1 iopath redis==5.2.1 hiredis orjson \
	pyvers importlib_metadata tomli-w
gpu-wheels: venv
	$(PIP) download --quiet --no-deps --only-binary=:all: --python-version $(GPU_PY) --implementation cp \
		--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
		-d .whl $(GPU_WHEELS)
	@ls .whl | wc -l | xargs echo "wheels in .whl:"

# On a GPU machine: the cuda tests, one epoch of the default job with --device cuda and its
# evaluation on both devices, the quick GPU training bench; one summary (gpu-check-out/).
# Runs on the machine's own python and torch (GPU_PYTHON), not a venv. GPU_CHECK_ARGS: e.g.
# "--bench full --budget 400" (the full bench on the epoch's data; stop every step by 400 s).
GPU_PYTHON ?= python3
GPU_CHECK_ARGS ?=
gpu-check:
	$(GPU_PYTHON) scripts/gpu_check.py $(GPU_CHECK_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
