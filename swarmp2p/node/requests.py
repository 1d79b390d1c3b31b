"""The local API's requests: one typed record per call from the CLI to its daemon.

The client builds one (``api.send``) and the daemon's :class:`~swarmp2p.node.api.ApiServer`
parses the JSON line back into it through ``swarmp2p.schema`` before its handler runs, so a
bad field is refused once, naming it (``bad request 'logs': stage: must be an integer >= 0``).
An op without a record here would reach its handler as plain data (every op has one now).
Standard library only: ``swarm status`` imports this.
"""

from __future__ import annotations

from typing import ClassVar

from swarmp2p.schema import SchemaError, field, parse, registered

MAX_PATH = 4096


class ApiRequest:
    """Base of every local API request; ``OP`` is its op name on the socket."""

    OP: ClassVar[str] = ""


REQUESTS: dict[str, type[ApiRequest]] = {}
"""op -> its request record."""


def request(op: str):
    """Class decorator: a frozen record registered as the request of local API op ``op``."""
    return registered(REQUESTS, op, attr="OP", what="local API op")


@request("status")
class StatusRequest(ApiRequest):
    """`swarm status`: this node, its view and the table."""


@request("peers")
class PeersRequest(ApiRequest):
    """`swarm peers`: every node in this node's view."""


@request("down")
class DownRequest(ApiRequest):
    """`swarm down`: stop the daemon."""


@request("bench")
class BenchRequest(ApiRequest):
    """`swarm doctor --bench`: measure this node's speeds again."""


@request("remove")
class RemoveRequest(ApiRequest):
    """`swarm remove NODE`: the leader takes it off the members and revokes its key."""

    node_id: str = field(min_len=1, max_len=64)


@request("rotate")
class RotateRequest(ApiRequest):
    """`swarm token --rotate`: a new swarm secret."""


@request("invite")
class InviteRequest(ApiRequest):
    """`swarm invite`: a one-time pairing code valid for ``minutes``."""

    minutes: float = field(default=10.0, gt=0, le=24 * 60)


@request("submit")
class SubmitRequest(ApiRequest):
    """`swarm train`: submit a job (its job.json data; the daemon parses it as a Job)."""

    job: dict
    job_id: str = field(default="", max_len=128)
    """Empty: the leader names it."""
    cwd: str | None = field(default=None, max_len=MAX_PATH)
    """Where relative model and data paths are read from (the CLI's working folder)."""
    submitted_by: str = field(default="cli", min_len=1, max_len=256)


@request("live_plan")
class LivePlanRequest(ApiRequest):
    """`swarm plan --live`: how the live swarm would place a job, placing nothing."""

    job: dict
    cwd: str | None = field(default=None, max_len=MAX_PATH)


@request("jobs")
class JobsRequest(ApiRequest):
    """`swarm jobs`: every job."""


@request("job")
class JobRequest(ApiRequest):
    """`swarm jobs show ID`: a job by id (or by name, when one job has it)."""

    job_id: str = field(min_len=1, max_len=256)


@request("cancel")
class CancelRequest(ApiRequest):
    """`swarm jobs cancel ID`."""

    job_id: str = field(min_len=1, max_len=256)


@request("logs")
class LogsRequest(ApiRequest):
    """`swarm jobs logs ID`: the tail of stage ``stage``'s log (None: the last stage) of
    replica ``replica`` (``split.replicas``; 0: the plan's ``stages``)."""

    job_id: str = field(min_len=1, max_len=256)
    stage: int | None = field(default=None, ge=0)
    replica: int = field(default=0, ge=0, le=1024)


@request("models")
class ModelsRequest(ApiRequest):
    """`swarm models`: the registry."""


@request("export")
class ExportRequest(ApiRequest):
    """`swarm export MODEL`: gather its shards into ``dest`` on this node."""

    model: str = field(min_len=1, max_len=256)
    dest: str = field(min_len=1, max_len=MAX_PATH)


@request("serve")
class ServeStartRequest(ApiRequest):
    """`swarm serve MODEL`: serve a model across the swarm (``request``: its ServeRequest data;
    the daemon parses it as one, naming every bad field)."""

    request: dict


@request("serve_stop")
class ServeStopRequest(ApiRequest):
    """`swarm serve --stop NAME`: stop the model served from this node as ``model``."""

    model: str = field(min_len=1, max_len=MAX_PATH)


@request("served")
class ServedRequest(ApiRequest):
    """The models served from this node."""


@request("serve_endpoint")
class ServeEndpointRequest(ApiRequest):
    """`swarm generate`/`swarm chat`: where ``model`` answers and its API key."""

    model: str = field(min_len=1, max_len=MAX_PATH)


@request("relay_open")
class RelayOpenRequest(ApiRequest):
    """`swarm generate`/`swarm chat` for a model another member serves: post ``body`` (JSON
    text) to ``path`` of its API through the issuing node (``node/serving/relay.py``)."""

    model: str = field(min_len=1, max_len=256)
    path: str = field(pattern="/v1/completions|/v1/chat/completions")
    body: str = field(min_len=2, max_len=1 << 18)
    """At most 256 Ki characters: escaped into a JSON line, under the socket's 1 MiB line."""


@request("relay_next")
class RelayNextRequest(ApiRequest):
    """The next piece of relayed request ``relay`` on node ``node`` (``close``: cancel it)."""

    node: str = field(min_len=1, max_len=64)
    relay: int = field(ge=1)
    close: bool = False


def parse_request(op: str, fields: dict[str, object]) -> ApiRequest | None:
    """``fields`` as op ``op``'s request record (None: the op has none); SchemaError titled
    with the op, naming every bad field."""
    cls = REQUESTS.get(op)
    if cls is None:
        return None
    try:
        return parse(cls, fields)
    except SchemaError as exc:
        raise SchemaError(exc.errors, title=f"bad request {op!r}") from None


__all__ = [
    "REQUESTS",
    "ApiRequest",
    "BenchRequest",
    "CancelRequest",
    "DownRequest",
    "ExportRequest",
    "InviteRequest",
    "JobRequest",
    "JobsRequest",
    "LivePlanRequest",
    "LogsRequest",
    "ModelsRequest",
    "PeersRequest",
    "RelayNextRequest",
    "RelayOpenRequest",
    "RemoveRequest",
    "RotateRequest",
    "ServeEndpointRequest",
    "ServeStartRequest",
    "ServeStopRequest",
    "ServedRequest",
    "StatusRequest",
    "SubmitRequest",
    "parse_request",
]
