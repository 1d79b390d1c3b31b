"""The node daemon (`swarm up`): membership, election, the job table, workers. No torch."""

from swarmp2p.node.api import ApiError
from swarmp2p.node.config import DEFAULT_PORT, NodeConfig
from swarmp2p.node.control import down, status, submit_job, token, up
from swarmp2p.node.daemon import Daemon, serve
from swarmp2p.node.election import check_node_id, leader
from swarmp2p.node.hardware import FAKE_DEVICES_ENV, parse_fake_devices, planner_record, probe
from swarmp2p.node.jobtable import JobEvent, JobTable, newest
from swarmp2p.node.jobtable import apply as apply_job_event
from swarmp2p.node.membership import Membership
from swarmp2p.node.state import StateDir, default_state_dir

__all__ = [
    "DEFAULT_PORT",
    "FAKE_DEVICES_ENV",
    "ApiError",
    "Daemon",
    "JobEvent",
    "JobTable",
    "Membership",
    "NodeConfig",
    "StateDir",
    "apply_job_event",
    "check_node_id",
    "default_state_dir",
    "down",
    "leader",
    "newest",
    "parse_fake_devices",
    "planner_record",
    "probe",
    "serve",
    "status",
    "submit_job",
    "token",
    "up",
]
