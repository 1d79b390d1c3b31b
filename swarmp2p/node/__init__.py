"""The node daemon (`swarm up`): membership, the replicated table, jobs, serving. No torch."""

from swarmp2p.node.api import ApiError
from swarmp2p.node.config import DEFAULT_PORT, NodeConfig
from swarmp2p.node.context import Identity, NodeContext
from swarmp2p.node.control import down, status, token, up
from swarmp2p.node.daemon import Daemon, runtime_capabilities, serve
from swarmp2p.node.election import check_node_id, leader
from swarmp2p.node.hardware import FAKE_DEVICES_ENV, parse_fake_devices, planner_record, probe
from swarmp2p.node.job_commands import (
    cancel_job,
    export_model,
    job_logs,
    live_plan,
    load_train_job,
    submit_job,
    submit_train,
)
from swarmp2p.node.jobs import PlanMismatch, check_plan, compute_plan
from swarmp2p.node.jobtable import JobEntry, JobTable, apply
from swarmp2p.node.membership import Membership
from swarmp2p.node.registry import find_model, unique_model_id
from swarmp2p.node.replication import Replication
from swarmp2p.node.stages import StageHost
from swarmp2p.node.state import StateDir, default_state_dir
from swarmp2p.node.workers import WorkerProcess

__all__ = [
    "DEFAULT_PORT",
    "FAKE_DEVICES_ENV",
    "ApiError",
    "Daemon",
    "Identity",
    "JobEntry",
    "JobTable",
    "Membership",
    "NodeConfig",
    "NodeContext",
    "PlanMismatch",
    "Replication",
    "StageHost",
    "StateDir",
    "WorkerProcess",
    "apply",
    "cancel_job",
    "check_node_id",
    "check_plan",
    "compute_plan",
    "default_state_dir",
    "down",
    "export_model",
    "find_model",
    "job_logs",
    "leader",
    "live_plan",
    "load_train_job",
    "parse_fake_devices",
    "planner_record",
    "probe",
    "runtime_capabilities",
    "serve",
    "status",
    "submit_job",
    "submit_train",
    "token",
    "unique_model_id",
    "up",
]
