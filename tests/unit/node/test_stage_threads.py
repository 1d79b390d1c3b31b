"""A CPU stage worker's threads as its daemon sets them (``worker_env``): the stages of one plan
(training or serving) on one machine share its cores; a stage alone on its machine takes every
core; an ``OMP_NUM_THREADS`` the daemon was started with wins."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from swarmp2p.node.records import Host
from swarmp2p.node.training.stages import worker_env
from swarmp2p.plan import from_config, parse_job
from swarmp2p.plan.hardware import Device, Node
from swarmp2p.plan.serve import plan_serve
from swarmp2p.plan.worker_spec import local_plan

GIB = 2**30
SHAPE = from_config(
    {
        "model_type": "llama",
        "vocab_size": 1000,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 512,
        "tie_word_embeddings": False,
    }
)


def _node(node_id: str) -> Node:
    cpu = Device(kind="cpu", index=0, name="cpu", memory_total=8 * GIB, memory_free=8 * GIB)
    return Node(node_id=node_id, name=node_id, ram=16 * GIB, disk_free=100 * GIB, devices=(cpu,))


def _ctx(node_id: str, machines: dict[str, str], cores: int = 8):
    """What worker_env and serve_groups read of a NodeContext: this node's host record and the
    live peers' (their ``machine`` ids)."""

    def peer(n: str):
        return SimpleNamespace(node_id=n, host=Host(machine=machines[n], cpu_cores=cores))

    return SimpleNamespace(
        node_id=node_id,
        me=peer(node_id),
        members=SimpleNamespace(alive_peers=lambda: [peer(n) for n in machines if n != node_id]),
    )


def _serve_plan():
    plan = plan_serve(SHAPE, [_node("a"), _node("b")], max_sessions=4, max_context=64, stages=2)
    assert [s.node_id for s in plan.stages] == ["a", "b"]
    return plan


def _train_plan():
    job = parse_job({"model": {"pretrained": "embedded"}, "data": {"source": "random"}})
    plan = local_plan(job, SHAPE, stages=2)
    return type(plan).from_dict(
        {
            **plan.to_dict(),
            "stages": [{**s.to_dict(), "node_id": n} for s, n in zip(plan.stages, "ab")],
        }
    )


@pytest.fixture(autouse=True)
def _no_omp(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)


ONE_MACHINE = {"a": "m1", "b": "m1"}
TWO_MACHINES = {"a": "m1", "b": "m2"}


@pytest.mark.parametrize("plan", [_serve_plan, _train_plan], ids=["serve", "train"])
def test_stages_sharing_a_machine_split_its_cores(plan):
    """Serve stages too: every core each measured 2.8x slower beside a 2-core load (their
    spinning intra-op threads oversubscribe it) and the same on idle cores."""
    assert worker_env(_ctx("a", ONE_MACHINE), plan(), "cpu", None)["OMP_NUM_THREADS"] == "4"
    assert worker_env(_ctx("a", TWO_MACHINES), plan(), "cpu", None)["OMP_NUM_THREADS"] == "8"


def test_the_daemons_own_omp_setting_wins_and_gpus_get_none(monkeypatch):
    plan = _serve_plan()
    assert "OMP_NUM_THREADS" not in worker_env(_ctx("a", ONE_MACHINE), plan, "cuda:0", "0")
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert "OMP_NUM_THREADS" not in worker_env(_ctx("a", ONE_MACHINE), plan, "cpu", None)
