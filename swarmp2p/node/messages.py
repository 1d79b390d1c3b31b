"""The daemon's control messages (type names ``node.*``), on the wire registry."""

from __future__ import annotations

from swarmp2p.node.cluster.election import check_node_id
from swarmp2p.node.records import Host, MemoryReport, NodeRecord
from swarmp2p.node.table.events import Attempt, JobId, NodeId, SnapshotSlice, StageIndex
from swarmp2p.node.table.jobtable import MAX_VERSION
from swarmp2p.plan import Job, Node, Plan
from swarmp2p.plan.inputs import JobInputs
from swarmp2p.plan.serve import ServeInputs
from swarmp2p.schema import field
from swarmp2p.wire.messages import Message, message


def _check_id(node_id: str) -> None:
    check_node_id(node_id)


@message("node.hello")
class NodeHello(Message):
    """Who a node is, how to reach it, its hardware and its table; the reply is the same."""

    node_id: str
    name: str
    versions: list[int]
    software: str
    swarm_id: str
    control_port: int
    addresses: list[str]
    """IPv4 addresses its control port listens on, best first."""
    record: NodeRecord
    """The hardware node record (cluster.json form, fake devices marked)."""
    host: Host
    """CPU cores, machine, the NVIDIA driver version."""
    term: int
    version: int
    join_port: int = field(default=0, ge=0, le=65535)
    """Its join port (``node.join``), 0 when not told."""

    def __post_init__(self) -> None:
        _check_id(self.node_id)
        if not 0 < self.control_port < 65536:
            raise ValueError(f"control_port must be in 1..65535, got {self.control_port}")
        if not self.addresses:
            raise ValueError("addresses must list at least one IPv4 address")
        if not self.versions:
            raise ValueError("versions must not be empty")
        if self.record.node_id != self.node_id:
            raise ValueError(
                f"record.node_id {self.record.node_id!r} is not the sender's {self.node_id!r}"
            )


@message("node.heartbeat")
class Heartbeat(Message):
    """I am alive; my table is at ``(term, version)``; I see ``leader`` leading."""

    node_id: str
    term: int
    version: int
    leader: str
    wall_time: float = 0.0
    """The sender's ``time.time()``; peers estimate clock skew from it (0: not sent)."""
    serving: list[JobId] | None = None
    """The serve ids the sender issues now (``swarm serve`` run there): a node stops the serve
    workers of an id its issuer no longer claims (the issuer restarted or stopped it)."""
    memory: MemoryReport | None = None
    """Live memory re-read each heartbeat (None: a peer that does not say)."""
    fetching: list | None = None
    """The model and data files the sender is fetching now, one progress map each."""

    def __post_init__(self) -> None:
        _check_id(self.node_id)


@message("node.leave")
class Leave(Message):
    """I am stopping cleanly; forget me."""

    node_id: str

    def __post_init__(self) -> None:
        _check_id(self.node_id)


@message("node.lead_request")
class LeadRequest(Message):
    """A candidate asks for this node's vote for ``term`` (it leads once a majority of the
    members voted for it)."""

    candidate: NodeId
    term: int = field(ge=1, lt=MAX_VERSION)


@message("node.lead_vote")
class LeadVote(Message):
    """A vote, with the table the voter holds (the candidate continues from the newest)."""

    node_id: NodeId
    granted: bool
    reason: str = field(default="", max_len=1000)
    term: int = field(ge=0, lt=MAX_VERSION)
    version: int = field(ge=0, lt=MAX_VERSION)
    epoch: str = field(default="", max_len=64)
    members: int = field(default=0, ge=0, le=100000)


@message("node.table_fetch")
class TableFetch(Message):
    """Send me your job table (a new leader fetches the newest of its voters')."""

    node_id: str


@message("node.table")
class TablePush(Message):
    """A whole job table: a reply to a fetch, or the leader's to a follower that holds another
    history or is too far behind for a delta."""

    node_id: NodeId
    term: int = field(ge=0, lt=MAX_VERSION)
    """The sender's term (the leader's, when pushed)."""
    table: dict
    commit: int = field(default=0, ge=0, lt=MAX_VERSION)


