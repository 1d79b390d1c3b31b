"""Linear layers on oneDNN on the CPU in float32: a served stage's weights packed once, a
training stage's products forward and backward.

On the CPU, ``torch.nn.functional.linear`` over a float32 weight in its plain layout ran a
product of a few rows at a fraction of the core's speed on the dev machine; the weight
reordered once into oneDNN's blocked layout (what torch's own compiler does when it freezes a
model for the CPU) runs the same product 2.5-3.6x faster from 8 rows on, and the head faster
for one row too. Measured on one thread of the 2-core dev machine (AMD EPYC, AVX-512),
microseconds per call:

| weight | rows | plain | packed |
|---|---|---|---|
| 576 -> 1536 | 1 | 55 | 55 |
| 576 -> 1536 | 8 | 238 | 85 |
| 576 -> 49152 (the head) | 1 | 9,170 | 4,157 |
| 576 -> 49152 (the head) | 8 | 18,349 | 5,129 |

So a decode step of 8 sessions costs much less than 8 of one, and one session gains too. Only
inference uses it (the packed op has no gradient); a stage serving on the CPU in float32 packs
its plain ``nn.Linear`` layers once it has loaded (adapters, quantized and half-stored layers
keep theirs). Rows of one product come out as they would alone or batched, within float32
rounding of the plain product (the serving tests check greedy parity on packed stages).

Training changes its weights every step, so it does not pack them: a float32 CPU training stage
turns its plain ``nn.Linear`` layers into :class:`OneDnnLinear` (the same module, weight and
state dict; only ``forward`` differs), whose forward and both backward products go to oneDNN
with the weight as it is (``_linear_pointwise`` on a plain or transposed weight). One thread,
128 rows (a micro-batch of 128 tokens), the 576 -> 1536 projection: forward, input gradient and
weight gradient 2.1-2.5x faster than torch's plain products; the head likewise.

Both use torch's own oneDNN operators (``torch.ops.mkldnn``), which torch's compiler calls; the
install pins torch's version, and a build without them (``packing_available``) leaves every
layer plain.
"""

from __future__ import annotations

import torch
from torch import nn

PACK_ROWS_HINT = 16
"""The rows oneDNN lays a packed weight out for; 8 to 256 measured the same within noise."""


def packing_available() -> bool:
    """Whether this torch build can pack linear weights for oneDNN on the CPU (x86 builds with
    oneDNN can; others serve with the plain layout)."""
    ops = getattr(torch.ops, "mkldnn", None)
    return (
        torch.backends.mkldnn.is_available()
        and hasattr(ops, "_reorder_linear_weight")
        and hasattr(ops, "_linear_pointwise")
    )


class PackedLinear(nn.Module):
    """An inference-only ``nn.Linear`` whose weight lives in oneDNN's blocked layout."""

    def __init__(self, linear: nn.Linear, rows: int = PACK_ROWS_HINT) -> None:
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        with torch.no_grad():
            weight = linear.weight.detach()
            self.register_buffer(
                "packed", torch.ops.mkldnn._reorder_linear_weight(weight, rows), persistent=False
            )
            bias = linear.bias.detach().clone() if linear.bias is not None else None
        self.register_buffer("bias", bias, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _product(x, self.packed, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, packed"


def _product(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ weight.T + bias`` by oneDNN (``weight`` plain, a transposed view, or packed)."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


class _OneDnnLinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return _product(x, weight, bias)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        grad = grad.contiguous()
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:  # grad @ W: the product with W.T as its weight
            grad_x = _product(grad, weight.t(), None)
        rows = grad.reshape(-1, grad.shape[-1])
        if ctx.needs_input_grad[1]:  # grad.T @ x: [out, rows] by [rows, in]
            grad_w = _product(rows.t(), x.reshape(-1, x.shape[-1]).t(), None)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = rows.sum(0)
        return grad_x, grad_w, grad_b


class OneDnnLinear(nn.Linear):
    """``nn.Linear`` whose products (forward and backward) run on oneDNN: a float32 CPU
    training stage's layers become this class in place (:func:`use_onednn`)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _OneDnnLinearFn.apply(x.contiguous(), self.weight, self.bias)


def use_onednn(module: nn.Module) -> int:
    """Turn ``module``'s plain float32 CPU ``nn.Linear`` layers into :class:`OneDnnLinear`, in
    place (parameters, names and state dict unchanged); how many (0 where the build has no
    oneDNN). An adapter's base layer changes too (peft calls it and reads its weight, which
    stays); the adapters and half-stored layers are left as they are."""
    if not packing_available():
        return 0
    adapters = _adapter_layers(module, base_layers=False)
    changed = 0
    for child in module.modules():
        if id(child) not in adapters and _packable(child):
            child.__class__ = OneDnnLinear
            changed += 1
    return changed


def _adapter_layers(module: nn.Module, *, base_layers: bool) -> set[int]:
    """Ids of the modules inside peft's adapter layers (those with ``lora_A``), their base
    layers among them or not."""
    inside = set()
    for owner in module.modules():
        if hasattr(owner, "lora_A"):
            base = None if base_layers else getattr(owner, "base_layer", None)
            inside.update(id(m) for m in owner.modules() if m is not base)
    return inside


def _packable(child: nn.Module) -> bool:
    if type(child) is not nn.Linear or "forward" in vars(child):  # half storage patches forward
        return False
    weight = child.weight
    return weight.dtype == torch.float32 and weight.device.type == "cpu"


def pack_linears(module: nn.Module, rows: int = PACK_ROWS_HINT) -> int:
    """Replace ``module``'s plain float32 CPU ``nn.Linear`` layers by :class:`PackedLinear`, in
    place, for inference from then on; the number replaced (0 where the build cannot pack). A
    weight shared with another module (a tied head and embedding) stays for that module."""
    if not packing_available():
        return 0
    # an adapter layer (peft's) reads its base layer's and its adapters' weights: left as is
    adapted = _adapter_layers(module, base_layers=True)
    packed: dict[int, PackedLinear] = {}  # a layer held twice (a stage's head) packs once
    for parent in list(module.modules()):
        for name, child in list(parent.named_children()):
            if id(child) not in packed:
                if id(child) in adapted or not _packable(child):
                    continue
                packed[id(child)] = PackedLinear(child, rows)
            setattr(parent, name, packed[id(child)])
    return len(packed)


__all__ = [
    "PACK_ROWS_HINT",
    "OneDnnLinear",
    "PackedLinear",
    "pack_linears",
    "packing_available",
    "use_onednn",
]
