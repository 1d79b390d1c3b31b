#!/usr/bin/env bash
# The GPU check in one command, from a copy of the working tree on the GPU machine (no package
# index there): install the wheels bench/gpu_wheels.sh fetched beforehand (.gpu-wheels/) into
# a temporary target, run the GPU suite (pytest -m gpu tests/gpu), then bench/gpu.py; logs and
# tables go to the folder given, else $OUT, else ./gpu-check-out. Within 8 minutes.
#
#     bench/gpu_wheels.sh                  # beforehand, where PyPI answers
#     bench/gpu_check.sh [DIR]             # on the GPU machine (carry .gpu-wheels)
#     bench/gpu_check.sh --dry-run [DIR]   # here, on the CPU: every step's plumbing (CI)
#
# The dry run installs the same wheels for CPython 3.12 into a temporary target (checked, not
# imported: this Python may be another), collects and runs tests/gpu (skipped without CUDA),
# and runs bench/gpu.py --dry-run (the CPU, float32, tiny sizes) writing its docs section into
# a copy of docs/benchmarks.md. Files written (8 at most, what the device tool brings back):
# env.txt, pip.log, pytest.log, pytest.xml, bench.log, bench.json, benchmarks.md, summary.txt.
# Each step's time limit: GPU_CHECK_PYTEST_S (300), GPU_CHECK_BENCH_S (150; 600 dry: CPU daemons).
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
DRY=0
if [ "${1:-}" = "--dry-run" ]; then DRY=1; shift; fi
DEST=${1:-${OUT:-$ROOT/gpu-check-out}}
WHEELS=${GPU_WHEELS:-$ROOT/.gpu-wheels}
PY=${PYTHON:-}
if [ -z "$PY" ]; then
    if [ $DRY = 1 ] && [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
mkdir -p "$DEST"
SUMMARY=$DEST/summary.txt
: >"$SUMMARY"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
failed=0
started=$SECONDS
exec 3>&1

step() {  # NAME SECONDS-LIMIT COMMAND...: run, time, record ok/FAILED in the summary
    local name=$1 limit=$2 t0=$SECONDS rc
    shift 2
    if [ "$limit" = 0 ]; then "$@"; else timeout --kill-after=10 "$limit" "$@"; fi  # 0: a function
    rc=$?
    local line="$name: $([ $rc = 0 ] && echo ok || echo "FAILED (exit $rc$([ $rc = 124 ] && echo ", past ${limit} s"))") in $((SECONDS - t0)) s"
    echo "$line" >>"$SUMMARY"
    echo "$line" >&3  # past the step's own redirection
    [ $rc = 0 ] || failed=1
    return $rc
}

ls "$WHEELS"/*.whl >/dev/null 2>&1 || {
    echo "no wheels in $WHEELS: run bench/gpu_wheels.sh first (where PyPI answers)" | tee -a "$SUMMARY"
    exit 2
}

# 1. the wheels, into a temporary target (the machine's torch and the rest stay as they are)
site=$work/site
pip_args=(-m pip install --no-index --no-deps --no-compile --no-cache-dir --target "$site")
if [ $DRY = 1 ]; then  # the GPU machine's Python: install the set as it will install there
    pip_args+=(--only-binary=:all: --python-version 3.12 --implementation cp --abi cp312
        --abi abi3 --abi none)
    for n in 17 24 26 27 28 31 34; do pip_args+=(--platform "manylinux_2_${n}_x86_64"); done
    pip_args+=(--platform manylinux2014_x86_64 --platform manylinux1_x86_64)
fi
install_and_check() {
    "$PY" "${pip_args[@]}" "$WHEELS"/*.whl || return 1
    local missing=""
    for pkg in zmq zeroconf ifaddr spake2 cryptography cffi pycparser gguf bitsandbytes; do
        [ -d "$site/$pkg" ] || missing="$missing $pkg"
    done
    ls "$site"/bitsandbytes/libbitsandbytes_cuda*.so >/dev/null 2>&1 || missing="$missing libbitsandbytes_cuda*.so"
    [ -z "$missing" ] || { echo "not installed:$missing"; return 1; }
    du -sh "$site"
}
step wheels 0 install_and_check >"$DEST/pip.log" 2>&1 || { cat "$DEST/pip.log"; exit 1; }
if [ $DRY = 0 ]; then export PYTHONPATH=$ROOT:$site${PYTHONPATH:+:$PYTHONPATH}; else export PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH}; fi

# 2. what this machine is, and that everything the suite needs imports
environment() {
    echo "dry run: $DRY; python: $("$PY" -c 'import sys; print(sys.executable, sys.version.split()[0])')"
    command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version,compute_cap --format=csv
    "$PY" - <<'EOF'
import importlib, sys
import torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())
if torch.cuda.is_available():
    print("device", torch.cuda.get_device_name(0), "capability", torch.cuda.get_device_capability(0))
bad = []
for name in ("zmq", "zeroconf", "spake2", "cryptography", "gguf", "msgpack", "click", "aiohttp",
             "tokenizers", "transformers", "peft", "accelerate", "safetensors", "pynvml",
             "swarmp2p.net.auth", "swarmp2p.runtime.torch", "bitsandbytes"):
    try:
        module = importlib.import_module(name)
        print(f"{name} {getattr(module, '__version__', '')} {getattr(module, '__file__', '')}")
    except Exception as exc:
        bad.append(f"{name}: {exc!r}")
if bad:
    sys.exit("cannot import: " + "; ".join(bad))
EOF
}
step environment 0 environment >"$DEST/env.txt" 2>&1
cat "$DEST/env.txt"

# 3. the GPU suite (every test skipped without CUDA: the dry run checks they collect and load)
step pytest "${GPU_CHECK_PYTEST_S:-300}" "$PY" -m pytest -m gpu tests/gpu -v -p no:cacheprovider \
    --junitxml="$DEST/pytest.xml" >"$DEST/pytest.log" 2>&1
tail -25 "$DEST/pytest.log"
collected=$(grep -c '^tests/gpu/' "$DEST/pytest.log")
if [ "$collected" -lt 10 ]; then
    echo "pytest: only $collected GPU tests reported (expected 10 or more)" | tee -a "$SUMMARY"
    failed=1
fi

# 4. the benchmark: the docs section into docs/benchmarks.md on a GPU (and a copy back),
#    into a copy of it on a dry run
cp docs/benchmarks.md "$DEST/benchmarks.md"
bench_args=(--docs "$DEST/benchmarks.md")
[ $DRY = 1 ] && bench_args=(--dry-run "${bench_args[@]}")
step bench "${GPU_CHECK_BENCH_S:-$([ $DRY = 1 ] && echo 600 || echo 150)}" "$PY" bench/gpu.py "${bench_args[@]}" >"$DEST/bench.log" 2>&1
tail -1 "$DEST/bench.log" >"$DEST/bench.json"
grep -v '^{' "$DEST/bench.log" | grep '^|\|^#' | head -40
if ! "$PY" -c 'import json, sys; json.load(open(sys.argv[1]))' "$DEST/bench.json" 2>/dev/null ||
    ! grep -q '<!-- gpu:begin -->' "$DEST/benchmarks.md"; then
    echo "bench: no JSON last line or no GPU section written" | tee -a "$SUMMARY"
    failed=1
fi
[ $DRY = 0 ] && [ $failed = 0 ] && cp "$DEST/benchmarks.md" docs/benchmarks.md

echo "total: $((SECONDS - started)) s, $([ $failed = 0 ] && echo ok || echo FAILED)" | tee -a "$SUMMARY"
exit $failed