@message("node.table_events")
class TableEvents(Message):
    """The leader's entries after ``prev_version`` (whose term was ``prev_term``)."""

    leader: NodeId
    term: int = field(ge=1, lt=MAX_VERSION)
    epoch: str = field(default="", max_len=64)
    """The swarm history the entries belong to (a follower of another one needs the table)."""
    prev_version: int = field(ge=0, lt=MAX_VERSION)
    prev_term: int = field(ge=0, lt=MAX_VERSION)
    entries: list = field(max_len=4096)
    commit: int = field(default=0, ge=0, lt=MAX_VERSION)


@message("node.table_ack")
class TableAck(Message):
    """What this node now holds durably; ``ok`` false with the reason when it refused."""

    node_id: str
    term: int = field(ge=0, lt=MAX_VERSION)
    version: int = field(ge=0, lt=MAX_VERSION)
    ok: bool = True
    reason: str = field(default="", max_len=2000)


@message("node.submit")
class Submit(Message):
    """Add a training job to the table (forwarded to the leader by a follower); answered once
    a majority of the members hold it."""

    job_id: str = field(default="", max_len=128)
    """Empty: the leader names it."""
    job: Job
    inputs: JobInputs | None = None
    """The job's inputs as the submitting node resolved them (shape, model files, data)."""
    submitted_by: str = field(default="", max_len=256)


@message("node.submitted")
class Submitted(Message):
    """The job is in the table at ``version``, durable on ``replicas`` nodes."""

    job_id: str
    term: int
    version: int
    replicas: int


# --- training jobs (issue 7) ---------------------------------------------------------------


@message("job.stage_start")
class StageStart(Message):
    """Leader to a stage's node: check the plan from these inputs, start the stage's worker."""

    OMIT_DEFAULTS = frozenset({"replica", "ring_next", "ring_prev"})

    job_id: JobId
    attempt: Attempt
    stage: StageIndex
    job: Job
    """The job the plan was made from."""
    cluster: tuple[Node, ...]
    """The exact node records the leader planned on."""
    plan: Plan
    """The leader's plan (the stage's node plans again and refuses another)."""
    next: str
    """The next stage's bound endpoint; empty on the last stage."""
    resume_step: int
    """0: start fresh; else resume from the snapshot after this many steps."""
    snapshot_nodes: list[NodeId]
    """Nodes holding a copy of this stage's snapshot at ``resume_step``."""
    leader: str
    inputs: JobInputs | None = None
    """The job's inputs (its shape plans; its model and data files are fetched from them)."""
    prepare: bool = False
    """Only check the plan and fetch the stage's files (every stage at once, before any
    worker starts): answered with ``job.ack`` once they are here."""
    resplit: tuple[SnapshotSlice, ...] | None = None
    """Resuming on new cuts: each stage of the old cuts, whose snapshots at ``resume_step`` this
    stage's slice is cut from."""
    cuts: list[int] | None = None
    """The cuts the leader planned with (None: the planner's own choice from the job)."""
    replica: int = field(default=0, ge=0, le=1024)
    """Which of the plan's replicas (``split.replicas``) this stage belongs to (0: the plan's
    ``stages``)."""
    ring_next: str = field(default="", max_len=300)
    """The replica ring: the endpoint of the next replica's member to dial; empty: this member
    binds it (replica 0, and every replica but the last, binds; ``job.stage_ready`` says the
    port)."""
    ring_prev: str = field(default="", max_len=300)
    """The endpoint of the previous replica's member to dial; empty on replica 0 (it binds)."""


@message("job.stage_ready")
class StageReady(Message):
    """The stage's worker is up; the stage before dials ``tcp://host:port`` (0 on stage 0).
    With replicas its ring's bound ends too (0: dialled, or one replica)."""

    OMIT_DEFAULTS = frozenset({"replica", "ring_next_port", "ring_prev_port"})

    job_id: str
    attempt: int
    stage: int
    host: str
    port: int
    replica: int = field(default=0, ge=0, le=1024)
    ring_next_port: int = field(default=0, ge=0, le=65535)
    ring_prev_port: int = field(default=0, ge=0, le=65535)


