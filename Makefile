# The two commands a user needs: `make demo` and `make test`. Both create .venv on first use.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
INSTALLED := $(VENV)/.installed
EXTRAS := amazon,google,openlineage,train,dev

.PHONY: install demo demo-evaluate screenshots ui test lint chaos evaluate forecast-backtest forecast-fresh evaluate-forecasters evaluate-synthetic bench bench-fleet constraints clean

install: $(INSTALLED)

$(INSTALLED): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -c constraints.txt -e ".[$(EXTRAS)]"
	touch $(INSTALLED)

# The operator end to end on the embedded default: the demo DAG (a real fine-tune on a replayed
# spot market, with a preemption) run by `airflow dags test` in a project-local AIRFLOW_HOME
# (SQLite, no server), then its summary.
DEMO_HOME := $(CURDIR)/.airflow
DEMO_ENV := AIRFLOW_HOME=$(DEMO_HOME) AIRFLOW__CORE__LOAD_EXAMPLES=False AIRFLOW__CORE__DAGS_FOLDER=$(CURDIR)/dags

demo: $(INSTALLED)
	mkdir -p $(DEMO_HOME)
	$(DEMO_ENV) $(BIN)/airflow db migrate > $(DEMO_HOME)/migrate.log
	$(DEMO_ENV) $(BIN)/airflow dags test spot_finetune_demo 2>&1 | tee $(DEMO_HOME)/demo.log
	@sed -n '/=== spot fine-tune summary ===/,/^slots /p' $(DEMO_HOME)/demo.log | grep . \
		|| { echo "the demo DAG did not finish: see $(DEMO_HOME)/demo.log"; exit 1; }

# Airflow's UI on the demo's AIRFLOW_HOME (http://localhost:8080; the login is printed at start).
# `airflow standalone` starts its components as `airflow` from PATH: the virtualenv comes first.
ui: $(INSTALLED)
	mkdir -p $(DEMO_HOME)
	$(DEMO_ENV) $(BIN)/airflow db migrate > $(DEMO_HOME)/migrate.log
	PATH=$(CURDIR)/$(BIN):$$PATH $(DEMO_ENV) $(BIN)/airflow standalone

# docs/images/ from the demo's own runs: SCREENSHOT_RUNS demo runs (the fleet view shows them
# all), then the report page, its tab in the Airflow UI and the fleet view, captured in Chromium.
SCREENSHOT_RUNS ?= 3
screenshots: $(INSTALLED)
	scripts/ensure-chromium
	for run in $$(seq $(SCREENSHOT_RUNS)); do $(MAKE) --no-print-directory demo > /dev/null || exit 1; done
	$(BIN)/python scripts/screenshots.py --home $(DEMO_HOME) --out docs/images

# A short evaluation of the policies on both shipped traces.
demo-evaluate: $(INSTALLED)
	$(BIN)/spotsched evaluate --out results/demo --scenarios 2 --nmax 4 8 --workers 2

# The linters and the layer contract first (seconds), then the suite; the report pages' browser
# tests need Chromium, which scripts/ensure-chromium installs where it is missing. The tests that
# start real Airflow servers (marker `deployment`) run after the rest, so that their load never
# meets the suite's wall-clock tests (local workers, the fault suite) on a two-core machine.
test: $(INSTALLED) lint
	scripts/ensure-chromium
	$(BIN)/python -m pytest -m "not deployment"
	$(BIN)/python -m pytest -m deployment

lint: $(INSTALLED)
	$(BIN)/ruff check .
	$(BIN)/lint-imports
	$(BIN)/mypy

# The fault suite in full (docs/reliability.md): every fault at length, every policy, several
# seeds (SPOTSCHED_CHAOS_RUNS, default 3); make test runs its smallest cases. One process (-n 0):
# the scenarios time real processes. The figures are printed and written to CHAOS_REPORT.
CHAOS_REPORT ?= results/chaos/figures.json
chaos: $(INSTALLED)
	SPOTSCHED_CHAOS=1 SPOTSCHED_FAULTS_REPORT=$(CHAOS_REPORT) $(BIN)/python -m pytest -m chaos -n 0 tests/faults

# The full evaluation whose table and plots live in docs/evaluation/.
evaluate: $(INSTALLED)
	$(BIN)/spotsched evaluate --out docs/evaluation

