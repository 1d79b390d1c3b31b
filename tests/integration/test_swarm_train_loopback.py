"""`swarm train` end to end on real daemons on 127.0.0.1: plan, dispatch, progress, registry,
export; and a bad job refused with every error listed."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import pytest
from swarm_harness import agreed_on, dump, swarm, tiny_llama, wait_until, worker_pids

from swarmp2p.net.security import SwarmSecret

pytestmark = [pytest.mark.slow, pytest.mark.torch]

TOKEN = SwarmSecret.generate().token
VOCAB = 128
ENV = {"OMP_NUM_THREADS": "1"}  # the daemons share this machine's cores


def _tiny_llama(folder):
    return tiny_llama(folder, vocab=VOCAB)


def _job(model, **train):
    return {
        "name": "tiny",
        "model": {
            "pretrained": str(model),
            "lora": {"enabled": True, "r": 4, "alpha": 8, "dropout": 0.0},
        },
        "split": {"stages": 2},
        "data": {"source": "random"},
        "train": {
            "steps": 4,
            "batch_size": 4,
            "seq_len": 8,
            "micro_batches": 1,
            "lr": 0.01,
            "eval_batches": 2,
            "checkpoint_every": 0,
            **train,
        },
    }


def test_bad_job_exits_2_listing_every_error_and_submits_nothing(loopback_swarm, tmp_path):
    a = loopback_swarm.node("a", token=TOKEN).start()
    a.wait_up()
    bad = tmp_path / "bad.json"
    bad.write_text(
        json.dumps(
            {
                "model": {"pretrained": "x", "lora": {"r": 0}},
                "train": {"steps": -3, "lr": "fast"},
                "typo": 1,
            }
        )
    )
    out = swarm(a, "train", str(bad))
    assert out.returncode == 2, out.stderr
    for path in ("model.lora.r", "train.steps", "train.lr", "typo"):
        assert path in out.stderr, out.stderr
    out = swarm(a, "train", str(bad), "--json")
    errors = json.loads(out.stdout)["errors"]
    assert {e["path"] for e in errors} >= {"model.lora.r", "train.steps", "train.lr", "typo"}
    assert a.status()["jobs"] == []


def test_train_on_two_nodes_completes_registers_and_exports(loopback_swarm, tmp_path):
    model = _tiny_llama(tmp_path / "tiny-llama")
    loopback_swarm.reserve("a", "b")
    a = loopback_swarm.node("a", token=TOKEN, env=ENV)
    b = loopback_swarm.node("b", token=TOKEN, env=ENV)
    for n in (a, b):
        n.start()
    try:
        wait_until(lambda: agreed_on([a, b], "a", 2), 20, "two nodes to agree on a")
        wait_until(lambda: a.status()["leader_ready"], 10, "a to take over")
    except AssertionError:
        raise AssertionError(dump([a, b])) from None
    job_file = tmp_path / "job.json"
    job_file.write_text(json.dumps(_job(model)))

    planned = swarm(b, "train", str(job_file), "--plan", "--json")
    assert planned.returncode == 0, planned.stderr
    plan = json.loads(planned.stdout)
    assert [s["node_id"] for s in plan["stages"]] == ["a", "b"]
    assert all(s["disk_free"] > 0 for s in plan["stages"])
    assert a.status()["jobs"] == []  # --plan submits nothing

    out = swarm(b, "train", str(job_file), "--json")  # a follower's CLI, forwarded to a
    assert out.returncode == 0, out.stdout + out.stderr + dump([a, b])
    view = json.loads(out.stdout)
    assert view["state"] == "COMPLETED" and view["step"] == view["steps"] == 4
    assert [s["layers"] for s in view["plan"]["stages"]] == [[0, 2], [2, 4]]
    states = [h["state"] for h in view["history"]]
    assert states[0] == "pending" and states[-1] == "completed" and "running" in states
    ev = view["evaluation"]
    assert set(ev) == {"base", "trained"}
    assert ev["base"]["tokens"] == 2 * 4 * 8 and ev["trained"]["loss"] != ev["base"]["loss"]
    assert view["model"]["id"] == "tiny"

    show = json.loads(swarm(a, "jobs", "show", view["id"], "--json").stdout)
    assert show["state"] == "COMPLETED" and show["evaluation"] == ev
    listed = json.loads(swarm(a, "jobs", "--json").stdout)
    assert [j["id"] for j in listed] == [view["id"]]
    logs = swarm(a, "jobs", "logs", view["id"], "--stage", "1")
    assert logs.returncode == 0, logs.stderr

    models = json.loads(swarm(a, "models", "--json").stdout)
    assert [(m["id"], m["job_id"], m["base"]) for m in models] == [("tiny", view["id"], str(model))]
    stages = models[0]["manifest"]["stages"]
    assert [s["node"] for s in stages] == ["a", "b"]
    assert all(len(d) == 64 for s in stages for d in s["files"].values())

    out_dir = tmp_path / "exported"
    done = swarm(b, "export", "tiny", "--out", str(out_dir))
    assert done.returncode == 0, done.stderr

    import torch
    from transformers import AutoModelForCausalLM

    from swarmp2p.runtime.torch.train.export import reconstruct_from_shards

    exported = AutoModelForCausalLM.from_pretrained(out_dir).eval()
    shards = [
        a.state.root / "jobs" / view["id"] / "export" / "stage-0",
        b.state.root / "jobs" / view["id"] / "export" / "stage-1",
    ]
    rebuilt = reconstruct_from_shards(model, shards).eval()
    ids = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(exported(ids).logits, rebuilt(ids).logits)
        base = AutoModelForCausalLM.from_pretrained(model).eval()
        assert not torch.allclose(base(ids).logits, exported(ids).logits)  # LoRA moved it


def _two_nodes(loopback_swarm):
    loopback_swarm.reserve("a", "b")
    a = loopback_swarm.node("a", token=TOKEN, env=ENV)
    b = loopback_swarm.node("b", token=TOKEN, env=ENV)
    for n in (a, b):
        n.start()
    wait_until(lambda: agreed_on([a, b], "a", 2), 20, "two nodes to agree on a")
    wait_until(lambda: a.status()["leader_ready"], 10, "a to take over")
    return a, b


def _workers_of(node) -> list[int]:
    """Live stage worker processes whose parent is ``node``'s daemon."""
    return sorted(worker_pids(node))