@message("job.stage_stop")
class StageStop(Message):
    """Stop this job's workers on the receiving node (``attempt`` -1: every attempt)."""

    job_id: str
    attempt: int


@message("job.report")
class StageReport(Message):
    """A node's worker events for the leader (``exit`` events carry code and stderr tail)."""

    OMIT_DEFAULTS = frozenset({"replica"})

    node_id: str
    job_id: str
    attempt: int
    stage: int
    events: list
    replica: int = field(default=0, ge=0, le=1024)


@message("job.cancel")
class JobCancel(Message):
    """Cancel a job (forwarded to the leader)."""

    job_id: str


@message("job.ack")
class JobAck(Message):
    """Done."""

    job_id: str


@message("job.metrics_fetch")
class JobMetricsFetch(Message):
    """To the leader: a job's metrics (loss curve, throughput, boundary traffic)."""

    job_id: JobId


@message("job.metrics")
class JobMetrics(Message):
    job_id: str
    metrics: dict


@message("job.shard_read")
class ShardRead(Message):
    """Read ``size`` bytes at ``offset`` of a file in a job's folder on the receiving node
    (exported shards, snapshots, stage logs)."""

    job_id: str
    file: str
    offset: int
    size: int


@message("job.file_pull")
class FilePull(Message):
    """Copy ``file`` of a job's folder from node ``source`` (``tcp://`` control endpoint)."""

    job_id: str
    file: str
    source: str


@message("job.shard_chunk")
class ShardChunk(Message):
    """Bytes of a shard file; ``total`` is the file's size."""

    data: bytes
    total: int


# --- serving across the swarm (``swarm serve``) ----------------------------------------------


@message("serve.plan")
class ServePlace(Message):
    """Issuing node to the leader: plan a serving ring from ``inputs`` (``plan.serve``) over the
    live nodes, whose records the leader fills in as ``inputs.cluster``."""

    serve_id: JobId
    inputs: ServeInputs


@message("serve.placed")
class ServePlaced(Message):
    """The leader's plan (``ServePlan.to_json()``) and the exact inputs it was made from."""

    serve_id: JobId
    leader: str
    inputs: ServeInputs
    plan: str


@message("serve.stage_start")
class ServeStageStart(Message):
    """Issuing node to a stage's node: check the plan from these inputs, then start stage
    ``stage``'s serve worker (the node fills in its own token, address, device and files)."""

    serve_id: JobId
    attempt: Attempt
    stage: StageIndex
    inputs: ServeInputs
    """What the leader planned from (the live nodes' records included)."""
    plan: str
    """The leader's plan, canonical JSON (``ServePlan.to_json()``)."""
    model: str = field(min_len=1, max_len=4096)
    """The model folder (or Hub id) on the issuing node; a trained model's base."""
    issuer: str
    """The issuing node: told with ``serve.stage_exit`` if the worker dies."""
    embedded: bool = False
    """The model is the embedded one: a node may load its own converted copy."""
    revision: str = field(default="", max_len=128)
    """A Hub model's revision as the issuing node resolved it: every stage loads the same one
    ("": a folder or embedded model)."""
    files: dict | None = None
    """A folder model's files, ``{name: [bytes, sha256]}``: the node serves its own copy at the
    same path (or its embedded model) only if the files its stage reads match, else it fetches
    just those (``node.inputs``: from the issuer, ``serve.file_read``, then any node that holds
    them)."""
    shard: dict | None = None
    """A trained model's stage: ``{"job_id", "folder", "files": {name: sha256}, "sources":
    [node ids], "tied": {"file", "tensor", "sources"} or None}``; the node makes the shard
    local (pulling it from a source when it holds no intact copy)."""


@message("serve.stage_connect")
class ServeStageConnect(Message):
    """Tell a started stage where the next stage (or the return link) listens."""

    serve_id: JobId
    attempt: int
    stage: int
    next: str


@message("serve.stage_stop")
class ServeStageStop(Message):
    """Stop one stage's worker (``stage`` -1: every stage of ``serve_id`` on that node)."""

    serve_id: JobId
    attempt: int
    stage: int


