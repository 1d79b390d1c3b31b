#!/usr/bin/env bash
# Fetch, on a machine with the package index, exactly the wheels the GPU machine lacks, for
# CPython 3.12 manylinux x86-64, into the ignored folder .gpu-wheels/ that bench/gpu_check.sh
# installs from there (no index on that machine).
#
#     bench/gpu_wheels.sh            # then carry .gpu-wheels with the working tree
#
# The GPU machine has torch 2.11 (CUDA 13), transformers, peft, accelerate, safetensors,
# huggingface_hub, msgpack, click, aiohttp, rich, nvidia-ml-py, numpy, tokenizers, jinja2,
# pyyaml, tqdm, requests and pytest (/work/.library/device/KINDS.md); it lacks pyzmq,
# zeroconf (and its ifaddr), spake2, cryptography (and its cffi, whose pycparser), gguf and
# bitsandbytes. swarmp2p itself runs from the source tree (PYTHONPATH), so no wheel of it.
# Versions: the ones this checkout's .venv runs (its tests ran with them), else the newest.
# bitsandbytes ships a library per CUDA and ROCm release (43 MB zipped, 129 MB unpacked): the
# wheel is re-packed with its Python files, the CPU library and the CUDA 13.0 one only (the
# build torch 2.11+cu130 loads), so the tree that travels stays far under 64 MiB.
set -euo pipefail
cd "$(dirname "$0")/.."
DEST=${GPU_WHEELS:-.gpu-wheels}
CUDA_LIB=${GPU_BNB_CUDA:-cuda130}
PY=.venv/bin/python
[ -x "$PY" ] || PY=python3
PACKAGES=(pyzmq zeroconf ifaddr spake2 cryptography cffi pycparser gguf bitsandbytes)

pin() {  # NAME==VERSION of the venv's copy, or NAME
    local v
    v=$("$PY" -c "import importlib.metadata as m, sys
try: print(m.version(sys.argv[1]))
except m.PackageNotFoundError: pass" "$1")
    if [ -n "$v" ]; then echo "$1==$v"; else echo "$1"; fi
}

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
specs=()
for p in "${PACKAGES[@]}"; do specs+=("$(pin "$p")"); done
platforms=()
for n in 17 24 27 28 31 34; do platforms+=(--platform "manylinux_2_${n}_x86_64"); done
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --abi cp312 --abi abi3 --abi none "${platforms[@]}" \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d "$tmp" "${specs[@]}"

"$PY" - "$tmp" "$CUDA_LIB" <<'EOF'
"""Re-pack bitsandbytes with its Python files, the CPU library and one CUDA library."""
import base64, hashlib, pathlib, re, sys, zipfile

folder, keep = pathlib.Path(sys.argv[1]), sys.argv[2]
for wheel in folder.glob("bitsandbytes-*.whl"):
    out = wheel.with_suffix(".trimmed")
    libs = re.compile(r"bitsandbytes/libbitsandbytes_(.+)\.(so|dll|dylib)$")
    with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as dst:
        names = [n for n in src.namelist() if not (m := libs.match(n)) or m[1] in ("cpu", keep)]
        if not any(n.endswith(f"_{keep}.so") for n in names):
            sys.exit(f"{wheel.name} has no libbitsandbytes_{keep}.so; pick GPU_BNB_CUDA")
        record = next(n for n in names if n.endswith(".dist-info/RECORD"))
        rows = []
        for name in names:
            if name == record:
                continue
            data = src.read(name)
            dst.writestr(src.getinfo(name), data)
            digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=")
            rows.append(f"{name},sha256={digest.decode()},{len(data)}")
        dst.writestr(record, "\n".join([*rows, f"{record},,"]) + "\n")
    out.replace(wheel)
EOF

rm -rf "$DEST"
mkdir -p "$DEST"
mv "$tmp"/*.whl "$DEST"/
ls -l "$DEST" | awk 'NR > 1 {printf "%9d  %s\n", $5, $9}'
du -sb "$DEST" | awk '{printf "%9d  total (%.1f MiB)\n", $1, $1 / 1048576}'