def _entry(node, job_id):
    return next(j for j in node.status()["jobs"] if j["job_id"] == job_id)


def test_a_missing_data_file_is_refused_where_it_is_submitted(loopback_swarm, tmp_path):
    model = _tiny_llama(tmp_path / "tiny-llama")
    a, b = _two_nodes(loopback_swarm)
    job = _job(model)
    job["data"] = {"source": "missing.npy"}  # relative: to the CLI's working directory
    job_file = tmp_path / "job.json"
    job_file.write_text(json.dumps(job))
    out = swarm(b, "train", str(job_file), cwd=tmp_path)
    assert out.returncode == 2, out.stdout + out.stderr
    assert f"{tmp_path / 'missing.npy'}" in out.stderr and "data.source" in out.stderr
    assert a.status()["jobs"] == []  # nothing submitted


def test_a_failing_stage_fails_the_job_with_stage_node_message_and_stderr(loopback_swarm, tmp_path):
    model = _tiny_llama(tmp_path / "tiny-llama")
    a, b = _two_nodes(loopback_swarm)
    job = _job(model)
    (tmp_path / "broken.npy").write_bytes(b"not token ids")  # ships to stage 0, fails there
    job["data"] = {"source": str(tmp_path / "broken.npy")}
    job_file = tmp_path / "job.json"
    job_file.write_text(json.dumps(job))
    out = swarm(a, "train", str(job_file))  # the progress display, then the error
    assert out.returncode == 1, out.stdout + out.stderr + dump([a, b])
    assert "FAILED" in out.stdout and ".npy" in out.stdout
    job_id = a.status()["jobs"][0]["job_id"]
    view = json.loads(swarm(b, "jobs", "show", job_id, "--json").stdout)
    assert view["state"] == "FAILED" and view["model"] is None
    error = view["error"]
    assert ".npy" in error["message"] and "exited with code 1" in error["message"]
    if error["stage"] == 1:  # stage 1 heard stage 0's abort and reported first (a race)
        assert "stage 0 failed" in error["message"], error
    else:
        assert error["stage"] == 0 and error["node"] == "a"
        assert any("Traceback" in line for line in error["stderr_tail"])
    assert json.loads(swarm(a, "models", "--json").stdout) == []
    logs = swarm(b, "jobs", "logs", job_id, "--stage", "0")  # fetched from node a
    assert logs.returncode == 0 and ".npy" in logs.stdout, logs.stderr


