"""`swarm train` on real hosts in network namespaces, each with its own disk: a 3-stage LoRA
job whose model folder and data file exist only on the submitting follower, exported on
another host and served on a third; a stage host and the leader SIGKILLed mid-run; a job
waiting for a capable device; a bad job."""

from __future__ import annotations

import json
import os
import signal
import sys
import time

import _tiny
import pytest
from hosts import HOME, STATE
from swarm_harness import agreed_on, dump, swarm, wait_until, worker_pids

from swarmp2p.net.security import SwarmSecret
from swarmp2p.node.training.jobs import resume_step

pytestmark = [pytest.mark.system, pytest.mark.slow, pytest.mark.torch]

VOCAB = 128
ENV = {"OMP_NUM_THREADS": "1"}
"""Every host shares this machine's cores: one torch thread per stage worker."""
MODEL = f"{HOME}/models/tiny"
"""Where the submitting host keeps the model (no other host has it)."""


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    """A tiny Llama with a word-level tokenizer, made here; a test puts it on one host."""
    return _tiny.tiny_llama(tmp_path_factory.mktemp("tiny-llama"), vocab=VOCAB, layers=6)


def _job(model, name="tiny", stages=3, data="random", **train):
    """A LoRA job on the tiny Llama: no dropout, so a resumed step repeats bit for bit."""
    return {
        "name": name,
        "model": {
            "pretrained": str(model),
            "lora": {"enabled": True, "r": 4, "alpha": 8, "dropout": 0.0},
        },
        "split": {"stages": stages, "mode": "equal"},
        "data": {"source": data},
        "train": {
            "steps": 6,
            "batch_size": 4,
            "seq_len": 8,
            "micro_batches": 2,
            "lr": 0.01,
            "eval_batches": 2,
            "checkpoint_every": 0,
            **train,
        },
    }


def _write(node, data, name="job.json"):
    """A job file on ``node``'s host (its HOME); its path there."""
    return node.host.write(f"{HOME}/{name}", json.dumps(data))


def _start(hosts, ids, token, env=None):
    nodes = [h.swarm_up(i, token, env={**ENV, **(env or {})}) for h, i in zip(hosts, ids)]
    for n in nodes:
        n.start()
    leader = min(ids)
    try:
        wait_until(lambda: agreed_on(nodes, leader, len(nodes)), 30, "the hosts to agree")
        by_id = dict(zip(ids, nodes))
        wait_until(lambda: by_id[leader].status()["leader_ready"], 15, "the leader to be ready")
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{dump(nodes)}") from None
    return nodes


def _show(node, job_id):
    out = swarm(node, "jobs", "show", job_id, "--json", timeout=30)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def _submit(node, job_file):
    out = swarm(node, "train", str(job_file), "--detach", "--json")
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)["job_id"]


def _workers_of(node) -> list[int]:
    """Live stage worker processes whose parent is ``node``'s daemon."""
    return sorted(worker_pids(node))


def _raw(node, job_id):
    """The job's table entry straight from the daemon's API (faster than the CLI)."""
    return next(j for j in node.status()["jobs"] if j["job_id"] == job_id)


def _entry(node, job_id):
    """The job's table entry as a record (``JobEntry``) from the daemon's status."""
    from swarmp2p.node.table.jobtable import JobEntry
    from swarmp2p.schema import parse

    raw = _raw(node, job_id)
    record = {k: v for k, v in raw["record"].items() if k not in ("kind", "name", "metrics")}
    return parse(
        JobEntry, {**record, "job_id": job_id, "state": raw["state"], "version": raw["version"]}
    )


def _wait_state(node, job_id, states, timeout, nodes):
    try:
        return wait_until(
            lambda: (v := _show(node, job_id))["state"] in states and v,
            timeout,
            f"job {job_id} to reach {states}",
            interval=0.2,
        )
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{dump(nodes)}") from None


