"""The command line's contract: the generated reference matches every command's --help, every
option is explained, every command has its exit codes and --json where it prints state or a
result, no daemon exits 4, and --version names the commit."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import click
import click.testing
import pytest

import swarmp2p
from swarmp2p.cli import _exit, _reference, main

ROOT = Path(__file__).resolve().parents[3]
COMMANDS = dict(_reference.commands())
PRINTS_NOTHING_TO_PARSE = {"chat"}
"""Interactive: a conversation, not a result."""


def _swarm(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "swarmp2p", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})},
    )


def test_the_command_reference_matches_every_commands_help():
    """docs/commands.md holds each command's --help verbatim: regenerate it when this fails."""
    document = _reference.DOC.read_text(encoding="utf-8")
    assert _reference.render(document) == document, (
        "docs/commands.md differs from the commands: run `python -m swarmp2p.cli._reference`"
    )
    for path in COMMANDS:
        assert f"### swarm {path}\n" in document
        assert _reference.help_text(path).splitlines()[0] in document


def test_the_check_mode_fails_on_a_drifted_file(tmp_path, monkeypatch):
    drifted = tmp_path / "commands.md"
    text = _reference.DOC.read_text(encoding="utf-8")
    drifted.write_text(text.replace("Show this message and exit.", "Show it.", 1))
    monkeypatch.setattr(_reference, "DOC", drifted)
    assert _reference.main_(["--check"]) == 1
    assert _reference.main_([]) == 0 and _reference.main_(["--check"]) == 0
    assert drifted.read_text() == text


def test_every_command_has_its_exit_codes_and_every_option_a_help():
    assert set(_exit.COMMAND_CODES) == set(COMMANDS)
    for path, codes in _exit.COMMAND_CODES.items():
        assert codes[0] == _exit.OK and set(codes) <= set(_exit.MEANING), path
    for path, cmd in COMMANDS.items():
        assert cmd.help, f"swarm {path} has no help"
        for p in cmd.params:
            if isinstance(p, click.Option):
                assert p.help, f"swarm {path} {p.opts[0]} has no help"


def test_every_command_that_prints_state_or_a_result_takes_json():
    lacking = [
        path
        for path, cmd in COMMANDS.items()
        if path not in PRINTS_NOTHING_TO_PARSE
        and not any(isinstance(p, click.Option) and "--json" in p.opts for p in cmd.params)
    ]
    assert lacking == []


@pytest.mark.parametrize(
    "args",
    [
        ["status"],
        ["peers"],
        ["down"],
        ["jobs"],
        ["jobs", "show", "j1"],
        ["jobs", "cancel", "j1"],
        ["jobs", "logs", "j1"],
        ["models"],
        ["dashboard"],
        ["serve", "embedded"],
        ["train", str(ROOT / "examples" / "demo-job.json")],
    ],
)
def test_no_daemon_exits_4_naming_the_state_dir(tmp_path, args):
    """4, not 1: a script tells "no daemon here" from "the job failed"."""
    result = click.testing.CliRunner().invoke(main, [*args, "--state-dir", str(tmp_path)])
    assert result.exit_code == _exit.NO_DAEMON, result.output
    assert f"no swarm daemon is running for {tmp_path}" in result.output


def test_version_names_the_release_the_commit_and_the_protocol():
    out = _swarm("--version")
    assert out.returncode == 0, out.stderr
    line = out.stdout.strip()
    assert line.startswith(f"swarm {swarmp2p.__version__} (commit ")
    assert line.endswith(f", protocol {swarmp2p.PROTOCOL_VERSION})")
    commit = re.search(r"\(commit (\S+),", line).group(1)
    head = subprocess.run(
        ["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True
    ).stdout.strip()
    if swarmp2p.__commit__:  # built from this checkout: the commit is a prefix of a real one
        assert commit == swarmp2p.__commit__ and re.fullmatch(r"[0-9a-f]{7,40}", commit)
        if head:
            known = subprocess.run(
                ["git", "cat-file", "-e", f"{commit}^{{commit}}"], cwd=ROOT, capture_output=True
            )
            assert known.returncode == 0, f"commit {commit} is not in this repository"
    else:
        assert commit == "unknown"


def test_jobs_show_prints_local_times_and_json_keeps_epoch():
    from swarmp2p.cli._jobs import when

    epoch = 1_700_000_000.25
    text = when(epoch)
    assert re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d \S+", text), text
    assert text.startswith(time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(epoch)))


