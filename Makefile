# Every target installs what it needs: uv (through pip) and the locked environment.
PYTHON ?= python3
UV := $(PYTHON) -m uv
RUN := $(UV) run --locked
# Every spawned rank imports torch; let Python cache its bytecode instead of recompiling
# torch's sources in each process (some environments set this variable).
unexport PYTHONDONTWRITEBYTECODE

.DEFAULT_GOAL := help
.PHONY: help env test

help: ## list the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | sed -E 's/:.*## /\t/' | expand -t 16

env: ## install uv if missing and sync the locked environment into .venv
	@$(PYTHON) -m uv --version >/dev/null 2>&1 || $(PYTHON) -m pip install --quiet uv \
		|| $(PYTHON) -m pip install --quiet --user uv
	$(UV) sync --locked

test: env ## run every correctness test in parallel, then print the grade table
	$(RUN) pytest -n auto --dist loadgroup