# What each forecaster buys: CHC on every real forecaster over the default grid, its cost beside
# its forecast error at the same jobs (docs/evaluation/forecasters/summary.md).
evaluate-forecasters: $(INSTALLED)
	$(BIN)/spotsched evaluate --out docs/evaluation/forecasters --policies optimal uniform-progress \
		chc-persistence chc-seasonal-naive chc-arima chc-holt-winters chc-markov-count chc-sojourn-chain chc-auto-unguarded

# The default grid on seeded synthetic markets no policy was tuned on (docs/evaluation.md).
EVAL_SYNTH_SEEDS ?= 301 302 303
evaluate-synthetic: $(INSTALLED)
	for seed in $(EVAL_SYNTH_SEEDS); do \
		$(BIN)/spotsched synth --seed $$seed --out results/synth/eval-$$seed.csv.gz || exit 1; \
	done
	$(BIN)/spotsched evaluate --out docs/evaluation/synthetic --scenarios 4 \
		--traces $(foreach seed,$(EVAL_SYNTH_SEEDS),results/synth/eval-$(seed).csv.gz)

# The forecasting backtests whose tables and plots live in docs/forecasting/ (see docs/forecasting.md).
TRACES := airflow_provider_spotsched/data/traces
forecast-backtest: $(INSTALLED)
	$(BIN)/spotsched forecast --trace $(TRACES)/aws_p3.2xlarge_9az_2023-02-15.csv.gz --horizon 24 --backtest --workers 3 --out-dir docs/forecasting/aws
	$(BIN)/spotsched forecast --trace $(TRACES)/gcp_h100_13zones_2025-10.csv.gz --horizon 24 --backtest --workers 3 --out-dir docs/forecasting/gcp

# Forecasts against persistence at origins nobody chose (docs/forecasting.md): origins spread
# evenly over each shipped trace (160) and over seeded synthetic markets (80 each), a new
# forecaster at each. About 20 min for the traces and 3-5 min per seed on a shared 2-core machine.
SYNTH_SEEDS ?= 101 102 103 104 105
FRESH := --horizon 24 --backtest --fresh --min-history 168 --workers 1
forecast-fresh: $(INSTALLED)
	$(BIN)/spotsched forecast --trace $(TRACES)/aws_p3.2xlarge_9az_2023-02-15.csv.gz $(FRESH) --origins 160 --out-dir docs/forecasting/fresh/aws
	$(BIN)/spotsched forecast --trace $(TRACES)/gcp_h100_13zones_2025-10.csv.gz $(FRESH) --origins 160 --at-least 4 8 --out-dir docs/forecasting/fresh/gcp
	for seed in $(SYNTH_SEEDS); do \
		$(BIN)/spotsched synth --seed $$seed --out results/synth/seed-$$seed.csv.gz && \
		$(BIN)/spotsched forecast --trace results/synth/seed-$$seed.csv.gz $(FRESH) --origins 80 --models auto --at-least 4 8 \
			--out-dir docs/forecasting/fresh/synth-$$seed || exit 1; \
	done

# A few minutes of each benchmark; docs/benchmarks.md gives the full-length commands.
bench: $(INSTALLED)
	$(BIN)/python benchmarks/bench_planner.py --starts 5 --milp-limit 0
	$(BIN)/python benchmarks/bench_ip.py --starts 3 --limit 30
	$(BIN)/python benchmarks/bench_evaluation.py --scenarios 2 --nmax 1 4 8
	$(BIN)/python benchmarks/bench_forecast.py
	$(BIN)/python benchmarks/bench_triggers.py --triggers 1000 --seconds 30 --poll-interval 5 --boundaries 4
	$(BIN)/python benchmarks/bench_reconfiguration.py
	$(BIN)/python benchmarks/bench_preemption.py --minutes 2 --preemptions 3 --modes notice,kill,sigterm --world-sizes 1,2,1,1
	$(MAKE) bench-fleet

# The fleet dashboard with 10,000 runs in a fresh SQLite metadata database (a few minutes, most of
# them filling the database and the REST API baseline); docs/ui.md has the figures.
bench-fleet: $(INSTALLED)
	$(BIN)/python benchmarks/bench_fleet.py --runs 10000 --repeat 5

# Re-pin the tested versions after a dependency change (torch stays the CPU build).
constraints: $(INSTALLED)
	{ sed -n '/^#/p' constraints.txt; $(BIN)/python -m pip freeze --exclude-editable | sed 's/+cpu$$//'; } > constraints.tmp
	mv constraints.tmp constraints.txt

clean:
	rm -rf $(VENV) results .pytest_cache .hypothesis