def _fetched(node, digest_dirs=True) -> set[str]:
    """The model files ``node`` fetched into its content-addressed cache."""
    root = node.host.outside(f"{STATE}/models")
    return {p.name for p in root.glob("*/*") if p.is_file()} if root.is_dir() else set()


def test_inputs_on_a_follower_only_train_export_on_another_serve_on_a_third(
    netns_lab, tiny_llama, tmp_path
):
    hosts = netns_lab(3)
    a, b, c = _start(hosts, ["a", "b", "c"], SwarmSecret.generate().token)

    bad = _write(
        c,
        {
            "model": {"pretrained": MODEL, "lora": {"r": 0}},
            "train": {"steps": 0, "schedule": "zigzag"},
        },
        "bad.json",
    )
    out = swarm(c, "train", bad)
    assert out.returncode == 2
    for path in ("model.lora.r", "train.steps", "train.schedule"):
        assert path in out.stderr, out.stderr
    missing = swarm(c, "train", _write(c, _job(MODEL)))  # the model is not on c's disk
    assert missing.returncode == 2 and MODEL in missing.stderr, missing.stderr
    assert a.status()["jobs"] == []  # nothing submitted

    # the model folder and the data file exist only on b, named relative to its CLI's folder
    b.host.put(tiny_llama, MODEL)
    b.host.write(f"{HOME}/data/corpus.txt", _tiny.corpus())
    job = _job("models/tiny", data="data/corpus.txt")
    out = swarm(b, "train", _write(b, job), "--json", cwd=HOME)  # b follows; a leads
    assert out.returncode == 0, out.stdout + out.stderr + dump([a, b, c])
    view = json.loads(out.stdout)
    assert view["state"] == "COMPLETED", view
    assert [s["node"] for s in view["plan"]["stages"]] == ["a", "b", "c"]
    assert [s["layers"] for s in view["plan"]["stages"]] == [[0, 2], [2, 4], [4, 6]]
    assert set(view["evaluation"]) == {"base", "trained"}
    assert view["evaluation"]["trained"]["loss"] != view["evaluation"]["base"]["loss"]
    # each stage node fetched only what its stage reads; the data went to stage 0's node only
    record = _raw(b, view["id"])["record"]
    planned = {s["node_id"]: set(s["files"]) for s in record["plan"]["stages"]}
    weights = _tiny.weight_files(tiny_llama)
    for node in (a, c):
        got = _fetched(node)
        assert got & weights == planned[node.node_id], (node.node_id, sorted(got))
        assert {"config.json", "tokenizer.json"} <= got
    assert _fetched(b) == set()  # the submitter reads its own folder
    assert len(list(a.host.outside(f"{STATE}/inputs").glob("*.txt"))) == 1
    assert not c.host.outside(f"{STATE}/inputs").exists()

    models = json.loads(swarm(b, "models", "--json").stdout)
    assert [(m["id"], m["job_id"]) for m in models] == [("tiny", view["id"])]

    done = swarm(c, "export", "tiny", "--out", f"{HOME}/export")  # on c's disk
    assert done.returncode == 0, done.stderr

    import torch
    from transformers import AutoModelForCausalLM

    from swarmp2p.runtime.torch.train.export import reconstruct_from_shards

    exported = AutoModelForCausalLM.from_pretrained(c.host.outside(f"{HOME}/export")).eval()
    shards = [
        n.host.outside(f"{STATE}/jobs/{view['id']}/export/stage-{i}")
        for i, n in enumerate((a, b, c))
    ]
    rebuilt = reconstruct_from_shards(tiny_llama, shards).eval()
    ids = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(exported(ids).logits, rebuilt(ids).logits)

    # a serves the trained model: its base's files come from b, its shards from their holders
    served = swarm(
        a,
        "serve",
        "tiny",
        "--name",
        "tuned",
        "--stages",
        "3",
        "--port",
        "8080",
        "--max-context",
        "64",
        "--json",
        timeout=600,
    )
    assert served.returncode == 0, served.stdout + served.stderr + dump([a, b, c])
    url = json.loads(served.stdout)["url"]
    said = a.host.run(
        [
            sys.executable,
            "-m",
            "swarmp2p",
            "generate",
            "tuned",
            "w1 w2 w3",
            "--max-tokens",
            "5",
            "--temperature",
            "0",
            "--url",
            url,
        ],
        timeout=120,
    )
    assert said.returncode == 0 and said.stdout.strip(), said.stderr