def test_train_flags_are_validated_as_the_job_fields_they_set(tmp_path):
    """--steps and --eval-batches: a bad value exits 2 naming its field, before any daemon."""
    job = str(ROOT / "examples" / "demo-job.json")
    result = click.testing.CliRunner().invoke(
        main, ["train", job, "--eval-batches", "-1", "--steps", "0", "--state-dir", str(tmp_path)]
    )
    assert result.exit_code == _exit.INVALID, result.output
    assert "train.eval_batches" in result.output and "train.steps" in result.output


def test_generate_refuses_json_with_stream():
    result = click.testing.CliRunner().invoke(main, ["generate", "m", "p", "--json", "--stream"])
    assert result.exit_code == _exit.INVALID and "leave --stream out" in result.output


@pytest.mark.parametrize("mode", ["0777x", "0200", "1777", "9"])
def test_export_refuses_a_bad_mode(tmp_path, mode):
    result = click.testing.CliRunner().invoke(
        main, ["export", "m", "--out", str(tmp_path / "o"), "--mode", mode]
    )
    assert result.exit_code == _exit.INVALID and "--mode" in result.output
    assert not (tmp_path / "o").exists()


def test_status_names_version_skew_and_the_runtime_fix():
    from swarmp2p.cli._node import health_lines, no_runtime_message

    me = {"node_id": "a", "name": "a", "alive": True, "version": "1.0", "capabilities": []}
    b = {"node_id": "b", "name": "b", "alive": True, "version": "1.1", "capabilities": []}
    status = {"node_id": "a", "version": "1.0", "peers": [me, b]}
    lines = health_lines(status)
    assert lines[0].startswith("versions  this node runs 1.0; b runs 1.1")
    assert "no node can run a stage: no torch runtime on a, b" in lines[1]
    assert lines[2].startswith("fix ") and "install.sh" in lines[2]  # this dev checkout's
    assert "./install.sh --dev" in no_runtime_message(status)
    able = {**b, "version": "1.0", "capabilities": ["lora"]}
    assert health_lines({**status, "peers": [me, able]}) == [
        "runtime   coordinators only (no torch runtime): a"
    ]
    assert json.dumps(health_lines({**status, "peers": [{**me, "capabilities": ["x"]}]})) == "[]"


@pytest.mark.parametrize("command", [["serve", "embedded"], ["generate", "m", "hi"], ["chat", "m"]])
def test_an_api_key_in_the_command_line_is_refused_and_not_echoed(command, tmp_path):
    """`--api-key KEY` would put the key in argv, where `ps` shows it (issue 24): refused
    before anything runs, naming the ways that work, without echoing the key."""
    runner = click.testing.CliRunner()
    env = {"SWARM_API_KEY": None, "SWARM_STATE_DIR": str(tmp_path)}
    got = runner.invoke(main, [*command, "--api-key", "s3cret-k3y"], env=env)
    assert got.exit_code == _exit.INVALID, got.output
    assert "readable by every local user with `ps`" in got.output
    assert "SWARM_API_KEY" in got.output and "--api-key-file" in got.output
    assert "s3cret-k3y" not in got.output


def test_the_api_key_is_read_from_stdin_a_private_file_or_the_environment(tmp_path, monkeypatch):
    from swarmp2p.cli import _read_api_key

    file = tmp_path / "key"
    file.write_text("k3y\n")
    file.chmod(0o600)
    monkeypatch.delenv("SWARM_API_KEY", raising=False)
    assert _read_api_key(None, str(file)) == "k3y"
    assert _read_api_key(None, None) is None
    monkeypatch.setenv("SWARM_API_KEY", " k3y\n")
    assert _read_api_key(None, None) == "k3y"
    monkeypatch.delenv("SWARM_API_KEY")
    file.chmod(0o644)
    with pytest.raises(click.ClickException, match="chmod 600") as got:
        _read_api_key(None, str(file))
    assert got.value.exit_code == _exit.INVALID
    runner = click.testing.CliRunner()
    # stdin: the key goes to the server, so an unreachable one is the error, not the key
    out = runner.invoke(
        main,
        ["generate", "m", "hi", "--url", "http://127.0.0.1:9", "--api-key", "-"],
        input="k3y\n",
    )
    assert out.exit_code != 0 and "cannot reach the swarm API" in out.output, out.output
    out = runner.invoke(
        main,
        ["generate", "m", "hi", "--api-key", "-", "--api-key-file", str(file)],
        input="k3y\n",
        env={"SWARM_API_KEY": None},
    )
    assert out.exit_code == _exit.INVALID and "given twice" in out.output, out.output
