"""install.sh for a user without pipx, in a fresh HOME and a fresh virtual environment: the
`swarm` shim works, the CPU build of torch is pinned, and a second run is a quick no-op for
torch."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from swarmp2p import __version__

ROOT = Path(__file__).resolve().parents[2]
INSTALL_TIMEOUT_S = 1200


def _sources(dest: Path) -> Path:
    """The checkout's files as a fresh clone has them (tracked and not ignored), so the build
    leaves nothing in the checkout."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        check=True,
    ).stdout.split(b"\0")
    for name in filter(None, (n.decode() for n in listed)):
        src = ROOT / name
        if src.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name)
    return dest


def _base_python() -> str:
    """A Python that is no virtual environment's (install.sh makes its own from it)."""
    return getattr(sys, "_base_executable", None) or sys.executable


def _env(home: Path) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("SWARM_", "VIRTUAL_ENV", "PYTHON", "XDG_", "PIPX_"))
    }
    env["HOME"] = str(home)
    env["PATH"] = f"{home / '.local' / 'bin'}:/usr/bin:/bin"  # no pipx, no venv on the path
    env["PYTHON"] = _base_python()
    # pip's wheel cache from the real home: the registries are slow; nothing else is shared
    env["PIP_CACHE_DIR"] = str(Path(os.path.expanduser("~")) / ".cache" / "pip")
    return env


def _run(cmd: list[str], env: dict[str, str], cwd: Path, timeout: float = INSTALL_TIMEOUT_S):
    started = time.monotonic()
    out = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    return out, time.monotonic() - started


@pytest.mark.slow
@pytest.mark.timeout(2 * INSTALL_TIMEOUT_S + 120)
def test_install_in_a_fresh_home_gives_a_working_shim_and_is_idempotent(tmp_path):
    if shutil.which("pipx", path="/usr/bin:/bin"):
        pytest.fail("pipx is on /usr/bin: this test covers the venv + shim path without it")
    if shutil.which("nvidia-smi", path="/usr/bin:/bin"):
        pytest.fail("this test expects a machine without an NVIDIA GPU (a CPU build of torch)")
    src = _sources(tmp_path / "src")
    home = tmp_path / "home"
    home.mkdir()
    env = _env(home)

    first, first_s = _run(["bash", "./install.sh"], env, src)
    assert first.returncode == 0, first.stdout + first.stderr
    venv = home / ".local" / "share" / "swarmp2p" / "venv"
    shim = home / ".local" / "bin" / "swarm"
    assert shim.is_symlink() and shim.resolve() == (venv / "bin" / "swarm").resolve()
    assert "no NVIDIA GPU: installing the CPU build of torch" in first.stderr, first.stderr
    assert "next: swarm demo" in first.stderr, first.stderr  # ~/.local/bin is on this PATH

    version, _ = _run(["swarm", "--version"], env, home, timeout=60)  # found through the shim
    assert version.returncode == 0, version.stderr
    assert version.stdout.strip() == f"swarm, version {__version__}"
    torch = subprocess.run(
        [str(venv / "bin" / "python"), "-c", "import torch; print(torch.__version__)"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert torch.returncode == 0, torch.stderr
    assert torch.stdout.strip().endswith("+cpu"), torch.stdout
    pinned = (venv / "constraints.txt").read_text().strip()
    assert pinned == f"torch=={torch.stdout.strip()}"
    (torch_dir,) = (venv / "lib").glob("python3*/site-packages/torch/__init__.py")
    torch_mtime = torch_dir.stat().st_mtime_ns

    second, second_s = _run(["bash", "./install.sh"], env, src)
    assert second.returncode == 0, second.stdout + second.stderr
    assert f"torch {torch.stdout.strip()} already installed" in second.stderr, second.stderr
    assert torch_dir.stat().st_mtime_ns == torch_mtime, "the second run reinstalled torch"
    assert second_s < max(120.0, first_s / 2), (first_s, second_s)
    again, _ = _run(["swarm", "--version"], env, home, timeout=60)
    assert again.stdout.strip() == f"swarm, version {__version__}"
    print(f"install.sh: first run {first_s:.0f} s, second run {second_s:.0f} s")
