"""bitsandbytes weight quantization of a stage as it loads: 8-bit, 4-bit NF4/FP4."""

from __future__ import annotations

import logging

import torch
from torch import nn

from swarmp2p.plan.quantization import QuantSpec
from swarmp2p.plan.quantization import normalize as normalize_quantization
from swarmp2p.runtime.torch.model.hf_compat import is_fused_experts, set_eager_experts
from swarmp2p.runtime.torch.model.introspect import Topology

INSTALL_HINT = "pip install bitsandbytes (or run ./install.sh)"


def normalize_spec(spec: dict | QuantSpec | None) -> QuantSpec | None:
    """A spec dict -> the planner's ``QuantSpec``, or ``None`` for no quantization.

    One normaliser for the whole swarm (``swarmp2p.plan.quantization``): the leader's memory
    check and the stage that loads the weights cannot disagree on what a spec means.
    """
    if spec is None or isinstance(spec, QuantSpec):
        return spec
    return normalize_quantization(spec)


def import_bitsandbytes():
    """bitsandbytes, or an ImportError that says how to install it."""
    try:
        import bitsandbytes
    except ImportError as error:
        raise ImportError(
            f"weight quantization needs bitsandbytes, which is not importable ({error}); "
            f"{INSTALL_HINT}"
        ) from error
    return bitsandbytes


class _DropCastWarning(logging.Filter):
    """bitsandbytes' 8-bit CPU matmul logs a cast warning on every call (DESIGN pitfall)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("MatMul8bitLt: inputs will be cast")


def silence_cast_warning() -> None:
    """Drop bitsandbytes' per-matmul cast warning (idempotent)."""
    log = logging.getLogger("bitsandbytes.autograd._functions")
    if not any(isinstance(f, _DropCastWarning) for f in log.filters):
        log.addFilter(_DropCastWarning())


def bnb_config(spec: QuantSpec, skip: list[str]):
    """The transformers ``BitsAndBytesConfig`` equal to ``spec`` with ``skip`` kept full."""
    from transformers import BitsAndBytesConfig

    if spec.bits == 8:
        return BitsAndBytesConfig(
            load_in_8bit=True,
            llm_int8_threshold=spec.threshold,
            llm_int8_skip_modules=skip,
            llm_int8_enable_fp32_cpu_offload=spec.cpu_offload,
        )
    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type=spec.quant_type,
        bnb_4bit_use_double_quant=spec.double_quant,
        bnb_4bit_compute_dtype=getattr(torch, spec.compute_dtype),
        llm_int8_skip_modules=skip,
        llm_int8_enable_fp32_cpu_offload=spec.cpu_offload,
    )


def full_precision_modules(topology: Topology, spec: QuantSpec) -> list[str]:
    """Modules left unquantized: the spec's list, or by default the output head."""
    if spec.skip_modules is not None:
        return list(spec.skip_modules)
    return [topology.names["head"]]


class ExpertStack(nn.Module):
    """A fused MoE expert weight ``[E, out, in]`` with every expert's matrix quantized on its
    own (bitsandbytes replaces only ``nn.Linear``, which would leave the experts, nearly all of
    an MoE's weights, in 16 bits). Indexing an expert, which is how transformers' eager experts
    forward reads one, dequantizes only that expert."""

    def __init__(self, weight: torch.Tensor, spec: QuantSpec, dtype: torch.dtype) -> None:
        super().__init__()
        bnb = import_bitsandbytes()
        self.num_experts, self.out_features, self.in_features = weight.shape
        self.bits = spec.bits
        self.dtype = dtype
        for index in range(self.num_experts):
            matrix = weight[index].contiguous()
            if spec.bits == 4:
                param = bnb.nn.Params4bit(
                    matrix,
                    requires_grad=False,
                    quant_type=spec.quant_type,
                    compress_statistics=spec.double_quant,
                )
            else:
                param = bnb.nn.Int8Params(matrix.cpu(), requires_grad=False, has_fp16_weights=False)
            self.register_parameter(f"expert_{index}", param.to(weight.device))

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.num_experts, self.out_features, self.in_features))

    def __len__(self) -> int:
        return self.num_experts

    def __getitem__(self, index) -> torch.Tensor:
        import bitsandbytes.functional as F

        param = getattr(self, f"expert_{int(index)}")
        if self.bits == 4:
            return F.dequantize_4bit(param.data, param.quant_state).to(self.dtype)
        return F.int8_vectorwise_dequant(param.data, param.SCB).to(self.dtype)


class StageQuantizer:
    """Turns an empty model's linear layers into bitsandbytes ones, then quantizes each owned
    weight as it is read, by transformers' own quantize ops (GPT-2 Conv1D turned around first)."""

    def __init__(self, model: nn.Module, topology: Topology, spec: QuantSpec) -> None:
        bnb = import_bitsandbytes()
        from transformers.integrations.bitsandbytes import replace_with_bnb_linear
        from transformers.quantizers.quantizers_utils import should_convert_module

        silence_cast_warning()
        self.spec = spec
        self.model = model
        self.skip = full_precision_modules(topology, spec)
        self.config = bnb_config(spec, self.skip)
        replace_with_bnb_linear(
            model, modules_to_not_convert=self.skip or None, quantization_config=self.config
        )
        self._layers = (bnb.nn.Linear4bit, bnb.nn.Linear8bitLt)
        self._experts = {
            name
            for name, module in model.named_modules()
            if is_fused_experts(module)
            and not module.is_transposed
            and should_convert_module(name, self.skip or None)
        }
        if self._experts:
            # the eager experts forward reads one expert at a time: what ExpertStack serves
            set_eager_experts(topology.config)

    def owns(self, key: str) -> bool:
        """Whether the weight ``key`` is quantized as it loads."""
        module_name, _, name = key.rpartition(".")
        module = self.model.get_submodule(module_name)
        if module_name in self._experts:
            return getattr(module, name).ndim == 3
        return name == "weight" and isinstance(module, self._layers)

    def quantize(self, key: str, value: torch.Tensor) -> nn.Parameter | ExpertStack:
        """The quantized form of ``value``: a bnb parameter, or an ``ExpertStack``."""
        from transformers.integrations.bitsandbytes import Bnb4bitQuantize, Bnb8bitQuantize

        if key.rpartition(".")[0] in self._experts:
            return ExpertStack(value, self.spec, value.dtype)
        op = Bnb8bitQuantize(None) if self.spec.bits == 8 else Bnb4bitQuantize(None)
        return op.convert({key: [value]}, model=self.model, full_layer_name=key)[key]


def prepare(model: nn.Module, topology: Topology, spec: QuantSpec) -> StageQuantizer:
    """Get an empty model ready to quantize its owned weights as they load."""
    return StageQuantizer(model, topology, spec)