def test_cancel_stops_the_workers_and_the_job_stays_cancelled(loopback_swarm, tmp_path):
    model = _tiny_llama(tmp_path / "tiny-llama")
    a, b = _two_nodes(loopback_swarm)
    job_file = tmp_path / "job.json"
    job_file.write_text(json.dumps(_job(model, steps=100000, eval_batches=0)))
    out = swarm(b, "train", str(job_file), "--detach", "--json")
    job_id = json.loads(out.stdout)["job_id"]
    wait_until(lambda: (_entry(a, job_id)["record"].get("step") or 0) >= 2, 60, "steps")
    out = swarm(b, "jobs", "cancel", job_id)  # from the follower, forwarded to the leader
    assert out.returncode == 0, out.stderr
    assert _entry(a, job_id)["state"] == "cancelled"
    step = _entry(a, job_id)["record"]["step"]
    time.sleep(1.5)
    assert _entry(b, job_id)["state"] == "cancelled"
    assert _entry(a, job_id)["record"]["step"] <= step + 1  # no worker trains on
    assert _workers_of(a) == [] and _workers_of(b) == []
    again = swarm(a, "jobs", "cancel", job_id)
    assert again.returncode != 0 and "already CANCELLED" in again.stderr


def test_a_peer_refuses_a_plan_it_does_not_compute_itself(loopback_swarm, tmp_path):
    """Version skew: node b recomputes the plan from the leader's inputs and refuses another."""
    import asyncio
    import dataclasses

    from swarmp2p.net.auth import AsyncSecureContext
    from swarmp2p.net.rpc import RpcClient, RpcError
    from swarmp2p.node.messages import StageStart
    from swarmp2p.node.records import NodeRecord
    from swarmp2p.node.training.jobs import cluster_records, compute_plan
    from swarmp2p.plan import Node, parse_job

    model = _tiny_llama(tmp_path / "tiny-llama")
    a, b = _two_nodes(loopback_swarm)
    from swarmp2p.client import jobs as job_commands

    job = parse_job(_job(model))
    listed = job_commands.live_plan(a.state.root, job)["cluster"]
    cluster = tuple(Node.from_dict(c) for c in listed)
    assert cluster_records([NodeRecord(node=n) for n in cluster]) == list(cluster)
    plan = compute_plan(job, cluster)
    assert [s.node_id for s in plan.stages] == ["a", "b"]
    skewed = dataclasses.replace(plan, schedule=dataclasses.replace(plan.schedule, micro_batches=3))

    from swarmp2p.net import ClientKeys, NodeKey

    # as the leader a (its own key: only the leader starts a stage), to b
    a_key, b_key = (NodeKey.load(n.state.node_key_file) for n in (a, b))
    as_a = ClientKeys(public=a_key.public, secret=a_key.secret, server=b_key.public)

    async def ask(plan_json):
        ctx = AsyncSecureContext()
        client = RpcClient(ctx, as_a, f"tcp://127.0.0.1:{loopback_swarm.ports['b']}")
        try:
            msg = StageStart(
                job_id="jx",
                attempt=1,
                stage=1,
                job=job,
                cluster=cluster,
                plan=plan_json,
                next="",
                resume_step=0,
                snapshot_nodes=[],
                leader="a",
            )
            return await client.request(msg, 30.0)
        finally:
            await client.close()
            ctx.destroy(linger=0)

    with pytest.raises(RpcError) as refused:
        asyncio.run(ask(skewed))
    assert refused.value.code == "plan_mismatch"
    assert "node b computes a different plan" in refused.value.detail
    assert "same swarmp2p version" in refused.value.detail
    assert _workers_of(b) == []  # nothing started


def _train_json(node, job_file):
    out = swarm(node, "train", str(job_file), "--json", timeout=600)
    return out, json.loads(out.stdout) if out.stdout.strip() else None


