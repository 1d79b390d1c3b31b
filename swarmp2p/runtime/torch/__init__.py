"""The torch stage runtime: imported only by worker processes."""

from swarmp2p.runtime.torch.half_storage import apply_half_storage
from swarmp2p.runtime.torch.introspect import (
    LINEAR_ATTENTION,
    Topology,
    decoder_config,
    introspect,
    layer_types,
)
from swarmp2p.runtime.torch.loader import (
    NotLoadableByName,
    check_free_disk,
    load_spec_stage,
    load_stage_shard,
    resolve_dtype,
    stage_keys,
)
from swarmp2p.runtime.torch.quantization import QuantSpec, normalize_spec
from swarmp2p.runtime.torch.runtime import TorchRuntime
from swarmp2p.runtime.torch.stage import Stage, StageCache, build_stage

__all__ = [
    "LINEAR_ATTENTION",
    "NotLoadableByName",
    "QuantSpec",
    "Stage",
    "StageCache",
    "Topology",
    "TorchRuntime",
    "apply_half_storage",
    "build_stage",
    "check_free_disk",
    "decoder_config",
    "introspect",
    "layer_types",
    "load_spec_stage",
    "load_stage_shard",
    "normalize_spec",
    "resolve_dtype",
    "stage_keys",
]
