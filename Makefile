# Two entry points, each doing its own set-up in a virtual environment:
#   make demo   train a small diffusion model on the embedded Fashion-MNIST data, write samples and the metric
#   make test   run the default test suite (make test-slow adds the long tests)
# make docs builds the documentation site (docs/, mkdocs.yml) into outputs/site, failing on any warning.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
OUTPUT_DIR ?= outputs/demo

.PHONY: setup demo test test-slow lint docs bench clean

setup: $(VENV)/.installed

# pip runs with -qq: it prints only errors (the build backend's notices about editable installs are not the user's
# business); a failing step still stops make with pip's error message.
$(VENV)/.installed: pyproject.toml setup.py
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	@echo "setting up $(VENV) (first time: about 2 minutes)"
	@$(BIN)/python -m pip install -qq --upgrade pip
	@$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install -qq torch==2.13.0
	@$(BIN)/python -m pip install -qq -e ".[test]"
	@touch $@
	@echo "set-up done"

demo: setup
	$(BIN)/python examples/demo.py --output_dir $(OUTPUT_DIR)

# Two pytest workers with one torch thread each use 2 cores better than one worker with two threads
# (the tests' models are tiny, and their subprocesses inherit the setting).
test: setup
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -m "not slow" -n 2

test-slow: setup
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -m slow -n 2

# The docs extra is installed on first use.
docs: setup
	@$(BIN)/python -c "import mkdocs, material, mkdocstrings_handlers.python" 2>/dev/null || $(BIN)/python -m pip install -qq -e ".[docs]"
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

clean:
	rm -rf $(VENV) outputs .pytest_cache
