"""swarmp2p.serve is light: importing any of it in a fresh interpreter loads no torch."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from swarmp2p.serve.api import check_bind

PROBE = r"""
import importlib, json, pkgutil, sys
import swarmp2p.serve as pkg
names = [info.name for info in pkgutil.walk_packages(pkg.__path__, "swarmp2p.serve.")]
for name in names:
    importlib.import_module(name)
heavy = [m for m in ("torch", "transformers", "peft", "accelerate", "bitsandbytes") if m in sys.modules]
print(json.dumps({"names": names, "heavy": heavy}))
"""


def test_serve_package_imports_no_torch():
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert "swarmp2p.serve.api" in result["names"]
    assert result["heavy"] == []


@pytest.mark.parametrize("host", ["127.0.0.1", "::1", "localhost", "127.0.0.5"])
def test_loopback_needs_no_key(host):
    check_bind(host, None)


@pytest.mark.parametrize("host", ["0.0.0.0", "192.168.1.4", "::"])
def test_other_hosts_need_a_key(host):
    with pytest.raises(ValueError, match=r"--api-key - \(stdin\), or set SWARM_API_KEY"):
        check_bind(host, None)
    check_bind(host, "k")


def test_swarm_generate_names_an_unreachable_api():
    import socket

    from click.testing import CliRunner

    from swarmp2p.cli import main

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    result = CliRunner().invoke(main, ["generate", "--url", f"http://127.0.0.1:{port}", "m", "hi"])
    assert result.exit_code == 1
    assert f"cannot reach the swarm API at http://127.0.0.1:{port}" in result.output


def test_the_hosts_a_server_answers_to():
    from swarmp2p.serve.api import _host_name, allowed_hosts

    assert allowed_hosts("127.0.0.1") == {"127.0.0.1", "localhost", "::1"}
    assert allowed_hosts("192.168.1.4") == {"127.0.0.1", "localhost", "::1", "192.168.1.4"}
    assert allowed_hosts("::1", ["box.lan"]) == {"127.0.0.1", "localhost", "::1", "box.lan"}
    assert allowed_hosts("0.0.0.0") is None and allowed_hosts("::") is None
    assert [
        _host_name(h) for h in ("[::1]:8080", "LOCALHOST:80", "127.0.0.1", "evil.example:1")
    ] == ["::1", "localhost", "127.0.0.1", "evil.example"]
