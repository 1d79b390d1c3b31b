"""The record a training stage worker runs from: the job and its plan as every peer holds them,
which stage, and what only that stage's node knows. Pure, standard library only.

``worker_spec(job, plan, stage, ...)`` is the one way to make one: the daemon builds it for
each stage it starts, tests and benchmarks build it to drive workers directly, and the worker
(``python -m swarmp2p.runtime.worker``) parses it from stdin with ``parse_worker_spec`` before
it imports torch. Nothing in it is a second copy of a job.json setting: the worker reads the
job's own ``train``/``model`` records and the plan's cuts, dtype, schedule and boundaries.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from swarmp2p.plan.hardware import CAPABILITIES, Device, Node
from swarmp2p.plan.job import Job, LoraConfig, SplitConfig, SyncConfig, TrainConfig
from swarmp2p.plan.memory import DEFAULT_LOSS_CHUNK_TOKENS
from swarmp2p.plan.model_shape import ModelShape
from swarmp2p.plan.placement import plan_job
from swarmp2p.plan.placer import REPLICAS_CAPABILITY
from swarmp2p.plan.result import Plan
from swarmp2p.plan.split import StageOfPlan
from swarmp2p.schema import FieldError, SchemaError, field, parse, to_data
from swarmp2p.timings import TIMINGS


class WorkerSpecError(SchemaError):
    """A worker spec is invalid; ``errors`` lists every problem with its field path."""

    def __init__(self, errors: list[FieldError]) -> None:
        super().__init__(errors, title="invalid worker spec")


@dataclass(frozen=True, kw_only=True, slots=True)
class StageData:
    """Where the first stage's tokens come from on its node."""

    source: Literal["random", "tokens", "corpus"] = "random"
    """``random``: seeded uniform tokens (tests, benchmarks, every stage but the first, and a
    ``none`` job's stages, which read nothing); ``tokens``: a .npy file of token ids on this
    node, cut into windows of seq_len + 1, the last one window in twenty held out (it has no
    rows); ``corpus``: a text corpus tokenized by ``swarmp2p.node.training.corpus`` into a .npz
    of its training rows' and its validation rows' tokens (the held-out rule counts rows)."""
    path: str | None = field(default=None, min_len=1)

    def __post_init__(self) -> None:
        if self.source != "random" and self.path is None:
            raise SchemaError(
                [FieldError(path="path", message=f'required when source is "{self.source}"')]
            )


