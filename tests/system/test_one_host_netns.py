"""One machine alone, as a new user starts: `swarm up` (the background daemon) on a host with
its own disk, then `swarm train examples/lora.json` completes in one stage (the embedded model
converted there on first use), and `swarm down`."""

from __future__ import annotations

import json
import sys

import pytest
from swarm_harness import ROOT

pytestmark = [pytest.mark.system, pytest.mark.slow, pytest.mark.torch]


@pytest.mark.timeout(1500)
def test_swarm_up_then_train_the_example_on_one_host(netns_lab):
    import time

    t0 = time.monotonic()
    (host,) = netns_lab(1)
    swarm = [sys.executable, "-m", "swarmp2p"]
    env = {"OMP_NUM_THREADS": "2"}
    up = host.run([*swarm, "up", "--json"], env=env, timeout=120)
    assert up.returncode == 0, up.stdout + up.stderr
    try:
        # one step and one held-out batch per evaluation: what runs is the example's whole
        # path (convert, tokenize, evaluate, train, evaluate, export merged, register), not its
        # length
        out = host.run(
            [
                *swarm,
                "train",
                "examples/lora.json",
                "--steps",
                "1",
                "--eval-batches",
                "1",
                "--json",
            ],
            cwd=ROOT,
            env=env,
            timeout=1200,
        )
        assert out.returncode == 0, out.stdout + out.stderr
        view = json.loads(out.stdout)
        print(
            f"\ntrain took {time.monotonic() - t0:.0f} s:",
            [(h["state"], round(h["at"] - view["history"][0]["at"])) for h in view["history"]],
        )
        assert view["state"] == "COMPLETED", view
        assert len(view["plan"]["stages"]) == 1 and view["plan"]["stages"][0]["layers"] == [0, 30]
        assert set(view["evaluation"]) == {"base", "trained"}, view["evaluation"]
        assert all(e["tokens"] == 4 * 128 for e in view["evaluation"].values())  # 1 batch
        models = json.loads(host.run([*swarm, "models", "--json"]).stdout)
        assert [m["id"] for m in models] == ["smollm2-lora"]
    finally:
        down = host.run([*swarm, "down"], timeout=60)
        assert down.returncode == 0, down.stderr
