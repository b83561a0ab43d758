# make setup  install mha-bench with its test extras (pytest: assert_matches in your tests) and say
#             where the mha-bench command went
# make test   install, then the test suite
# make run    install, then the main job: the default sweep (every variant, a few shapes) + report
# make test-slow   the slow tests make test leaves out (FlexAttention's decode grid: 12 kernels)
# make lint   ruff over the repository (CI runs it)
# make docs   regenerate docs/reference.md (config keys, result columns, known mistakes)
PYTHON ?= python3
# a worker per core, each test file on one worker (its module-scoped sweeps built once); set
# PYTEST_ARGS= for one process
PYTEST_ARGS ?= -n auto --dist loadfile

.PHONY: help run test test-slow lint docs setup setup-test sweep report tensorboard bench validate-timer stability busy interrupt stress gpu-check clean

help:
	@sed -n 's/^# //p' Makefile

run: setup
	$(PYTHON) -m harness sweep=default

test: setup-test
	$(PYTHON) -m pytest $(PYTEST_ARGS)

test-slow:
	$(PYTHON) -m pytest -m slow $(PYTEST_ARGS)

lint:
	$(PYTHON) -m ruff check .

docs:
	$(PYTHON) -m harness.docs

setup:
	PYTHON=$(PYTHON) EXTRAS=test bash scripts/setup.sh

setup-test: setup

# make sweep SWEEP=toggles    any preset from conf/sweep, without the install step
sweep:
	$(PYTHON) -m harness sweep=$(or $(SWEEP),default)

# make report DIR=results/sweeps/<date_time>    re-render a report from its files
report:
	$(PYTHON) -m harness.report $(DIR)

# make tensorboard DIR=results/sweeps/<date_time>    TensorBoard on loopback over its traces
tensorboard:
	$(PYTHON) -m harness.tensorboard $(DIR)

# make bench         pytest-benchmark over variants x shapes; saves and compares with the last run
bench:
	$(PYTHON) -m pytest benchmarks --benchmark-enable --benchmark-autosave --benchmark-compare \
		--benchmark-group-by=group --benchmark-columns=min,median,iqr,rounds $(PYTEST_ARGS)

# make validate-timer   harness timer vs torch.utils.benchmark (and triton on CUDA) on the same calls
validate-timer:
	$(PYTHON) scripts/validate_timer.py

# make stability     a small sweep run twice (+ once with one way 1.2x slower): re-run agreement, coverage, A/B
stability:
	$(PYTHON) scripts/stability.py --store-floor

# make busy          the same small sweep quiet, then beside 2 busy processes, compared (5 trials)
busy:
	$(PYTHON) scripts/busy.py $(BUSY_ARGS)

# make gpu-check     on a CUDA machine: probe, timer, main, stability, long, llm_prefill, llm_window, llm_decode, suite
#                    (each <= 6 min, a hard deadline; STEP=main or STEP=timer,main picks; STEP=llm: its three;
#                    SETUP=0 skips the install; with no CUDA floor stored, stability runs before main)
gpu-check:
	@if [ "$(SETUP)" != "0" ]; then PYTHON=$(PYTHON) EXTRAS=test bash scripts/setup.sh; fi
	$(PYTHON) scripts/gpu_check.py $(if $(STEP),--steps $(STEP),)

# make interrupt    the main job SIGKILLed at round 3 and resumed, SIGTERMed while checking: what is kept
interrupt:
	$(PYTHON) scripts/interrupt.py

# make stress        a 200-point tiny sweep; prints the harness's per-point overhead
stress:
	$(PYTHON) scripts/stress.py

clean:
	rm -rf results/runs results/sweeps reports/*.html