@dataclass(frozen=True, kw_only=True, slots=True)
class StageTraining:
    """What one stage's training loop reads (``runtime.torch.train.steps``): the job's ``train``
    record with what its plan and its worker spec resolved. ``WorkerSpec.train`` builds it, and
    a run without a spec (a test, a benchmark) through ``StageTraining.of``, from the same
    records: no setting has a default of its own here but AdamW's constants, which job.json
    does not set."""

    steps: int
    batch_size: int
    seq_len: int
    micro_batches: int
    """M: each step's batch is split into this many micro-batches (the batch size must divide)."""
    schedule: str
    lr: float
    weight_decay: float
    recompute: bool
    """Activation checkpointing per block: keep block inputs only, recompute in backward."""
    loss_chunk_tokens: int
    """The last stage scores this many tokens at a time."""
    eval_batches: int
    calibration_tokens: int
    checkpoint_every: int
    loss_scale: float | None
    """A float16 pipeline's first loss scale (None: ``precision.INIT_LOSS_SCALE``)."""
    inject_nan_step: int | None
    """Test knob: from this step on, this stage's gradients hold a NaN."""
    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW's (torch.optim.AdamW's defaults)."""
    eps: float = 1e-8

    @classmethod
    def of(cls, train: TrainConfig | None = None, **settings: Any) -> StageTraining:
        """A stage's settings from the job's ``train`` record (``train``, or one parsed from
        the ``settings`` job.json's ``train`` names, with its defaults and checks), the other
        ``settings`` standing for what a plan and a spec resolve (by default: the job's own
        choice, and the worker spec's defaults)."""
        if train is None:
            names = {f.name for f in dataclasses.fields(TrainConfig)}
            train = parse(
                TrainConfig,
                {k: v for k, v in settings.items() if k in names},
                title="invalid train",
            )
            settings = {k: v for k, v in settings.items() if k not in names}
        spec = {f.name: f.default for f in dataclasses.fields(WorkerSpec)}
        derived = {
            "steps": train.steps,
            "batch_size": train.batch_size,
            "seq_len": train.seq_len,
            "micro_batches": train.micro_batches,
            # "auto" is the planner's to resolve; a run without a plan takes 1F1B
            "schedule": "1f1b" if train.schedule == "auto" else train.schedule,
            "lr": train.lr,
            "recompute": train.recompute is True,  # "auto" is the planner's to resolve
            "eval_batches": train.eval_batches,
            "checkpoint_every": train.checkpoint_every,
            "calibration_tokens": SplitConfig().calibration_tokens,
            **{k: spec[k] for k in _SPEC_TUNABLES},
        }
        return cls(**{**derived, **settings})


_SPEC_TUNABLES = ("weight_decay", "loss_chunk_tokens", "loss_scale", "inject_nan_step")
"""StageTraining's settings a worker spec may set, and whose defaults it declares."""


@dataclass(frozen=True, kw_only=True, slots=True)
class WorkerSpec(StageOfPlan):
    """One training stage's assignment (``python -m swarmp2p.runtime.worker`` stdin)."""

    job: Job
    """The job as submitted (canonical job.json)."""
    plan: Plan
    """The plan every assigned peer checked."""
    stage: int = field(ge=0)
    model: str = field(min_len=1, max_len=4096)
    """What this node loads the stage from: a local folder (or a ref ``load_stage_shard``
    resolves: "embedded", a Hub id in this node's cache)."""
    token: str = field(min_len=1, max_len=256)
    """The swarm token: links are CURVE-authenticated with keys derived from it (stdin only)."""
    device: str = field(default="cpu", pattern=r"cpu|cuda(:\d+)?|mps(:\d+)?")
    host: str = field(default="127.0.0.1", min_len=1, max_len=255)
    """Where the link to the stage before binds."""
    port: int = field(default=0, ge=0, le=65535)
    next: str | None = field(default=None, pattern=r"tcp://[^\s]+:\d{1,5}")
    """The endpoint of the next stage's bound link; None on the last stage."""
    link_timeout_s: float = field(default=TIMINGS.link_timeout_s, gt=0, le=86400)
    data: StageData = dataclasses.field(default_factory=StageData)
    snapshot_dir: str | None = field(default=None, min_len=1)
    resume: bool = False
    """Continue from the newest snapshot in ``snapshot_dir``."""
    export_dir: str | None = field(default=None, min_len=1)
    """Write this stage's shard to ``export_dir/stage-<i>`` after the last step."""
    link_keys: dict | None = None
    """Per-node link keys (issue 15), z85: ``{"public", "secret"}`` of this stage's node,
    ``"prev"`` the public key of the stage before's node (the only client the bound link
    admits), ``"next"`` the next stage's node's (the server key it dials). None: the token's
    keys (one machine, tests)."""
    weight_decay: float = field(default=0.0, ge=0)
    loss_chunk_tokens: int = field(default=DEFAULT_LOSS_CHUNK_TOKENS, ge=1)
    calibration_tokens: int | None = field(default=None, ge=1)
    """Tokens stage 0 calibrates the learned boundaries with; None: the job's
    (``split.compression``'s ``calibration_tokens``, default 16384)."""
    loss_scale: float | None = field(default=None, gt=0)
    """A float16 job's first loss scale (None: 2**16, torch.amp.GradScaler's default)."""
    inject_nan_step: int | None = field(default=None, ge=0)
    """Test knob: from this step on, this stage's gradients hold a NaN."""
    replica: int = field(default=0, ge=0)
    """Which of the plan's replicas (``split.replicas``) this stage belongs to; it reads that
    replica's share of each step's data and syncs with this stage of the other replicas."""
    ring_next: str | None = field(default=None, pattern=r"tcp://[^\s]+:\d{1,5}")
    """The replica ring (issue 29): the endpoint of the next replica's member to dial (what
    this member sends to); None: this member binds that link (``ready`` says its port).
    Replicas start in order, so replica r dials replica r - 1's bound ends, and the last
    replica also dials replica 0's."""
    ring_prev: str | None = field(default=None, pattern=r"tcp://[^\s]+:\d{1,5}")
    """The endpoint of the previous replica's member to dial (what this member receives from);
    None: this member binds that link."""
    ring_keys: dict | None = None
    """The ring's link keys, z85: this node's ``{"public", "secret"}``, ``"prev"`` and
    ``"next"`` the previous and next replica's nodes' public keys. None: the token's keys."""

    def __post_init__(self) -> None:
        errors = self.stage_errors()
        n = len(self.plan.stages)
        replicas = self.plan.n_replicas
        if self.replica >= replicas:
            errors.append(
                FieldError(
                    path="replica",
                    message=f"must be < the plan's {replicas} replica(s), got {self.replica}",
                )
            )
        elif replicas > 1 and self.replica > 0 and self.ring_prev is None:
            errors.append(
                FieldError(
                    path="ring_prev",
                    message=f"replica {self.replica} dials the replica before it: its bound "
                    "endpoint is required",
                )
            )
        if replicas > 1 and self.replica == replicas - 1 and self.ring_next is None:
            errors.append(
                FieldError(
                    path="ring_next",
                    message=f"the last replica ({self.replica}) closes the ring: replica 0's "
                    "bound endpoint is required",
                )
            )
        if replicas > 1 and self.export_dir is not None and self.replica != 0:
            errors.append(
                FieldError(
                    path="export_dir",
                    message=f"replica {self.replica} exports nothing: replica 0 exports the "
                    "synchronised weights",
                )
            )
        if not errors and self.stage < n - 1 and self.next is None:
            errors.append(
                FieldError(
                    path="next",
                    message="required on every stage but the last (the next stage's endpoint)",
                )
            )
        if self.plan.job != self.job.name:
            errors.append(
                FieldError(
                    path="plan.job",
                    message=f"{self.plan.job!r} is not the job's name {self.job.name!r}",
                )
            )
        if self.plan.finetune_mode != self.job.finetune_mode:
            errors.append(
                FieldError(
                    path="plan.finetune_mode",
                    message=f"{self.plan.finetune_mode!r} is not the job's {self.job.finetune_mode!r}",
                )
            )
        if self.plan.finetune_mode == "none" and self.data.source != "random":
            errors.append(
                FieldError(
                    path="data.source",
                    message=f"{self.data.source!r}: a job in finetune mode none reads no data "
                    '(use "random")',
                )
            )
        if self.resume and self.snapshot_dir is None:
            errors.append(FieldError(path="resume", message="needs snapshot_dir"))
        if self.loss_scale is not None and self.plan.dtype != "float16":
            errors.append(
                FieldError(
                    path="loss_scale",
                    message=f"applies only to float16 jobs (this one is {self.plan.dtype})",
                )
            )
        if errors:
            raise SchemaError(errors)

    # --- what the stage runs, read from the job and the plan -----------------------------------

    @property
    def n_layers(self) -> int:
        return self.plan.n_layers

    @property
    def compression(self) -> tuple[Any, ...]:
        """One compression spec per boundary (as job.json writes it)."""
        return tuple(b.compression.spec for b in self.plan.boundaries)

    @property
    def finetune_mode(self) -> str:
        return self.plan.finetune_mode

    @property
    def lora(self) -> LoraConfig | None:
        return self.job.model.lora if self.finetune_mode == "lora" else None

    @property
    def quantization(self) -> dict | None:
        q = self.job.model.quantization
        return None if q is None else q.to_dict()

    @property
    def weight_dtype(self) -> str | None:
        """Storage dtype of a frozen backbone, when the plan enabled it."""
        if "half-weights" not in self.plan.features or self.finetune_mode == "full":
            return None
        return self.job.model.weight_dtype

    @property
    def seed(self) -> int:
        return self.job.train.seed

    @property
    def wire_v2(self) -> bool:
        return "wire-v2" in self.plan.features

    @property
    def n_replicas(self) -> int:
        return self.plan.n_replicas

    @property
    def sync(self) -> SyncConfig:
        """How this stage's replicas stay equal (``train.sync``)."""
        return self.job.train.sync

    @property
    def train(self) -> StageTraining:
        return StageTraining.of(
            self.job.train,
            micro_batches=self.plan.schedule.micro_batches,
            schedule=self.plan.schedule.kind,
            recompute=self.plan.recompute,
            eval_batches=self.plan.eval_batches,
            calibration_tokens=(
                self.job.split.calibration_tokens
                if self.calibration_tokens is None
                else self.calibration_tokens
            ),
            checkpoint_every=self.job.train.checkpoint_every if self.snapshot_dir else 0,
            **{k: getattr(self, k) for k in _SPEC_TUNABLES},
        )

    def to_dict(self) -> dict[str, Any]:
        return to_data(self)


def parse_worker_spec(data: Any) -> WorkerSpec:
    """A validated WorkerSpec, or WorkerSpecError listing every bad field."""
    try:
        return parse(WorkerSpec, data)
    except SchemaError as exc:
        raise WorkerSpecError(exc.errors) from None


def reads_data(job: Job) -> bool:
    """Whether the job reads any data: a ``none`` job trains nothing, so no stage reads,
    fetches or tokenizes its ``data.source`` and no step or evaluation runs (reference,
    "Which parameters train")."""
    return job.finetune_mode != "none"


def needs_tokens(job: Job) -> bool:
    """Whether the job's corpus must be tokenized for stage 0 (it reads data, and the source
    is not random nor a .npy)."""
    source = job.data.source
    return reads_data(job) and source != "random" and not source.endswith(".npy")


def stage_data(job: Job, stage: int, tokens_path: str | None) -> StageData:
    """What the stage reads: stage 0 the job's tokens (a .npy, or the corpus tokenized to
    ``tokens_path``); the stages after it, and every stage of a ``none`` job, read none."""
    source = job.data.source
    if source == "random" or stage > 0 or not reads_data(job):
        return StageData(source="random")
    if source.endswith(".npy"):  # this node's copy of the file (``tokens_path``) when shipped
        return StageData(source="tokens", path=tokens_path or source)
    if tokens_path is None:
        raise ValueError(f"data.source {source!r} must be tokenized for stage 0 first")
    return StageData(source="corpus", path=tokens_path)


def worker_spec(
    job: Job,
    plan: Plan,
    stage: int,
    *,
    model: str | None = None,
    token: str,
    host: str = "127.0.0.1",
    next_endpoint: str | None = None,
    device: str = "cpu",
    snapshot_dir: str | None = None,
    export_dir: str | None = None,
    resume: bool = False,
    tokens_path: str | None = None,
    **tunables: Any,
) -> WorkerSpec:
    """The worker spec of one planned stage (``tunables``: ``link_timeout_s``,
    ``weight_decay``, ``loss_chunk_tokens``, ``calibration_tokens``, ``port``, and the float16
    test knobs ``loss_scale`` and ``inject_nan_step``). ``calibration_tokens`` defaults to the
    job's (its learned boundaries' setting), so the spec the daemon sends carries it."""
    tunables.setdefault("calibration_tokens", job.split.calibration_tokens)
    return WorkerSpec(
        job=job,
        plan=plan,
        stage=stage,
        model=model or job.model.pretrained,
        token=token,
        device=device,
        host=host,
        next=next_endpoint,
        data=stage_data(job, stage, tokens_path),
        snapshot_dir=snapshot_dir if job.train.checkpoint_every or resume else None,
        resume=resume,
        export_dir=export_dir,
        **tunables,
    )


def local_cluster(
    n: int, *, kind: str = "cpu", memory: int = 1 << 40, disk: int = 1 << 40
) -> list[Node]:
    """``n`` nodes of one device each with room for anything: a plan for stages run on one
    machine (tests, benchmarks), where only the cuts, the dtype and the schedule matter. A
    ``cuda`` device of unknown compute capability runs every dtype (as a fake GPU does)."""
    return [
        Node(
            node_id=f"local{i:03d}",
            name=f"local{i}",
            ram=memory,
            disk_free=disk,
            capabilities=CAPABILITIES,
            devices=(
                Device(kind=kind, index=0, name=kind, memory_total=memory, memory_free=memory),
            ),
        )
        for i in range(n)
    ]


def local_plan(
    job: Job,
    shape: ModelShape,
    *,
    stages: int | None = None,
    cuts: Sequence[int] | None = None,
    dtype: str | None = None,
) -> Plan:
    """The plan of ``job`` over ``stages`` local CPU stages (or the given ``cuts``), in
    ``dtype`` (default: the job's, else float32), times the job's ``split.replicas`` (the local
    stages' workers sync replicas). ValueError when it cannot be placed."""
    n = len(cuts) + 1 if cuts is not None else stages or 1
    if dtype is not None and job.model.dtype != dtype:
        job = dataclasses.replace(job, model=dataclasses.replace(job.model, dtype=dtype))
    kind = "cpu" if job.model.dtype in (None, "float32") else "cuda"
    replicas = job.split.replicas if isinstance(job.split.replicas, int) else 1
    cluster = local_cluster(n * replicas, kind=kind)
    own = CAPABILITIES
    if replicas > 1:
        own = CAPABILITIES | {REPLICAS_CAPABILITY}
        cluster = [dataclasses.replace(node, capabilities=own) for node in cluster]
    result = plan_job(job, cluster, own, shape=shape, cuts=cuts)
    if not isinstance(result, Plan):
        raise ValueError(f"cannot plan {job.name} on {n} local stage(s): {result.reason}")
    return result


__all__ = [
    "StageData",
    "StageTraining",
    "WorkerSpec",
    "WorkerSpecError",
    "local_cluster",
    "local_plan",
    "needs_tokens",
    "parse_worker_spec",
    "reads_data",
    "stage_data",
    "worker_spec",
]
