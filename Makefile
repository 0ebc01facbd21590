# On a fresh machine: `make demo`, `make check` and `make test` (see README.md).
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(VENV)/bin/pip
# The development venv takes torch's CPU build (a local wheel on the project's machines, seconds to install).
# Users installing with plain `pip install .` get whatever torch>=2.4 their index serves; override with
# `make TORCH_SPEC=torch` to do the same here.
TORCH_SPEC ?= torch==2.13.0
DEMO_DIR   ?= demo-data
BENCH_DIR  ?= bench-data
SCALE_MAX  ?= 1.1e9
STAMP  := $(VENV)/.installed

.PHONY: demo demo-big check test soak bench install clean

$(STAMP): pyproject.toml setup.py $(wildcard native/*.c native/*.h)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip setuptools wheel
	$(PIP) install -q "$(TORCH_SPEC)"
	$(PIP) install -q -e ".[test,plot]"
	@# The xfs power-loss campaign needs mkfs.xfs: installed where this runs as root with apt (CI); elsewhere
	@# those runs skip, saying why (tests/reliability, docs/reliability.md).
	-@command -v mkfs.xfs >/dev/null || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
		{ apt-get install -y -q --no-install-recommends xfsprogs >/dev/null 2>&1 || \
		  { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q --no-install-recommends xfsprogs >/dev/null 2>&1; }; }; } || \
		echo "note: mkfs.xfs not installed (Debian: xfsprogs); the xfs power-loss runs will be skipped"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	mkdir -p $(DEMO_DIR)
	$(VENV)/bin/tierstore info --dir $(DEMO_DIR)
	$(VENV)/bin/tierstore demo --dir $(DEMO_DIR)

# Lint (ruff) and types (mypy); both configured in pyproject.toml.
check: $(STAMP)
	$(VENV)/bin/ruff check .
	$(PY) -m mypy
# By hand, not in CI: a model whose training states are >= 1.5x this machine's RAM, a few steps (see README).
demo-big: $(STAMP)
	mkdir -p $(DEMO_DIR)
	$(VENV)/bin/tierstore demo --big --dir $(DEMO_DIR)

test: $(STAMP)
	$(PY) -m pytest -q

# The fault campaigns at length (>= 200 SIGKILLs, >= 50 power losses, >= 1,000 corruptions; root for the
# loop-mounted filesystems); `make test` runs a few trials of each. A table of trials and outcomes ends the
# run; a failure prints the TIERSTORE_SEED that replays it. See docs/reliability.md.
soak: $(STAMP)
	TIERSTORE_SOAK=1 $(PY) -m pytest -q -o timeout=0 -rsx tests/reliability

# Long measurements against references measured in the same run (fio, DeepSpeed aio, torch); see bench/README.md.
# fio, the reference of `bench io`, is installed where this runs as root with apt; elsewhere the exact command is
# printed and bench io runs without its fio columns (saying so).
bench: $(STAMP)
	-@command -v fio >/dev/null || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
		{ apt-get install -y -q --no-install-recommends fio >/dev/null 2>&1 || \
		  { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q --no-install-recommends fio >/dev/null 2>&1; }; }; } || \
		echo "note: fio is not installed; install it with: sudo apt-get install -y fio (Fedora: sudo dnf install -y fio)"
	$(VENV)/bin/tierstore bench io --dir $(BENCH_DIR) --json bench/results/io.json
	$(VENV)/bin/tierstore bench scale --dir $(BENCH_DIR) --max-params $(SCALE_MAX) --json bench/results/scale.json

clean:
	rm -rf $(VENV) build *.egg-info tierstore/*.so $(DEMO_DIR) $(BENCH_DIR)