@message("serve.stage")
class ServeStage(Message):
    """A stage's node answers: the worker's input endpoint and what it reported."""

    serve_id: str
    attempt: int
    stage: int
    endpoint: str
    state: str
    """"ready", "serving" or "stopped"."""


@message("serve.stage_exit")
class ServeStageExit(Message):
    """A stage's node to the issuing node: the stage's worker died (its node lives on)."""

    serve_id: JobId
    attempt: int
    stage: int
    node_id: str
    message: str


@message("job.input_read")
class InputRead(Message):
    """To a node holding a job's input: ``size`` bytes at ``offset`` of a model file (``kind``
    "model": ``key`` is the model's digest, ``file`` its name) or of a data file ("data": ``key``
    is its sha256). Answered with ``job.shard_chunk``."""

    kind: str = field(pattern=r"model|data")
    key: str = field(pattern=r"[0-9a-f]{16}|[0-9a-f]{64}")
    file: str = field(default="", max_len=256)
    offset: int = field(ge=0)
    size: int = field(ge=1)


@message("serve.shard_hold")
class ServeShardHold(Message):
    """Issuing node to a node serving none of it: hold an intact copy of stage ``stage``'s
    trained shard (``shard`` as in ``serve.stage_start``: fetched from its sources unless this
    node has it) and tell the leader (``model.shard_copy``, which only the holder may send).
    Answered with ``job.ack``."""

    stage: StageIndex
    shard: dict


@message("serve.note")
class ServeNote(Message):
    """Issuing node to the leader: write ``event``, a serving table event
    (``{"event": NAME, ...}``, ``node/table/events.py``) of a model ``issuer`` serves."""

    issuer: str
    event: dict


@message("serve.noted")
class ServeNoted(Message):
    """The table version the leader wrote the event at."""

    version: int


@message("serve.file_read")
class ServeFileRead(Message):
    """Stage node to the issuing node: ``size`` bytes at ``offset`` of file ``file`` of the
    folder model served as ``serve_id`` (answered with ``job.shard_chunk``)."""

    serve_id: JobId
    file: str
    offset: int
    size: int


RELAY_PATHS = ("/v1/completions", "/v1/chat/completions")
"""The API routes a member may reach through ``serve.relay_open``."""
RELAY_TEXT_CHARS = 1 << 19
"""Characters of a request body, or of one ``serve.relay`` reply's text, at most: 2 MB at
UTF-8's widest, well inside a 4 MB message."""


@message("serve.relay_open")
class ServeRelayOpen(Message):
    """A member to the issuing node of a served model: post ``body`` (JSON text) to route
    ``path`` of the API that serves ``model`` here (``swarm generate``/``swarm chat`` on a
    node that does not serve it). Answered with ``serve.relay`` (its ``relay`` id)."""

    model: str = field(min_len=1, max_len=256)
    path: str = field(pattern="|".join(RELAY_PATHS))
    body: str = field(min_len=2, max_len=RELAY_TEXT_CHARS)


@message("serve.relay_next")
class ServeRelayNext(Message):
    """The opener of relay ``relay``: what its response has written since the last ask
    (waits a little for more); ``close``: the client left, cancel it."""

    relay: int = field(ge=1)
    close: bool = False


@message("serve.relay")
class ServeRelay(Message):
    """A relayed response so far: its HTTP ``status`` (0 until known), the ``text`` written
    since the last ask, ``done`` once all of it was sent."""

    relay: int = field(ge=1)
    status: int = field(default=0, ge=0, le=599)
    text: str = field(default="", max_len=RELAY_TEXT_CHARS)
    done: bool = False


@message("model.shard_copy")
class ShardCopy(Message):
    """To the leader: ``node_id`` now holds an intact copy of stage ``stage``'s shard of the
    model job ``job_id`` trained; the registry lists it beside the node that trained it, so
    serving and ``swarm export`` still find the shard when that node is gone."""

    job_id: str
    stage: int
    node_id: str


SERVE_MESSAGES = (
    ServeFileRead,
    ServeRelayOpen,
    ServeRelayNext,
    ServeNote,
    ServePlace,
    ServeStageStart,
    ServeStageConnect,
    ServeStageStop,
    ServeStageExit,
    ServeShardHold,
)
"""The requests the daemon hands to its serving side."""
