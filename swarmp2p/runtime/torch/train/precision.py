"""Half-precision training of a pipeline stage: float32 master copies, dynamic loss scaling that
every stage agrees on, and the rule that a step with a non-finite loss or gradient fails the job.

- **Master copies** (Micikevicius et al. 2018, "Mixed Precision Training"): a float16 or
  bfloat16 stage computes in its dtype, but AdamW steps float32 copies of its trainable
  parameters and keeps its moments in float32; after the step the copies are rounded back into
  the stage. In float16, AdamW's ``eps = 1e-8`` is 0 and a zero-initialised LoRA B gives the A
  adapters 0/0 on the first step, so a float16 optimizer goes NaN (DESIGN, "Pitfalls").
- **Loss scaling** (float16 only): the last stage multiplies the float32 loss by the scale
  before backward, so small gradients survive float16; each stage unscales its gradients into
  the float32 copies. An overflow anywhere must skip the step everywhere, so the stages agree
  once per step over the boundary links (``agree``): the flags travel from the last stage to
  the first, the verdict back. The scale then changes the same way on every stage
  (``next_loss_scale``).
- **Failure**: a non-finite loss, a non-finite gradient in bfloat16 or float32, or float16
  gradients still overflowing at ``MIN_LOSS_SCALE`` raise ``NonFiniteError`` naming the stage,
  the step and the reason. A job never completes with NaN.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

INIT_LOSS_SCALE = 2.0**16
"""A float16 job's first loss scale: ``torch.amp.GradScaler``'s ``init_scale``."""
GROWTH_FACTOR = 2.0
"""The scale doubles after ``GROWTH_INTERVAL`` steps without overflow (GradScaler's default)."""
BACKOFF_FACTOR = 0.5
"""An overflow halves the scale (GradScaler's default)."""
GROWTH_INTERVAL = 2000
"""Good steps before the scale grows again (GradScaler's default: a fine-tune of a few hundred
steps keeps the scale an overflow left it at, which costs nothing while gradients fit)."""
MIN_LOSS_SCALE = 1.0
"""Below this the step fails instead of scaling down (DeepSpeed's ``min_loss_scale``): float16
gradients that overflow unscaled are not a scaling problem."""

HALF_DTYPES = (torch.float16, torch.bfloat16)
STEP_FLAGS, STEP_VERDICT = "step_flags", "step_verdict"
"""Control messages of the per-step agreement (upstream, then downstream)."""


class NonFiniteError(RuntimeError):
    """A step produced a non-finite loss or gradient that loss scaling cannot fix."""

    def __init__(self, *, stage: int, step: int, reason: str) -> None:
        self.stage, self.step, self.reason = stage, step, reason
        super().__init__(f"stage {stage}, step {step}: {reason}")

    @property
    def event_fields(self) -> dict[str, Any]:
        """What the worker's ``error`` event carries besides the message."""
        return {"failed_stage": self.stage, "step": self.step, "reason": self.reason}


# --- the loss scale and the verdict: pure --------------------------------------------------------


def next_loss_scale(scale: float, good_steps: int, overflow: bool) -> tuple[float, int]:
    """(scale, good steps) after a step: halve on overflow, double after GROWTH_INTERVAL good
    steps in a row (``torch.amp.GradScaler``'s rule)."""
    if overflow:
        return scale * BACKOFF_FACTOR, 0
    if good_steps + 1 >= GROWTH_INTERVAL:
        return scale * GROWTH_FACTOR, 0
    return scale, good_steps + 1


@dataclass(frozen=True, kw_only=True, slots=True)
class StepHealth:
    """What the stages found in one step (merged on the way from the last stage to the first)."""

    overflow: bool = False
    """A non-finite gradient: in float16 a loss scale too large for the gradients."""
    fatal: str | None = None
    """A problem no loss scale fixes (a non-finite loss)."""
    stage: int | None = None
    """The stage that found it (the fatal one first, else the one nearest the last stage)."""

    def merge(self, other: StepHealth) -> StepHealth:
        """Both stages' findings (``self`` is the stage before ``other``)."""
        if self.fatal is not None:
            pick = self
        elif other.fatal is not None or other.overflow:
            pick = other
        else:
            pick = self
        return StepHealth(
            overflow=self.overflow or other.overflow, fatal=pick.fatal, stage=pick.stage
        )

    def fields(self) -> dict[str, Any]:
        return {"overflow": self.overflow, "fatal": self.fatal, "failed_stage": self.stage}

    @classmethod
    def from_fields(cls, header: dict[str, Any]) -> StepHealth:
        overflow, fatal, stage = (header.get(k) for k in ("overflow", "fatal", "failed_stage"))
        if not isinstance(overflow, bool) or not isinstance(fatal, (str, type(None))):
            raise ValueError(f"bad step flags {header!r}")
        if stage is not None and (not isinstance(stage, int) or isinstance(stage, bool)):
            raise ValueError(f"bad step flags {header!r}")
        return cls(overflow=overflow, fatal=fatal, stage=stage)


@dataclass(frozen=True, kw_only=True, slots=True)
class Verdict:
    """What every stage does with a step."""

    skip: bool
    """Drop the step's gradients instead of stepping."""
    failure: str | None = None
    """Why the job fails (None: it goes on)."""
    failed_stage: int | None = None
    scale: float | None = None
    """The loss scale of the next step (None: no loss scaling)."""
    good_steps: int = 0

    def fields(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.__slots__}

    @classmethod
    def from_fields(cls, header: dict[str, Any]) -> Verdict:
        try:
            verdict = cls(**{k: header[k] for k in cls.__slots__})
        except KeyError as exc:
            raise ValueError(f"step verdict without {exc}: {header!r}") from None
        if not isinstance(verdict.skip, bool) or not isinstance(
            verdict.scale, (float, int, type(None))
        ):
            raise ValueError(f"bad step verdict {header!r}")
        return verdict


def decide(health: StepHealth, scaler: LossScaler | None) -> Verdict:
    """The step's verdict from every stage's findings (pure; run by the first stage).

    Without a scaler (bfloat16, float32) any non-finite value fails; with one, an overflow skips
    the step and halves the scale, down to MIN_LOSS_SCALE.
    """
    if health.fatal is not None:
        return Verdict(skip=True, failure=health.fatal, failed_stage=health.stage)
    if scaler is None:
        if health.overflow:
            return Verdict(
                skip=True,
                failure="a gradient is not finite (nan or inf) and only float16 scales its "
                "loss; lower train.lr or check the data",
                failed_stage=health.stage,
            )
        return Verdict(skip=False)
    if health.overflow and scaler.scale <= MIN_LOSS_SCALE:
        return Verdict(
            skip=True,
            failure=f"the gradients are not finite in float16 even at the minimum loss scale "
            f"{MIN_LOSS_SCALE:g}; train in bfloat16 or float32, or lower train.lr",
            failed_stage=health.stage,
            scale=scaler.scale,
        )
    scale, good = next_loss_scale(scaler.scale, scaler.good_steps, health.overflow)
    return Verdict(skip=health.overflow, scale=scale, good_steps=good)


@dataclass(kw_only=True, eq=False)
class LossScaler:
    """A float16 stage's dynamic loss scale; every stage of a job holds the same one."""

    scale: float = INIT_LOSS_SCALE
    good_steps: int = 0

    def __post_init__(self) -> None:
        if not (math.isfinite(self.scale) and self.scale > 0):
            raise ValueError(f"the loss scale must be a finite number > 0, got {self.scale!r}")

    def adopt(self, verdict: Verdict) -> None:
        """Take the next step's scale from the verdict (the first stage decided it)."""
        if verdict.scale is not None:
            self.scale, self.good_steps = float(verdict.scale), int(verdict.good_steps)

    def state_dict(self) -> dict[str, Any]:
        return {"scale": self.scale, "good_steps": self.good_steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scale, self.good_steps = float(state["scale"]), int(state["good_steps"])


def make_loss_scaler(dtype: torch.dtype, initial: float | None = None) -> LossScaler | None:
    """A loss scaler for a float16 stage (None for other dtypes)."""
    if dtype != torch.float16:
        if initial is not None:
            raise ValueError(
                f"a loss scale applies only to float16 training, this stage computes in {dtype}"
            )
        return None
    return LossScaler(scale=INIT_LOSS_SCALE if initial is None else float(initial))


# --- the per-step agreement over the boundary links ----------------------------------------------


def agree(
    health: StepHealth, scaler: LossScaler | None, *, step: int, prev: Any, next: Any
) -> Verdict:
    """Every stage's verdict on ``step``: the findings travel upstream (each stage merges its
    own), the first stage decides, the verdict travels downstream. Two small control messages
    per link and step; a one-stage pipeline just decides."""
    if next is not None:
        header, _ = next.recv_control(STEP_FLAGS)
        _check_step(header, step)
        health = health.merge(StepHealth.from_fields(header))
    if prev is None:
        verdict = decide(health, scaler)
    else:
        prev.send_control(STEP_FLAGS, step=step, **health.fields())
        header, _ = prev.recv_control(STEP_VERDICT)
        _check_step(header, step)
        verdict = Verdict.from_fields(header)
    if next is not None:
        next.send_control(STEP_VERDICT, step=step, **verdict.fields())
    return verdict


def _check_step(header: dict[str, Any], step: int) -> None:
    if header.get("step") != step:
        from swarmp2p.runtime.torch.train.boundary import StaleReply

        raise StaleReply(
            f"{header.get('name')} of step {header.get('step')} while finishing step {step}; "
            "the stages are out of step"
        )


# --- master copies and the optimizer -------------------------------------------------------------


def any_non_finite(tensors: Sequence[torch.Tensor]) -> bool:
    """Whether any element of ``tensors`` is nan or inf: one sum per tensor, where both
    propagate (a vectorised read; the max-abs ``_foreach_norm(inf)`` cost more than the AdamW
    step on the CPU). A finite sum beyond float32's range also counts: gradients that large
    are lost anyway."""
    if not tensors:
        return False
    sums = torch.stack([t.sum(dtype=torch.float32) for t in tensors])
    return not bool(sums.isfinite().all())


FUSED_DEVICES = ("cpu", "cuda")
"""Devices whose fused AdamW kernel steps float32 masters (torch >= 2.4 has one on the CPU): one
kernel per parameter instead of a dozen ops; a 73M-parameter SmolLM2 stage stepped 3.9x faster
on one CPU thread (0.30 -> 0.08 s, results equal within 3e-7)."""


def fused_adamw(masters: Sequence[torch.Tensor]) -> bool:
    """Whether AdamW over ``masters`` runs its fused kernel: every one float32 on one device of
    ``FUSED_DEVICES``."""
    devices = {m.device for m in masters}
    return (
        len(devices) == 1
        and next(iter(devices)).type in FUSED_DEVICES
        and all(m.dtype == torch.float32 for m in masters)
    )


class StageOptimizer:
    """AdamW over a stage's trainable parameters, stepping float32 master copies of the half
    precision ones (a float32 parameter is its own master: nothing is copied in float32 jobs)."""

    def __init__(
        self,
        params: Iterable[nn.Parameter],
        *,
        lr: float,
        betas: tuple[float, float],
        eps: float,
        weight_decay: float,
    ) -> None:
        self.params = list(params)
        if not self.params:
            raise ValueError("no trainable parameters to optimise")
        self.masters = [
            p if p.dtype not in HALF_DTYPES else nn.Parameter(p.detach().float().clone())
            for p in self.params
        ]
        self._half = [(p, m) for p, m in zip(self.params, self.masters) if m is not p]
        self._fused = fused_adamw(self.masters)
        self.optimizer = torch.optim.AdamW(
            self.masters,
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            **({"fused": True} if self._fused else {}),
        )

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop every gradient (the stage's and the master copies')."""
        for p in self.params:
            p.grad = None
        for m in self.masters:
            m.grad = None

    def gradients_finite(self, scale: float | None = None) -> bool:
        """Move the stage's gradients into the float32 copies, divided by ``scale`` (the loss
        scale they were computed under), and say whether every one is finite."""
        for p, m in self._half:
            m.grad = None if p.grad is None else p.grad.float()
            p.grad = None  # its float32 copy replaces it: the peak holds one of the two
        grads = [m.grad for m in self.masters if m.grad is not None]
        if not grads:
            return True
        if scale is None or scale == 1.0:
            return not any_non_finite(grads)
        groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
        for g in grads:
            groups.setdefault((g.device, g.dtype), []).append(g)
        finite = True
        for (device, _), group in groups.items():
            found = torch.zeros(1, device=device)
            inv = torch.full((1,), 1.0 / scale, device=device)
            torch._amp_foreach_non_finite_check_and_unscale_(group, found, inv)
            finite = finite and not bool(found.item())
        return finite

    def gradients(self) -> list[torch.Tensor]:
        """The float32 gradient of every master copy, after ``gradients_finite`` (a parameter
        that got none gets zeros: a replica average needs every one)."""
        for m in self.masters:
            if m.grad is None:
                m.grad = torch.zeros_like(m)
        return [m.grad for m in self.masters]

    def step(self) -> None:
        """One AdamW step of the masters, rounded back into the stage's parameters."""
        self.optimizer.step()
        self.masters_to_params()

    def masters_to_params(self) -> None:
        """Round the float32 masters into the stage's half-precision parameters (after a step,
        or after a replica sync wrote the masters)."""
        if self._half:
            with torch.no_grad():
                torch._foreach_copy_([p for p, _ in self._half], [m for _, m in self._half])

    def state_dict(self) -> dict[str, Any]:
        return {
            "adamw": self.optimizer.state_dict(),
            "masters": [m.detach().clone() for _, m in self._half],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a ``state_dict``; a plain AdamW state (older snapshots) restores the moments
        and takes the master copies from the parameters."""
        if "adamw" not in state:
            self._load_adamw(state)
            return
        masters = state["masters"]
        if len(masters) != len(self._half):
            raise ValueError(
                f"the saved optimizer holds {len(masters)} float32 master copies, this stage "
                f"needs {len(self._half)}; was it saved by a job in another dtype?"
            )
        with torch.no_grad():
            for (p, m), saved in zip(self._half, masters):
                if saved.shape != m.shape:
                    raise ValueError(
                        f"a saved master copy has shape {tuple(saved.shape)}, the parameter "
                        f"{tuple(m.shape)}"
                    )
                m.copy_(saved)
                p.copy_(saved)
        self._load_adamw(state["adamw"])

    def _load_adamw(self, state: dict[str, Any]) -> None:
        """Load AdamW's state; a state saved by the unfused AdamW (or the fused one) resumes in
        the kernel this optimizer chose, its step counts moved where that kernel reads them."""
        self.optimizer.load_state_dict(state)
        for group in self.optimizer.param_groups:
            group["fused"] = True if self._fused else None
            group["foreach"] = None
            for p in group["params"]:
                st = self.optimizer.state.get(p, {})
                if self._fused and isinstance(st.get("step"), torch.Tensor):
                    st["step"] = st["step"].to(device=p.device, dtype=torch.float32)
