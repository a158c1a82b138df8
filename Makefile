# The two commands a newcomer types: `make run` and `make test`. Each sets itself up.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
SAMPLE := ../shared/data/c4/c4-train.00000-of-01024.head900.json.gz
export KEDRO_DISABLE_TELEMETRY := true
# Bytecode caches stay on, even where the environment turns them off: the install below
# compiles only what the project imports, and `make test` starts over a hundred processes
# that import it (each xdist worker also collects, and pytest rewrites, every test module).
export PYTHONDONTWRITEBYTECODE :=

.PHONY: install run test lint viz mlflow-ui lock clean-data

# pip would compile every module of every package (torch, transformers, MLflow…): 90 s of
# a 150 s install on 2 cores. Importing what a run imports compiles that much in about 20 s;
# anything else compiles on its first import.
WARM_IMPORTS := import titan_kedro.settings, titan_kedro.pipeline_registry, \
	titan_kedro.train.trainer, titan_kedro.models.deepseek_v2.model, \
	titan_kedro.models.deepseek_v3.model, titan_kedro.models.llama3.model, \
	torch.distributed.run, transformers, matplotlib.pyplot, kedro_viz, mlflow.server
$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade "pip>=24"
	$(BIN)/python -m pip install -q --no-compile -c constraints.txt -e '.[dev]'
	$(BIN)/python -c "$(WARM_IMPORTS)" > $(VENV)/warm-imports.log 2>&1 \
		|| { cat $(VENV)/warm-imports.log; exit 1; }
	touch $@

install: $(STAMP)

# Uses the C4 sample beside the repo when data/01_raw/c4 holds no shards yet.
run: install
	@if ! ls data/01_raw/c4/*.json* >/dev/null 2>&1 && [ -f $(SAMPLE) ]; then \
		echo "copying the C4 sample into data/01_raw/c4/"; cp $(SAMPLE) data/01_raw/c4/; chmod u+w data/01_raw/c4/*; fi
	$(BIN)/kedro run $(ARGS)

# The suite runs inside tests/services.sh, which starts the services it needs (the one-host
# Slurm cluster: as root it apt-installs Debian's Slurm packages if missing) and stops them
# after; without root it fails at once naming the command that fixes it.
# TEST_WORKERS pytest-xdist workers share the machine: most tests wait on other processes
# (torchrun start-up, Slurm, servers), so two workers keep 2 cores busy. A module stays on
# one worker, and the Slurm tests on one (tests/conftest.py).
TEST_WORKERS ?= 2
test: install
	$(BIN)/ruff check src tests benchmarks examples
	TITAN_TEST_PYTHON=$(BIN)/python tests/services.sh $(BIN)/python -m pytest \
		-n $(TEST_WORKERS) --dist loadfile --durations=25 $(PYTEST_ARGS)

lint: install
	$(BIN)/ruff check src tests benchmarks examples
	$(BIN)/ruff format --check src tests benchmarks examples

viz: install
	$(BIN)/kedro viz run --host 127.0.0.1 --no-browser

mlflow-ui: install
	$(BIN)/mlflow ui --backend-store-uri sqlite:///mlflow.db --host 127.0.0.1

# Re-resolve the pins from pyproject's ranges (keep torch at 2.13.0 and mlflow at 3.17.x).
lock:
	rm -rf /tmp/titan-lock && $(PYTHON) -m venv /tmp/titan-lock
	/tmp/titan-lock/bin/pip install -q "torch==2.13.0" "mlflow==3.17.*" -e '.[dev]'
	{ grep '^#' constraints.txt; /tmp/titan-lock/bin/pip freeze --exclude-editable \
		| sed 's/^torch==2.13.0+cpu$$/torch==2.13.0/'; } > /tmp/titan-lock/constraints.txt
	mv /tmp/titan-lock/constraints.txt constraints.txt

clean-data:
	find data -type f ! -name .gitkeep -delete