CHECKPOINT_EVERY = 10
STEPS = 60
"""Of a job killed mid-run: frozen a few steps past its first snapshot, it resumes from that
snapshot and runs to the end (300 steps ran ~250 of them after the resume, for nothing)."""


def _kill_mid_run(
    netns_lab, tiny_llama, ids, stages, victim_is_leader, full=False, schedule="auto"
):
    hosts = netns_lab(len(ids))
    nodes = _start(hosts, ids, SwarmSecret.generate().token)
    by_id = {n.node_id: n for n in nodes}
    steps = STEPS
    job = _job(
        MODEL,
        stages=stages,
        steps=steps,
        checkpoint_every=CHECKPOINT_EVERY,
        eval_batches=0,
        batch_size=8,
        seq_len=32,
        schedule=schedule,
    )
    if full:
        job["model"]["lora"] = {"enabled": False}
    watcher = by_id[ids[-1]]
    watcher.host.put(tiny_llama, MODEL)  # only the submitting host has the model
    job_id = _submit(watcher, _write(watcher, job))
    entry = wait_until(
        lambda: (e := _raw(watcher, job_id))["state"] == "running" and e, 120, "the job to run"
    )
    stage_nodes = [s["node_id"] for s in entry["record"]["plan"]["stages"]]
    victim = "a" if victim_is_leader else next(n for n in stage_nodes if n != "a")
    replanned = victim in stage_nodes
    # freeze a stage past the first snapshot, so the job cannot end however fast this machine
    # is: the victim's own stage, or (when the victim runs none) the first stage until the kill
    # has been noticed. A snapshot enters the table at once (the step count only every
    # progress_every_s), so the freeze comes a few steps past it and STEPS need not outlast that
    wait_until(
        lambda: resume_step(_entry(watcher, job_id)) >= CHECKPOINT_EVERY,
        120,
        "a snapshot of every stage",
        interval=0.05,
    )
    frozen = _workers_of(by_id[victim if replanned else stage_nodes[0]])
    assert frozen, "no stage worker to freeze"
    for pid in frozen:
        os.kill(pid, signal.SIGSTOP)
    wait_until(
        lambda: resume_step(_entry(watcher, job_id), copies=2),
        60,
        "a snapshot copy of every stage",
        interval=0.1,
    )
    before = _raw(watcher, job_id)
    assert before["state"] == "running" and before["record"]["step"] < steps
    by_id[victim].kill()
    if not replanned:
        survivors = [n for i, n in by_id.items() if i != victim]
        wait_until(
            lambda: (
                agreed_on(survivors, "b", len(survivors)) and by_id["b"].status()["leader_ready"]
            ),
            30,
            "b to lead",
        )
        for pid in frozen:
            os.kill(pid, signal.SIGCONT)
    final = _wait_state(watcher, job_id, ("COMPLETED", "FAILED"), 150, nodes)
    assert final["state"] == "COMPLETED", json.dumps(final, indent=1)
    t0 = final["history"][0]["at"]
    print("\nhistory:", [(h["state"], round(h["at"] - t0, 1)) for h in final["history"]])
    states = [h["state"] for h in final["history"]]
    assert victim not in [s["node"] for s in final["plan"]["stages"]]
    if not replanned:  # the leader ran no stage: its workers never stopped
        assert "resuming" not in states and final["attempt"] == 1
        return by_id, victim, final
    assert "resuming" in states and final["attempt"] == 2
    if schedule != "auto":  # the resumed attempt runs the schedule the job named
        assert final["plan"]["schedule"] == schedule
    losses = {}
    for attempt, step, loss, _tokens_per_s in final["metrics"]["losses"]:
        losses.setdefault(attempt, {})[step] = loss
    # the loss curve lives on the leader, off the table: a killed leader's copy of attempt
    # 1 is gone with it (the new leader's curve starts at the resume)
    first, second = losses.get(1, {}), losses[2]
    assert first or victim_is_leader
    resumed_from = min(second)
    assert resumed_from > 0 and resumed_from % CHECKPOINT_EVERY == 0  # a snapshot, not scratch
    assert max(second) == steps - 1
    for step in set(first) & set(second):  # re-run steps give the same loss
        assert second[step] == pytest.approx(first[step], abs=1e-5), step
    return by_id, victim, final


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_sigkill_a_stage_host_resumes_from_the_last_snapshot(netns_lab, tiny_llama, schedule):
    _kill_mid_run(netns_lab, tiny_llama, ["a", "b", "c", "d"], 3, False, schedule=schedule)


