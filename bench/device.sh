#!/usr/bin/env bash
# The accelerator run, start to end inside a time budget, from the repository root (`make bench-device`;
# bench/README.md, "Accelerator checks"): the machine, tierstore's dependencies and native build, then
# tests/test_accelerator.py, then the GPT step of every placement side by side (python -m tierstore.bench.device).
#
#   OUT_DIR       where setup.txt, pytest.txt, device.json, device.txt and workers.log go
#                 (default $OUT where it is set, as on the device tool's machine, else bench/results/device-<date>)
#   DEVICE_DRY=1  tiny sizes with the CPU standing in for the accelerator, about a minute
#   DEVICE_BUDGET seconds for all of it (default 450; a dry run 240, a cap: it takes about a minute)
#   PYTHON        the Python with torch (default python3)
#
# A machine with no network: tierstore's dependencies that its Python lacks (crc32c, numcodecs, zarr ...) are
# installed from wheels carried in build/device-wheels (`make device-wheels` fetches them where pip works).
set -u
t0=$SECONDS
dry=${DEVICE_DRY:-0}
[ "$dry" = 0 ] && budget=${DEVICE_BUDGET:-450} || budget=${DEVICE_BUDGET:-240}
py=${PYTHON:-python3}
out=${OUT_DIR:-${OUT:-bench/results/device-$(date -u +%Y-%m-%d)}}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
setup="$out/setup.txt"
: >"$setup"
say() { echo "$*" | tee -a "$setup"; }
left() { echo $((budget - (SECONDS - t0))); }

{
  echo "== machine, $(date -u +%FT%TZ)"
  uname -srm
  echo "cpus $(nproc)"
  free -g | head -2
  df -h . | tail -1
  if command -v nvidia-smi >/dev/null; then nvidia-smi; else echo "nvidia-smi: not here"; fi
  if command -v gcc >/dev/null; then gcc --version | head -1; else echo "gcc: not here"; fi
  "$py" -c 'import sys, torch; a = torch.accelerator
print("python", sys.version.split()[0], sys.executable)
print("torch", torch.__version__, "cuda", torch.version.cuda, "accelerator",
      a.current_accelerator() if a.is_available() else None)'
} 2>&1 | tee -a "$setup"

# tierstore's own dependencies (and DeepSpeed, where its wheels were carried too: `make device-wheels DEVICE_DS=1`),
# from the carried wheels where this Python lacks them
deps="import crc32c, numcodecs, rich, numpy"
want_ds=0
ls build/device-wheels/deepspeed-*.whl >/dev/null 2>&1 && ! "$py" -c "import deepspeed" 2>/dev/null && want_ds=1
if ! "$py" -c "$deps" 2>/dev/null || [ "$want_ds" = 1 ]; then
  if ls build/device-wheels/*.whl >/dev/null 2>&1; then
    site=/tmp/tierstore-site
    if "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" \
      build/device-wheels/*.whl >>"$setup" 2>&1; then
      export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}" PATH="$site/bin:$PATH"
      say "dependencies: installed from build/device-wheels into $site"
    else
      say "dependencies: pip could not install build/device-wheels (see setup.txt)"
    fi
  fi
  if ! "$py" -c "$deps" >>"$setup" 2>&1; then
    say "dependencies: tierstore cannot be imported ($deps fails); run \`make device-wheels\` where pip works" \
      "and carry build/device-wheels with the call"
    exit 3
  fi
fi

# the native libraries, built in place for this Python; without them the thread-pool I/O engine and the
# pure-Python paths run, and the run says so
native_ok="from tierstore import _native as n; [n.load(x) for x in ('uring', 'crc', 'quant')]"
if [ "$dry" != 0 ] && "$py" -c "$native_ok" 2>/dev/null; then
  say "native: dry run, the libraries already built here are used"
elif ! command -v gcc >/dev/null; then
  say "native: no gcc here, not built: the thread-pool I/O engine and pure-Python kernels run instead"
else
  if timeout 180 "$py" setup.py -q build_ext --inplace >>"$setup" 2>&1 && "$py" -c "$native_ok" 2>>"$setup"; then
    say "native: built in place (setup.py build_ext --inplace)"
  else
    # setup.py needs a recent setuptools; the libraries need only gcc and the Python headers
    inc=$("$py" -c 'import sysconfig; print(sysconfig.get_paths()["include"])')
    suf=$("$py" -c 'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX"))')
    for src in native/*.c; do
      name=$(basename "$src" .c)
      gcc -O3 -std=gnu11 -shared -fPIC -pthread -I"$inc" -Inative -o "tierstore/_native_$name$suf" "$src" \
        >>"$setup" 2>&1 || say "native: gcc failed on $src (Python headers in $inc?)"
    done
    if "$py" -c "$native_ok" 2>>"$setup"; then
      say "native: built in place with gcc directly"
    else
      say "native: NOT built (see setup.txt): the thread-pool I/O engine and pure-Python kernels run instead"
    fi
  fi
fi
say "setup took $((SECONDS - t0)) s"

# the accelerator's checks (they skip, saying why, where torch sees no accelerator)
tmax=$(($(left) - 240))
[ "$dry" != 0 ] && tmax=60
if [ "$tmax" -lt 30 ]; then
  say "pytest: skipped, too little of the budget left"
else
  timeout "$tmax" "$py" -m pytest -q -p no:cacheprovider -o timeout=120 tests/test_accelerator.py 2>&1 |
    tee "$out/pytest.txt" | tail -n 15
  rc=${PIPESTATUS[0]}
  [ "$rc" = 124 ] && say "pytest: stopped at its limit of $tmax s" || say "pytest: exit $rc, $((SECONDS - t0)) s in"
fi

# the benchmark, in what is left of the budget
bmax=$(($(left) - 10))
[ "$bmax" -lt 60 ] && bmax=60  # a slow setup shortens the benchmark, never to nothing
dryarg=()
[ "$dry" != 0 ] && dryarg=(--dry-run)
timeout $((bmax + 30)) "$py" -m tierstore.bench.device "${dryarg[@]}" --out "$out" --budget "$bmax"
rc=$?
say "bench: exit $rc; $((SECONDS - t0)) s in all; files in $out"
exit "$rc"
