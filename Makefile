# Every target installs what it needs: uv (through pip) and the locked environment.
PYTHON ?= python3
UV := $(PYTHON) -m uv
RUN := $(UV) run --locked
# Every spawned rank imports torch; let Python cache its bytecode instead of recompiling
# torch's sources in each process (some environments set this variable).
unexport PYTHONDONTWRITEBYTECODE

.DEFAULT_GOAL := help
.PHONY: help env test bench bench-quick bench-gpu writeup doctor

help: ## list the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | sed -E 's/:.*## /\t/' | expand -t 16

env: ## install uv if missing and sync the locked environment into .venv
	@$(PYTHON) -m uv --version >/dev/null 2>&1 || $(PYTHON) -m pip install --quiet uv \
		|| $(PYTHON) -m pip install --quiet --user uv
	$(UV) sync --locked

test: env ## run every correctness test in parallel, then print the grade table
	$(RUN) pytest -n auto --dist loadgroup

bench: env ## CPU benchmarks with gloo on this machine (<15 min on 2 cores), then the writeup
	$(RUN) python scripts/run_benchmarks.py --suite cpu

bench-quick: env ## the bench path with minimal sizes (<3 min), into writeup/results/quick
	$(RUN) python scripts/run_benchmarks.py --suite quick

bench-gpu: env ## NCCL benchmarks at the handout's settings on a node with 1-6 GPUs, then the writeup
	$(RUN) python scripts/run_benchmarks.py --suite gpu

writeup: env ## render writeup/README.md and writeup/writeup.ipynb from writeup/results
	$(RUN) python scripts/make_writeup.py

doctor: env ## check a DDP job's set-up: check-in, step times, shards, parameter agreement, all-reduce o/w
	$(RUN) python scripts/doctor.py $(DOCTOR_ARGS)
