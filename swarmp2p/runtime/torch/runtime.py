"""The object ``get_runtime("torch")`` returns: the torch stage runtime's entry points."""

from __future__ import annotations

from swarmp2p.runtime.torch.model.embedded import ensure_embedded
from swarmp2p.runtime.torch.model.half_storage import apply_half_storage
from swarmp2p.runtime.torch.model.introspect import introspect
from swarmp2p.runtime.torch.model.loader import load_stage_shard
from swarmp2p.runtime.torch.model.quantization import normalize_spec
from swarmp2p.runtime.torch.model.stage import build_stage


class TorchRuntime:
    """Entry points of the torch runtime, for callers that resolve it by name."""

    name = "torch"

    introspect = staticmethod(introspect)
    build_stage = staticmethod(build_stage)
    load_stage_shard = staticmethod(load_stage_shard)
    normalize_quantization = staticmethod(normalize_spec)
    apply_half_storage = staticmethod(apply_half_storage)
    ensure_embedded = staticmethod(ensure_embedded)
