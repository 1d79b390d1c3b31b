"""The torch stage runtime: imported only by worker processes."""

from swarmp2p.runtime.torch.introspect import (
    LINEAR_ATTENTION,
    Topology,
    decoder_config,
    introspect,
    layer_types,
)
from swarmp2p.runtime.torch.runtime import TorchRuntime
from swarmp2p.runtime.torch.stage import Stage, StageCache, build_stage

__all__ = [
    "LINEAR_ATTENTION",
    "Stage",
    "StageCache",
    "Topology",
    "TorchRuntime",
    "build_stage",
    "decoder_config",
    "introspect",
    "layer_types",
]