def test_a_bfloat16_job_on_fake_ampere_gpus_trains_with_falling_loss(loopback_swarm, tmp_path):
    """Issue 13: through `swarm train`, a job the plan resolves to bfloat16 (fake RTX A5000s;
    the stages run on the CPU in the plan's dtype) trains 20 steps, every loss finite and the
    curve falling. It failed at step 0 before (the held-out pass sent stage 1 float32)."""
    model = _tiny_llama(tmp_path / "tiny-llama")
    loopback_swarm.reserve("a", "b")
    env = {**ENV, "SWARM_FAKE_DEVICES": "A5000:24:8.6"}
    a = loopback_swarm.node("a", token=TOKEN, env=env)
    b = loopback_swarm.node("b", token=TOKEN, env=env)
    for n in (a, b):
        n.start()
    wait_until(lambda: agreed_on([a, b], "a", 2), 20, "two nodes to agree on a")
    wait_until(lambda: a.status()["leader_ready"], 20, "a to lead")
    import numpy as np

    tokens = tmp_path / "pattern.npy"  # a learnable stream: the next id follows from this one
    np.save(tokens, np.tile(np.arange(0, VOCAB, 3, dtype=np.int32), 400))
    job = _job(model, steps=20, seq_len=16, lr=0.02)
    job["data"] = {"source": str(tokens)}
    job_file = tmp_path / "job.json"
    job_file.write_text(json.dumps(job))
    out, final = _train_json(a, job_file)
    assert out.returncode == 0, f"{out.stderr}\n{dump([a, b])}"
    view = json.loads(swarm(a, "jobs", "show", final["id"], "--json").stdout)
    assert view["plan"]["dtype"] == "bfloat16" and view["state"] == "COMPLETED"
    curve = [row[2] for row in view["metrics"]["losses"]]  # [attempt, step, loss, tok/s]
    assert len(curve) == 20 and all(isinstance(x, float) for x in curve)
    assert sum(curve[-5:]) / 5 < sum(curve[:5]) / 5, curve
    assert view["evaluation"]["trained"]["loss"] < view["evaluation"]["base"]["loss"]


def test_a_zero_bubble_job_trains_through_swarm_train(loopback_swarm, tmp_path):
    """Issue 28: ``"schedule": "zb-h1"`` through the daemons: the plan runs it (B and W ops on
    every stage), both stages step, the loss is finite, the job completes."""
    model = _tiny_llama(tmp_path / "tiny-llama")
    a, b = _two_nodes(loopback_swarm)
    job = _job(model, schedule="zb-h1", micro_batches=2, steps=3, eval_batches=0)
    del job["model"]["lora"]  # a full fine-tune: every block's weights have a W pass
    (tmp_path / "job.json").write_text(json.dumps(job))
    planned = swarm(b, "train", str(tmp_path / "job.json"), "--plan")
    assert planned.returncode == 0, planned.stderr
    assert "schedule zb-h1" in planned.stdout and "forced (zb-h1)" in planned.stdout
    live = json.loads(swarm(b, "train", str(tmp_path / "job.json"), "--plan", "--json").stdout)
    assert live["schedule"]["kind"] == "zb-h1"
    assert all("W1" in s["ops"] for s in live["stages"])  # every stage runs W ops
    out, final = _train_json(a, tmp_path / "job.json")
    assert out.returncode == 0, out.stdout + out.stderr + dump([a, b])
    assert final["state"] == "COMPLETED" and final["step"] == 3
    assert final["plan"]["schedule"] == "zb-h1"
    curve = [row[2] for row in final["metrics"]["losses"]]
    assert len(curve) == 3 and all(math.isfinite(x) for x in curve)


def test_a_one_stage_job_on_one_node_completes(loopback_swarm, tmp_path):
    """`swarm train` with split.stages 1 on one machine: the first thing a user tries."""
    model = _tiny_llama(tmp_path / "tiny-llama")
    a = loopback_swarm.node("a", token=TOKEN, env=ENV).start()
    wait_until(lambda: a.status()["leader_ready"], 30, "a to lead")
    job = _job(model, steps=3)
    job["split"] = {"stages": 1}
    (tmp_path / "job.json").write_text(json.dumps(job))
    out, final = _train_json(a, tmp_path / "job.json")
    assert out.returncode == 0, f"{out.stderr}\n{dump([a])}"
    view = json.loads(swarm(a, "jobs", "show", final["id"], "--json").stdout)
    assert view["state"] == "COMPLETED" and len(view["plan"]["stages"]) == 1
    assert view["plan"]["stages"][0]["layers"] == [0, 4]
    assert [m["id"] for m in json.loads(swarm(a, "models", "--json").stdout)] == ["tiny"]


