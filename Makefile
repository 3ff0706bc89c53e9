# Every target installs what it needs: uv (through pip) and the locked environment.
# On a machine without network (a cluster's GPU node), UV=0 runs every target with the
# packages already installed for $(PYTHON) instead, after checking that none is missing:
#     make bench-gpu UV=0      make test UV=0 PYTHON=/opt/venv/bin/python
PYTHON ?= python3
UV ?= 1
ifeq ($(UV),0)
PY := PYTHONPATH="$(CURDIR)$(if $(PYTHONPATH),:$(PYTHONPATH))" $(PYTHON)
else
UV_CMD := $(PYTHON) -m uv
PY := $(UV_CMD) run --locked python
endif
# Every spawned rank imports torch; let Python cache its bytecode instead of recompiling
# torch's sources in each process (some environments set this variable). `make env` compiles
# it once at install (--compile-bytecode), so a fresh clone's first test run does not.
unexport PYTHONDONTWRITEBYTECODE

.DEFAULT_GOAL := help
.PHONY: help env test test-profile grade autograder footprint bench bench-quick bench-retake bench-gpu writeup doctor

help: ## list the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | sed -E 's/:.*## /\t/' | expand -t 16
	@echo "UV=0 (any target): use $(PYTHON)'s installed packages, no network (see scripts/check_env.py)"

env: ## install uv if missing and sync the locked environment into .venv (UV=0: check the installed packages)
ifeq ($(UV),0)
	$(PYTHON) scripts/check_env.py
else
	@$(PYTHON) -m uv --version >/dev/null 2>&1 || $(PYTHON) -m pip install --quiet uv \
		|| $(PYTHON) -m pip install --quiet --user uv
	$(UV_CMD) sync --locked --compile-bytecode
endif

test: env ## run every correctness test in parallel, print the grade table and write it to writeup/results
	$(PY) -m pytest -n auto --dist loadgroup --grades-out auto

test-profile: env ## make test's run with what each file and kind of test costs (spawns, gradings, renders, sleeps): tests/PROFILE.md
	$(PY) scripts/test_profile.py

# make grade SUBMISSION=<checkout or .zip> [OUT=dir] [REPEATS=3] [EDITION=2025|2026] [ONLY=problem]
# make grade SUBMISSIONS=<folder of checkouts and zips> [OUT=dir] [JOBS=n] [EXECUTOR=inprocess|local|slurm]
#            [PARTITION=p] [REGRADE=1] [MAKE_PRIVATE=1] [ONLY=problem]
GRADE_ARGS = $(if $(OUT),--out "$(OUT)") --repeats $(or $(REPEATS),3) $(if $(EDITION),--edition $(EDITION)) \
	$(foreach p,$(ONLY),--only $(p))
grade: env ## grade a student's checkout or zip (SUBMISSION=) or a folder of them (SUBMISSIONS=): results.json, grade.md
ifneq ($(SUBMISSIONS),)
	$(PY) -m grading --folder "$(SUBMISSIONS)" $(GRADE_ARGS) $(if $(JOBS),--jobs $(JOBS)) \
		$(if $(EXECUTOR),--executor $(EXECUTOR)) $(if $(PARTITION),--partition $(PARTITION)) $(if $(filter 1,$(REGRADE)),--regrade) \
		$(if $(filter 1,$(MAKE_PRIVATE)),--make-private)
else ifneq ($(SUBMISSION),)
	$(PY) -m grading "$(SUBMISSION)" $(GRADE_ARGS)
else
	@echo "usage: make grade SUBMISSION=<checkout or .zip> | SUBMISSIONS=<folder> [OUT=dir] [REPEATS=n] [EDITION=2025|2026] [ONLY=problem] [EXECUTOR=local|slurm PARTITION=p] [REGRADE=1]"; exit 2
endif

autograder: env ## autograder.zip for Gradescope (EDITION=2026|2025, default 2026: the course's rubric): setup.sh, run_autograder, the grader
	$(PY) -m grading.course.autograder autograder.zip $(or $(EDITION),2026)

# On a quiet machine: the answers beside 93fe110's grader, and beside the answers with ordinary imports
# (scripts/footprint.py; about 15 min on 2 cores). One setting of your own:
# python -m tests.answers_fixture /tmp/answers  (the answers as a submission), then
# make footprint FOOTPRINT_ARGS="--submissions /tmp/answers --quotas 1 0.5 --repeats 2 --out writeup/footprint/<tag>/x.json"
footprint: env ## what grading costs (cgroup: CPU, wall time, peak memory), beside 93fe110's grader and with ordinary imports
ifneq ($(FOOTPRINT_ARGS),)
	$(PY) scripts/measure_grading.py $(FOOTPRINT_ARGS)
else
	$(PY) scripts/footprint.py
endif

bench: env ## CPU benchmarks with gloo on this machine (about 27 min on 2 cores), over the committed results, then the writeup
	$(PY) scripts/run_benchmarks.py --suite cpu

bench-quick: env ## the bench path with minimal sizes (<3 min), into writeup/results/quick
	$(PY) scripts/run_benchmarks.py --suite quick

# On a quiet machine (nothing else running: each run records other jobs' runnable threads and what
# the host did, save_results refuses a run others shared and files one the host disturbed apart):
# the cited results that are not yet quiet evidence (cs336_systems/bench/suites.py, retake_reason).
bench-retake: env ## re-take the cited results of make bench that are not quiet evidence, then the writeup
	$(PY) scripts/run_benchmarks.py --suite retake

bench-gpu: env ## NCCL benchmarks at the handout's settings on a node with 1-6 GPUs, then the writeup
	$(PY) scripts/run_benchmarks.py --suite gpu

writeup: env ## render writeup/README.md (answers), writeup/details/ and writeup/writeup.ipynb from writeup/results
	$(PY) scripts/make_writeup.py

doctor: env ## check a DDP job's set-up: check-in, step times, shards, parameter agreement, all-reduce o/w
	$(PY) scripts/doctor.py $(DOCTOR_ARGS)
