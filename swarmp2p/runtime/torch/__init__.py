"""The torch stage runtime: imported only by worker processes."""

from swarmp2p.runtime.torch.model.half_storage import apply_half_storage
from swarmp2p.runtime.torch.model.introspect import (
    LINEAR_ATTENTION,
    Topology,
    decoder_config,
    introspect,
    layer_types,
)
from swarmp2p.runtime.torch.model.loader import (
    NotLoadableByName,
    check_free_disk,
    load_spec_stage,
    load_stage_shard,
    resolve_dtype,
    stage_keys,
)
from swarmp2p.runtime.torch.model.quantization import QuantSpec, normalize_spec
from swarmp2p.runtime.torch.model.stage import Stage, StageCache, build_stage
from swarmp2p.runtime.torch.runtime import TorchRuntime

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
