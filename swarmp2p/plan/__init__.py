"""The shared planner: pure functions over plain data, standard library only.

Every peer runs `plan_job(job, cluster)` (training) or `plan_serve(shape, cluster, ...)`
(serving) on the same inputs and gets the same bytes.
"""

from swarmp2p.plan.hardware import (
    CAPABILITIES,
    DTYPES,
    ClusterError,
    Device,
    DtypeChoice,
    Node,
    can_run,
    cluster_to_json,
    load_cluster,
    parse_cluster,
    resolve_dtype,
    supported_dtypes,
)
from swarmp2p.plan.job import (
    FINETUNE_MODES,
    DataConfig,
    FieldError,
    Job,
    JobError,
    LoraConfig,
    ModelConfig,
    SplitConfig,
    TrainConfig,
)
from swarmp2p.plan.job import load as load_job
from swarmp2p.plan.job import parse as parse_job
from swarmp2p.plan.memory import Pricing, StageMemory, StagePricer, Workload, loss_chunk_tokens
from swarmp2p.plan.model_shape import ModelShape, from_config, read_safetensors_header
from swarmp2p.plan.model_shape import load as load_model_shape
from swarmp2p.plan.placement import (
    DEVICE_RESERVE,
    DISK_HEADROOM,
    candidate_devices,
    min_max_partition,
    plan_job,
    usable_memory,
)
from swarmp2p.plan.quantization import QuantSpec, bytes_per_param, estimate_weights_gb
from swarmp2p.plan.quantization import normalize as normalize_quantization
from swarmp2p.plan.result import Blocked, Plan, PlannedBoundary, PlannedStage
from swarmp2p.plan.schedule import SCHEDULES, Op, bubble_fraction, in_flight, stage_schedule
from swarmp2p.plan.serve import ServeInputs, ServePlan, ServeRequest, plan_serve
from swarmp2p.plan.split import (
    Compression,
    SplitSpec,
    StageSpec,
    layer_range,
    parse_compression,
)

__all__ = [
    "CAPABILITIES",
    "DEVICE_RESERVE",
    "DISK_HEADROOM",
    "DTYPES",
    "FINETUNE_MODES",
    "SCHEDULES",
    "Blocked",
    "ClusterError",
    "Compression",
    "DataConfig",
    "Device",
    "DtypeChoice",
    "FieldError",
    "Job",
    "JobError",
    "LoraConfig",
    "ModelConfig",
    "ModelShape",
    "Node",
    "Op",
    "Plan",
    "PlannedBoundary",
    "PlannedStage",
    "Pricing",
    "QuantSpec",
    "ServeInputs",
    "ServePlan",
    "ServeRequest",
    "SplitConfig",
    "SplitSpec",
    "StageMemory",
    "StagePricer",
    "StageSpec",
    "TrainConfig",
    "Workload",
    "bubble_fraction",
    "bytes_per_param",
    "can_run",
    "candidate_devices",
    "cluster_to_json",
    "estimate_weights_gb",
    "from_config",
    "in_flight",
    "layer_range",
    "load_cluster",
    "load_job",
    "load_model_shape",
    "loss_chunk_tokens",
    "min_max_partition",
    "normalize_quantization",
    "parse_cluster",
    "parse_compression",
    "parse_job",
    "plan_job",
    "plan_serve",
    "read_safetensors_header",
    "resolve_dtype",
    "stage_schedule",
    "supported_dtypes",
    "usable_memory",
]
