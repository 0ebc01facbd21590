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

.PHONY: demo demo-big check test soak bench bench-refs bench-micro bench-device device-wheels install clean

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

# Long measurements against references measured in the same run (fio, DeepSpeed, torch); see bench/README.md.
# `make bench` installs what it can of those references itself (bench-refs) and says how to get the rest.
BENCH_STAMP := $(VENV)/.bench-installed
DS_VENV  ?= .venv-ds
DS_SPEC  ?= deepspeed==0.19.8
DS_STAMP := $(DS_VENV)/.installed
BENCH_FAIL ?=
MICRO := bench/results/micro

$(BENCH_STAMP): $(STAMP)
	$(PIP) install -q -e ".[test,plot,bench]"
	touch $(BENCH_STAMP)

# DeepSpeed in its own venv (its pins must not move the project's), with torch's CPU build; its CPU Adam op is
# compiled here so no benchmark times a compiler. Its aio op (ZeRO-Infinity, `bench io`'s reference) builds
# only where libaio's headers are installed; without them this says which command installs them.
$(DS_STAMP):
	test -x $(DS_VENV)/bin/python || $(PYTHON) -m venv $(DS_VENV)
	$(DS_VENV)/bin/pip install -q --upgrade pip setuptools wheel
	$(DS_VENV)/bin/pip install -q "$(TORCH_SPEC)" "$(DS_SPEC)"
	DS_ACCELERATOR=cpu $(DS_VENV)/bin/python -c "from deepspeed.ops.op_builder.cpu import CPUAdamBuilder as B; B().load()"
	touch $(DS_STAMP)

$(DS_VENV): $(DS_STAMP)

bench-refs:
	@$(MAKE) --no-print-directory $(DS_STAMP) || echo "note: DeepSpeed could not be installed; the DeepSpeed rows of 	bench optim / bench io are skipped. To install by hand: python3 -m venv $(DS_VENV) && $(DS_VENV)/bin/pip install 	'$(TORCH_SPEC)' '$(DS_SPEC)'"
	-@test ! -x $(DS_VENV)/bin/python || DS_ACCELERATOR=cpu $(DS_VENV)/bin/python -c "from deepspeed.ops.op_builder.cpu \
	import AsyncIOBuilder as B; b = B(); ok = b.is_compatible(verbose=False); b.load() if ok else print('note: \
	DeepSpeed aio (ZeRO-Infinity and bench io reference) needs libaio headers: apt-get install libaio-dev \
	(Fedora/RHEL: dnf install libaio-devel), then make bench again')" 2>&1 | grep -v '^\[' || true
	-@command -v fio >/dev/null || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
		{ apt-get install -y -q --no-install-recommends fio >/dev/null 2>&1 || \
		  { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q --no-install-recommends fio >/dev/null 2>&1; }; }; } || \
		echo "note: fio not installed (Debian: apt-get install fio); its rows of bench io are skipped"

bench: $(BENCH_STAMP) bench-refs
	$(VENV)/bin/tierstore bench io --dir $(BENCH_DIR) --json bench/results/io.json
	$(VENV)/bin/tierstore bench optim --dir $(BENCH_DIR) --json bench/results/optim.json
	$(VENV)/bin/tierstore bench train --dir $(BENCH_DIR) --json bench/results/train.json
	$(VENV)/bin/tierstore bench scale --dir $(BENCH_DIR) --max-params $(SCALE_MAX) --json bench/results/scale.json
	@# With an accelerator (a torch build that sees one): the GPT step with the model on it, and its checks.
	@if $(PY) -c "import sys, torch; sys.exit(0 if torch.accelerator.is_available() else 1)"; then \
		$(PY) -m pytest -q tests/test_accelerator.py && \
		$(PY) bench/accelerator_step.py --dir $(BENCH_DIR)/accelerator --json bench/results/accelerator-step.json && \
		$(PY) bench/accelerator_host_step.py; \
	else echo "no accelerator here: tests/test_accelerator.py and bench/accelerator_*.py skipped"; fi
	$(MAKE) --no-print-directory bench-micro

# Microbenchmarks (bench/test_micro.py, pytest-benchmark): each run is saved under bench/results/micro and compared
# with the latest saved run of this machine; BENCH_FAIL=mean:25% also fails on such a regression.
bench-micro: $(BENCH_STAMP)
	mkdir -p $(BENCH_DIR)
	$(PY) -m pytest -q -p no:cacheprovider bench/test_micro.py --basetemp=$(BENCH_DIR)/micro \
		--benchmark-storage=$(MICRO) --benchmark-autosave --benchmark-compare \
		$(if $(BENCH_FAIL),--benchmark-compare-fail=$(BENCH_FAIL))

# The accelerator run (bench/README.md, "Accelerator checks"): the machine, the native build, tests/test_accelerator.py
# and the GPT step of every placement side by side, all inside 8 minutes; files in OUT_DIR (default
# bench/results/device-<date>). DEVICE_DRY=1: tiny sizes with the CPU standing in, about a minute. No install step:
# it runs with the Python there (the venv's where there is one, else python3); a machine without network gets
# tierstore's dependencies from build/device-wheels, which `make device-wheels` fetches here.
OUT_DIR    ?=
DEVICE_DRY ?= 0
DEVICE_PY  := $(if $(wildcard $(PY)),$(PY),$(PYTHON))
DEVICE_PYV ?= 3.12
bench-device:
	OUT_DIR="$(OUT_DIR)" DEVICE_DRY=$(DEVICE_DRY) PYTHON="$(DEVICE_PY)" bash bench/device.sh

# DEVICE_DS=1 adds DeepSpeed (a wheel built here without its ops, which compile there on first use) and the
# packages it needs that the device's image lacks.
DEVICE_DS  ?= 0
DEVICE_DL  = $(DEVICE_PY) -m pip download -q --no-deps --only-binary=:all: --python-version $(DEVICE_PYV) \
	--implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
	--platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d build/device-wheels
device-wheels:
	$(DEVICE_DL) crc32c==2.9.post0 numcodecs==0.16.6 zarr==3.1.6 donfig==0.8.1.post1 google-crc32c==1.9.0
	if [ "$(DEVICE_DS)" = 1 ]; then \
		$(DEVICE_DL) hjson==3.1.0 pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 \
			typing-inspection==0.4.5 && \
		DS_BUILD_OPS=0 $(DEVICE_PY) -m pip wheel -q --no-deps --no-build-isolation -w build/device-wheels \
			"$(DS_SPEC)"; fi

clean:
	rm -rf $(VENV) $(DS_VENV) build *.egg-info tierstore/*.so $(DEMO_DIR) $(BENCH_DIR)
