"""Which dtype each device can train in, and the one dtype a job runs in.

Rules from the reference (predecessor-torch-runtime.md, "Compute capability and dtype"):
compute capability >= 8.0 trains bfloat16, float16 and float32; 7.x float16 and float32; below
7.0 float32 only. An empty capability means the node could not read one, so it is not
excluded. A CPU runs float32, and bfloat16 only when the job asks for it explicitly (most CPUs
compute bfloat16 far slower than float32). An explicit `model.dtype` wins and excludes the
devices that cannot run it; otherwise the best dtype every ready device supports is used.
"""

from __future__ import annotations

from dataclasses import dataclass

from swarmp2p.plan.hardware import Device, Node, compute_capability

DTYPES = ("bfloat16", "float16", "float32")
"""Compute dtypes, best first."""

DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


def supported_dtypes(device: Device, *, explicit: str | None = None) -> tuple[str, ...]:
    """Dtypes `device` trains in, best first; `explicit` is the job's `model.dtype`, if any."""
    if device.kind == "cpu":
        return ("bfloat16", "float32") if explicit == "bfloat16" else ("float32",)
    if device.kind == "mps":
        return ("float16", "float32")
    cc = compute_capability(device)
    if cc is None or cc >= (8, 0):
        return DTYPES
    if cc >= (7, 0):
        return ("float16", "float32")
    return ("float32",)


def can_run(device: Device, dtype: str, *, explicit: bool = False) -> bool:
    """Whether `device` can train in `dtype` (`explicit`: the job asked for it by name)."""
    return dtype in supported_dtypes(device, explicit=dtype if explicit else None)


@dataclass(frozen=True, kw_only=True, slots=True)
class DtypeChoice:
    """The job's dtype and the devices it excludes."""

    dtype: str
    excluded: tuple[tuple[Node, Device], ...] = ()
    """(node, device) pairs that cannot run `dtype`; only an explicit dtype excludes any."""

    @property
    def reason_lines(self) -> tuple[str, ...]:
        return tuple(f"{n.name} {d.label} cannot run {self.dtype}" for n, d in self.excluded)


def resolve_dtype(devices: list[tuple[Node, Device]], requested: str | None) -> DtypeChoice:
    """One dtype for the whole job over the ready `devices`.

    An explicit `requested` dtype wins and excludes the devices that cannot run it; otherwise
    the best dtype in DTYPES that every device supports (float32 runs everywhere).
    """
    if requested is not None:
        if requested not in DTYPES:
            raise ValueError(f"model.dtype: must be one of {', '.join(DTYPES)}, got {requested!r}")
        excluded = tuple((n, d) for n, d in devices if not can_run(d, requested, explicit=True))
        return DtypeChoice(dtype=requested, excluded=excluded)
    for dtype in DTYPES:
        if all(can_run(d, dtype) for _, d in devices):
            return DtypeChoice(dtype=dtype)
    return DtypeChoice(dtype="float32")  # unreachable: every device runs float32
