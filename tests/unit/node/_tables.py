"""Builders for the node's table and decision tests: jobs, plans, entries, a whole lifecycle."""

from __future__ import annotations

import dataclasses
import hashlib

import zmq
import zmq.utils.z85

from swarmp2p.node.records import NodeRecord
from swarmp2p.node.table import events as ev
from swarmp2p.node.table import jobtable
from swarmp2p.node.table.jobtable import JobTable
from swarmp2p.plan import Node, from_config, parse_job
from swarmp2p.plan.worker_spec import local_cluster

CONFIG = {
    "model_type": "llama",
    "num_hidden_layers": 6,
    "hidden_size": 64,
    "intermediate_size": 192,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 256,
    "tie_word_embeddings": False,
    "max_position_embeddings": 512,
}
SHAPE = from_config(CONFIG)


def job(name: str = "t", **train):
    return parse_job(
        {
            "name": name,
            "model": {"pretrained": "/models/tiny", "lora": {"enabled": True, "r": 4}},
            "data": {"source": "random"},
            "split": {"stages": 2, "mode": "equal"},
            "train": {
                "steps": 10,
                "batch_size": 4,
                "seq_len": 16,
                "micro_batches": 2,
                "checkpoint_every": 2,
                **train,
            },
        }
    )


def cluster(*node_ids: str) -> list[Node]:
    """Node records of CPU nodes with these ids (what the planner takes)."""
    return [
        dataclasses.replace(node, node_id=node_id, name=f"host-{node_id}")
        for node, node_id in zip(local_cluster(len(node_ids)), node_ids)
    ]


def records(*node_ids: str) -> list[NodeRecord]:
    """The daemons' records of CPU nodes with these ids (as their hellos carry them)."""
    return [NodeRecord(node=n) for n in cluster(*node_ids)]


def bare_record(node_id: str) -> NodeRecord:
    """A record of a node with no devices (a test that plans nothing on it)."""
    return NodeRecord(node=Node(node_id=node_id, name=node_id, ram=0, disk_free=0, devices=()))


def plan(node_ids=("a", "b"), the_job=None):
    from swarmp2p.node.training.jobs import compute_plan

    return compute_plan(the_job or job(), cluster(*node_ids), shape=SHAPE)


def key(node_id: str) -> str:
    """A stable, valid CURVE public key for ``node_id`` (a test's member key)."""
    secret = zmq.utils.z85.encode(hashlib.blake2b(node_id.encode(), digest_size=32).digest())
    return zmq.curve_public(secret).decode("ascii")


class Log:
    """Appends events as the leader of ``term`` would: one version after another."""

    def __init__(self, table: JobTable | None = None, term: int = 1) -> None:
        self.table = table or JobTable()
        self.term = term

    def __call__(self, *events: ev.Event) -> JobTable:
        for event in events:
            entry = ev.Entry(version=self.table.version + 1, term=self.term, event=event)
            self.table = jobtable.apply(self.table, entry)
        return self.table


def founded(*members: str, term: int = 1) -> Log:
    log = Log(term=term)
    log(ev.LeaderElected(leader=members[0], epoch="e1"))
    log(*(ev.MemberJoined(node_id=m, name=f"host-{m}", key=key(m)) for m in members))
    return log


def running(job_id: str = "j1", nodes=("a", "b"), the_job=None) -> Log:
    """A founded swarm with one job placed on ``nodes`` and running (attempt 1)."""
    log = founded(*sorted(set(nodes) | {"a"}))
    the_job = the_job or job()
    log(
        ev.JobSubmitted(job_id=job_id, job=the_job, submitted_by="cli", at=1.0),
        ev.JobPlaced(
            job_id=job_id,
            attempt=1,
            plan=plan(nodes, the_job),
            cluster=tuple(cluster(*nodes)),
            placed_by="a",
            at=2.0,
        ),
        ev.JobRunning(job_id=job_id, attempt=1, at=3.0),
    )
    return log


def serve_plan(*node_ids: str):
    """A serving ring's plan, one stage per node (``node_ids`` in order)."""
    from swarmp2p.plan.serve import ServeInputs, ServePlan

    nodes = tuple(cluster(*node_ids))
    made = ServeInputs(shape=SHAPE, stages=len(node_ids), cluster=nodes).plan()
    assert isinstance(made, ServePlan), made
    return made


def serving(serve_id: str = "s1", nodes=("a", "b"), issuer: str = "a") -> Log:
    """A founded swarm where ``issuer`` serves a model on a ring over ``nodes`` (attempt 1)."""
    from swarmp2p.plan.serve import ServeRequest

    log = founded(*sorted({*nodes, issuer}))
    request = ServeRequest(model="/models/tiny", name="tiny", stages=len(nodes), port=8080)
    log(
        ev.ServeRequested(serve_id=serve_id, issuer=issuer, request=request, at=1.0),
        ev.ServePlaced(
            serve_id=serve_id,
            attempt=1,
            plan=serve_plan(*nodes),
            endpoints=tuple(f"tcp://{n}:5000" for n in nodes),
            url="http://127.0.0.1:8080",
            at=2.0,
        ),
    )
    return log