def test_a_none_job_tokenizes_nothing_runs_no_step_and_registers_its_model(
    loopback_swarm, tmp_path
):
    """Reference ("Which parameters train"): a none job (a frozen backbone with a fixed
    quantizer) reads no data and runs no step, and exports the model with its boundary. Its
    corpus here is not JSON: stage 0 failed tokenizing it before."""
    model = _tiny_llama(tmp_path / "tiny-llama")
    a, b = _two_nodes(loopback_swarm)
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("this is not JSON\n")
    job = _job(model)
    job["model"] = {"pretrained": str(model), "freeze_backbone": True}
    job["split"] = {"stages": 2, "compression": ["fixed_int4"]}
    job["data"] = {"source": str(corpus)}
    (tmp_path / "job.json").write_text(json.dumps(job))
    out, final = _train_json(b, tmp_path / "job.json")
    assert out.returncode == 0, f"{out.stdout}{out.stderr}\n{dump([a, b])}"
    view = json.loads(swarm(a, "jobs", "show", final["id"], "--json").stdout)
    assert view["state"] == "COMPLETED" and view["plan"]["finetune_mode"] == "none"
    assert view["evaluation"] == {} and view["step"] == 0  # no step ran, nothing evaluated
    assert view["plan"]["features"] and "pipeline-eval" in view["plan"]["features"]
    assert not (a.state.root / "jobs" / view["id"] / "data").exists()  # nothing tokenized
    assert not list((a.state.root / "inputs").glob("*"))  # nor the corpus fetched
    models = json.loads(swarm(a, "models", "--json").stdout)
    assert [m["id"] for m in models] == ["tiny"]
    manifest = models[0]["manifest"]
    assert manifest["finetune_mode"] == "none" and manifest["compression"] == ["fixed_int4"]
    assert all("compressor.pt" in s["files"] for s in manifest["stages"])  # the boundary


def test_a_text_corpus_holds_out_its_last_rows_on_the_daemon_path(loopback_swarm, tmp_path):
    """Reference: a bucket file's validation split is its last rows, one in twenty; fewer than
    20 rows evaluate nothing (every pass opens with 0 batches), and the job still completes."""
    import shutil

    import numpy as np
    from transformers import AutoTokenizer

    from swarmp2p.data import tokenize_rows
    from swarmp2p.models import resolve_model_ref

    model = tiny_llama(tmp_path / "m", vocab=49152, layers=2, shard_size="10MB")
    for name in ("tokenizer.json", "tokenizer_config.json"):  # the embedded model's tokenizer
        shutil.copy(Path(resolve_model_ref("embedded")) / name, model / name)
    tok = AutoTokenizer.from_pretrained(model)
    a, b = _two_nodes(loopback_swarm)
    ran = {}
    for n in (100, 19):
        rows = [f"row {i} " + " ".join(f"w{i}x{j}" for j in range(8 + i % 5)) for i in range(n)]
        corpus = tmp_path / f"rows-{n}.jsonl"
        corpus.write_text("".join(json.dumps({"text": r}) + "\n" for r in rows))
        job = _job(model, steps=2, batch_size=1, eval_batches=2)
        job["name"] = f"rows-{n}"
        job["data"] = {"source": str(corpus)}
        (tmp_path / "job.json").write_text(json.dumps(job))
        out, final = _train_json(b, tmp_path / "job.json")
        assert out.returncode == 0, f"{out.stdout}{out.stderr}\n{dump([a, b])}"
        view = json.loads(swarm(a, "jobs", "show", final["id"], "--json").stdout)
        with np.load(a.state.root / "jobs" / view["id"] / "data" / "corpus.npz") as saved:
            ran[n] = view, saved["train"], saved["validation"]
        held = n // 20
        np.testing.assert_array_equal(ran[n][1], tokenize_rows(rows[: n - held], tok))
        np.testing.assert_array_equal(ran[n][2], tokenize_rows(rows[n - held :], tok))
    view, _, _ = ran[100]
    assert view["state"] == "COMPLETED" and view["evaluation"]["base"]["tokens"] == 2 * 8
    view, _, validation = ran[19]
    assert view["state"] == "COMPLETED" and view["step"] == 2 and len(validation) == 0
    assert {p: e["tokens"] for p, e in view["evaluation"].items()} == {"base": 0, "trained": 0}
