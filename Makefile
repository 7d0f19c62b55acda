# The two commands a user needs: `make demo` and `make test`. Both create .venv on first use.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
INSTALLED := $(VENV)/.installed
EXTRAS := amazon,google,train,dev

.PHONY: install demo test evaluate bench constraints clean

install: $(INSTALLED)

$(INSTALLED): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -c constraints.txt -e ".[$(EXTRAS)]"
	touch $(INSTALLED)

# The main job on the embedded default: a short evaluation on both shipped traces.
demo: $(INSTALLED)
	$(BIN)/spotsched evaluate --out results/demo --scenarios 2 --nmax 4 8 --workers 2

test: $(INSTALLED)
	$(BIN)/python -m pytest

# The full evaluation whose table and plots live in docs/evaluation/.
evaluate: $(INSTALLED)
	$(BIN)/spotsched evaluate --out docs/evaluation

# A few minutes of each benchmark; docs/benchmarks.md gives the full-length commands.
bench: $(INSTALLED)
	$(BIN)/python benchmarks/bench_planner.py --starts 5 --milp-limit 0
	$(BIN)/python benchmarks/bench_ip.py --starts 3 --limit 30
	$(BIN)/python benchmarks/bench_evaluation.py --scenarios 2 --nmax 1 4 8

# Re-pin the tested versions after a dependency change (torch stays the CPU build).
constraints: $(INSTALLED)
	{ sed -n '/^#/p' constraints.txt; $(BIN)/python -m pip freeze --exclude-editable | sed 's/+cpu$$//'; } > constraints.tmp
	mv constraints.tmp constraints.txt

clean:
	rm -rf $(VENV) results .pytest_cache .hypothesis
