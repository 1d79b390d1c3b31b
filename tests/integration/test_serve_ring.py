"""Serving rings of real stage worker processes over loopback CURVE ZmqLinks."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit" / "runtime"))  # tiny_models
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit" / "serve"))  # ring_helpers

from swarmp2p.serve import GREEDY, GenerationError
from swarmp2p.serve.local import LocalRing, WorkerFailed

pytestmark = [pytest.mark.torch, pytest.mark.slow]

PROMPT = [5, 17, 99, 3, 64, 21, 8]
NEW = 10


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from tiny_models import SHARD_SIZE, build_model, load_whole

    made = {}

    def get(family):
        if family not in made:
            folder = tmp_path_factory.mktemp(family)
            build_model(family).save_pretrained(folder, max_shard_size=SHARD_SIZE)
            made[family] = (folder, load_whole(folder))
        return made[family]

    return get


@pytest.mark.parametrize(
    ("family", "bounds", "compression"),
    [
        ("llama", [(0, 1), (1, 3), (3, 4)], ["fixed_int8", "fixed_int8"]),
        ("qwen3_5", [(0, 1), (1, 3), (3, 4)], ["none", "fixed_int8"]),
        ("qwen3_moe", [(0, 2), (2, 4)], ["fixed_int8"]),
    ],
    ids=["llama-3-int8", "qwen3_5-3", "qwen3_moe-2-int8"],
)
def test_worker_ring_greedy_equals_generate(family, bounds, compression, tiny):
    from ring_helpers import reference_generate

    folder, model = tiny(family)
    cuts = [a for a, _ in bounds[1:]]
    want = reference_generate(model, PROMPT, NEW, cuts=cuts, compression=compression)
    # codes on the first boundary, in the graph on the second: both paths in one ring
    codes = [True, False][: len(compression)]
    with LocalRing(
        str(folder), bounds=bounds, compression=compression, codes=codes, threads=1
    ) as ring:
        got = ring.client.generate(
            PROMPT, max_tokens=NEW, sampling=GREEDY, stop_ids=[2], timeout=60
        )
    assert got == want


@pytest.mark.parametrize(
    ("family", "bounds"),
    [("llama", [(0, 1), (1, 3), (3, 4)]), ("qwen3_5", [(0, 2), (2, 4)])],
    ids=["llama-3", "qwen3_5-2"],
)
def test_worker_ring_batches_eight_sessions_each_to_its_solo_output(family, bounds, tiny):
    """Continuous batching across worker processes: eight sessions of different prompt and
    output lengths, three of them joining mid-batch, each equal to its solo run."""
    from ring_helpers import reference_generate

    folder, model = tiny(family)
    prompts = [[5 + i * 7 % 100 for i in range(n)] for n in (1, 3, 14, 6, 9, 2, 11, 5)]
    budgets = [10, 6, 12, 8, 4, 11, 7, 9]
    with LocalRing(str(folder), bounds=bounds, threads=1) as ring:
        client = ring.client
        solo = [client.generate(p, max_tokens=n, timeout=60) for p, n in zip(prompts, budgets)]
        first = [client.submit(p, max_tokens=n) for p, n in zip(prompts[:5], budgets[:5])]
        while len(first[0].tokens) < 3 and not first[0].done.is_set():
            first[0].done.wait(0.002)
        later = [client.submit(p, max_tokens=n) for p, n in zip(prompts[5:], budgets[5:])]
        together = [s.result(60) for s in first + later]
        assert client.stages == len(bounds)
    assert together == solo
    assert solo[2] == reference_generate(model, prompts[2], budgets[2])


def test_worker_ring_with_a_draft_model_at_stage_0_keeps_greedy_output(tiny, tmp_path):
    """Stage 0's worker loads a draft model folder (the target itself: every draft kept) and
    the ring's greedy tokens are generate's; the plan prices the draft on stage 0 only; a
    draft folder of another vocabulary is refused, naming both, before any worker starts."""
    import json

    from ring_helpers import reference_generate

    folder, model = tiny("llama")
    want = reference_generate(model, PROMPT, NEW)
    with LocalRing(
        str(folder), bounds=[(0, 2), (2, 4)], threads=1, speculate="draft", draft=str(folder)
    ) as ring:
        got = ring.client.generate(PROMPT, max_tokens=NEW, timeout=60)
        stats = ring.client.spec_stats()
        memory = [s.memory.draft for s in ring.plan.stages]
    assert got == want
    assert stats["drafted"] > 0 and stats["accepted"] == stats["drafted"], stats
    assert memory[0] > 0 and memory[1] == 0
    other = tmp_path / "other"
    other.mkdir()
    config = json.loads((folder / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "vocab_size": 256}))
    with pytest.raises(ValueError, match=r"draft model .*other.*vocab_size 256.*vocab_size 128"):
        LocalRing(str(folder), bounds=[(0, 4)], threads=1, speculate="draft", draft=str(other))


def test_a_killed_stage_fails_the_request_within_the_step_timeout(tiny):
    folder, _ = tiny("llama")
    with LocalRing(str(folder), bounds=[(0, 4)], threads=1, step_timeout=2.0) as ring:
        assert ring.client.generate(PROMPT, max_tokens=2, timeout=60)
        os.kill(ring.workers[0].proc.pid, signal.SIGKILL)
        assert ring.wait_exit(0) == "killed by SIGKILL"
        started = time.monotonic()
        with pytest.raises(GenerationError, match="no token from the ring within 2 s"):
            ring.client.generate(PROMPT, max_tokens=2, timeout=30)
        assert time.monotonic() - started < 10


def test_a_stage_that_cannot_load_is_reported_with_its_reason(tiny, tmp_path):
    import shutil

    folder, _ = tiny("llama")
    broken = shutil.copytree(folder, tmp_path / "broken")
    for weights in broken.glob("*.safetensors"):  # the header (the plan's shape) is intact
        data = weights.read_bytes()
        weights.write_bytes(data[: 8 + int.from_bytes(data[:8], "little") + 16])
    with pytest.raises(WorkerFailed, match=r"(?s)stage 0 .*exited with code 1.*"):
        LocalRing(str(broken), bounds=[(0, 4)], threads=1)


def test_serve_local_answers_over_http_until_stopped():
    import socket
    import threading

    from swarmp2p.serve.client import complete_text
    from swarmp2p.serve.local import serve_local

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ready, stop = threading.Event(), threading.Event()
    failure = []

    def run():
        try:
            serve_local("embedded", port=port, max_context=128, threads=1, ready=ready, stop=stop)
        except BaseException as e:
            failure.append(e)
            ready.set()

    thread = threading.Thread(target=run)
    thread.start()
    try:
        assert ready.wait(120) and not failure, failure
        text, usage = complete_text(
            f"http://127.0.0.1:{port}",
            "/v1/completions",
            {
                "model": "embedded",
                "prompt": "The capital of France is",
                "max_tokens": 4,
                "temperature": 0,
            },
        )
        assert "Paris" in text
        assert usage["completion_tokens"] == 4
    finally:
        stop.set()
        thread.join(60)