def test_sigkill_the_leader_the_new_leader_finishes_the_job(netns_lab, tiny_llama):
    by_id, _, _ = _kill_mid_run(netns_lab, tiny_llama, ["a", "b", "c"], 2, True)
    assert by_id["c"].status()["leader"] == "b"


@pytest.mark.parametrize("schedule", ["auto", "zb-h2"])
def test_sigkill_a_stage_host_of_a_full_fine_tune_re_splits_it_over_the_two_left(
    netns_lab, tiny_llama, schedule
):
    """3 stages on 3 hosts, one killed: the 2 left hold the model, so the job goes on in 2
    stages, from the newest snapshot re-sliced by global block index (its loss continues)."""
    by_id, victim, final = _kill_mid_run(
        netns_lab, tiny_llama, ["a", "b", "c"], "auto", False, full=True, schedule=schedule
    )
    assert victim == "b" and [s["node"] for s in final["plan"]["stages"]] == ["a", "c"]
    assert [s["layers"] for s in final["plan"]["stages"]] == [[0, 3], [3, 6]]
    record = _raw(by_id["c"], final["id"])["record"]
    assert [r["layers"] for r in record["resplit"]] == [[0, 2], [2, 4], [4, 6]]
    logs = "".join(by_id[n].log() for n in ("a", "c"))
    assert "re-sliced from" in logs


def test_a_job_no_device_can_run_waits_until_a_capable_node_joins(netns_lab, tiny_llama, tmp_path):
    hosts = netns_lab(3)
    token = SwarmSecret.generate().token
    nodes = _start(hosts[:2], ["a", "b"], token)
    job = _job(MODEL, stages=2, steps=2, eval_batches=0)
    job["model"]["dtype"] = "float16"
    nodes[1].host.put(tiny_llama, MODEL)
    job_id = _submit(nodes[1], _write(nodes[1], job))
    # PENDING from its submission, with no reason until the leader has tried to place it
    view = wait_until(lambda: (v := _show(nodes[0], job_id))["reason"] and v, 30, "a reason")
    assert view["state"] == "PENDING", json.dumps(view, indent=1)
    assert "dtype float16" in view["reason"] and view["plan"]["stages"] == []
    time.sleep(1.0)
    assert _show(nodes[0], job_id)["state"] == "PENDING"  # still waiting, nothing started

    gpu = hosts[2].swarm_up("c", token, env={"SWARM_FAKE_DEVICES": "A5000:24:8.6,A5000:24:8.6"})
    gpu.start()
    final = _wait_state(nodes[0], job_id, ("COMPLETED", "FAILED"), 120, [*nodes, gpu])
    assert final["state"] == "COMPLETED", json.dumps(final, indent=1)
    assert [s["node"] for s in final["plan"]["stages"]] == ["c", "c"]
    assert final["plan"]["dtype"] == "float16"
