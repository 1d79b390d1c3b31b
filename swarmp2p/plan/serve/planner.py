"""Serving, planned like training: what ``swarm serve`` asks (:class:`ServeRequest`), where each
stage of the ring runs and in which dtype (:class:`ServePlan`), and
``plan_serve(shape, cluster, ...) -> ServePlan | Blocked``. Pure, standard library only.

Every stage's node recomputes the plan from the same :class:`ServeInputs` and refuses a
mismatch, as it does for training. The rules are training's (``placement``, ``placer``):

- devices: GPUs when the cluster has any, else CPUs, in node-id order. ``stages`` 0 is one
  stage per device (at most one per block), dropping the device with the least free memory
  while the stages do not fit; a number above the devices puts consecutive stages on one
  device (the roomiest take one more), and they must fit it together.
- dtype: ``precision.resolve_dtype``: bfloat16 on compute capability 8.0 and up, float16 on
  7.x, float32 below and on CPUs; an explicit dtype is checked against every device, one that
  cannot run it is left out when as many others remain, else Blocked names it.
- memory: a stage's blocks (the embeddings on the first, the head on the last) in the dtype or
  the quantization, plus the KV cache of ``max_sessions`` x ``max_context`` tokens and the
  prefix cache's budget ``prefix_cache_mb`` (``memory.StagePricer``), and on the first stage
  a draft model's weights and KV cache (``draft``: the same sessions, context and dtype),
  within the device's
  usable memory (``DEVICE_RESERVE`` kept back). The prefix cache holds ``prefix_blocks``
  prompt blocks on every stage: as many as the budget holds on the stage whose blocks are
  largest (0 for a model with recurrent layers, whose state no block can hold).
- split: ``cost`` by default: a decode step is as slow as its slowest stage, so the split
  balances forward FLOPs, the head's matmul priced on the last stage; ``equal`` and
  ``weighted`` as for training. One split implementation: ``placer.Placer``. Training's
  default ``speed`` split is not offered: it prices a training step (batch x sequence tokens,
  gradients sent back) at each device's measured training speed, which says nothing of a
  decode step; serving balances FLOPs as if every device were equally fast.
- a trained model keeps its ``bounds``; each stage goes to the first of its shard's
  ``holders`` with room left, else to the device with the most room (which fetches the shard).
  Its boundaries (``trained_compression``, the manifest's) are priced as training prices them
  (a learned bottleneck's halves in the dtype on the stages either side), and a ring with a
  learned bottleneck goes only onto nodes declaring ``calibrated-bottleneck``: training's rule
  (``placer.bottleneck_needs``); the others are left out, and Blocked names them when none is left.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from swarmp2p.plan.hardware import CAPABILITIES, Node, resolve_dtype
from swarmp2p.plan.memory import (
    PREFIX_BLOCK_TOKENS,
    Pricing,
    StageMemory,
    StagePricer,
    Workload,
)
from swarmp2p.plan.model_shape import ModelShape
from swarmp2p.plan.placer import (
    SERVE_FLOPS_PER_PARAM_TOKEN,
    Placed,
    Placer,
    bottleneck_needs,
    candidate_devices,
    device_attempts,
    device_key,
    lacking_capabilities,
    select_devices,
    torch_device,
    usable_memory,
)
from swarmp2p.plan.quantization import QuantSpec, parse_quantization
from swarmp2p.plan.result import Blocked
from swarmp2p.plan.serve.records import (
    BOUNDARY_COMPRESSIONS,
    MAX_CONTEXT,
    MAX_PREFIX_CACHE_MB,
    MAX_SESSIONS,
    MAX_STAGES,
    NAME_PATTERN,
    PREFIX_CACHE_MB,
    SERVE_SPLIT,
    BoundaryCompression,
    Dtype,
    ServePlan,
    ServeRequest,
    ServeStagePlan,
    SplitMode,
    boundary_codec,
    check_request,
    fixed_bits,
    parse_serve_request,
    request_error,
)
from swarmp2p.plan.split import Compression
from swarmp2p.schema import field

# --- planning ---------------------------------------------------------------------------------


def _size(n: float) -> str:
    """Bytes for a message: GB (2**30) from a tenth of one, MiB below."""
    return f"{n / 2**30:.1f} GB" if n >= 2**30 / 10 else f"{n / 2**20:.1f} MiB"


def _stack(devices: list[Placed], n: int) -> list[Placed]:
    """``n`` > len(devices) stages over ``devices`` in pipeline order, consecutive stages on one
    device; the devices with the most free memory take one more."""
    base, extra = divmod(n, len(devices))
    ranked = sorted(range(len(devices)), key=lambda i: (-devices[i][1].memory_free, i))
    more = set(ranked[:extra])
    return [p for i, p in enumerate(devices) for _ in range(base + (i in more))]


def plan_serve(
    shape: ModelShape,
    cluster_nodes: Sequence[Node],
    *,
    stages: int = 0,
    dtype: str | None = None,
    quantization: QuantSpec | dict | None = None,
    max_sessions: int = 4,
    max_context: int = 0,
    bounds: Sequence[Sequence[int]] | None = None,
    holders: Sequence[Sequence[str]] | None = None,
    compression: Sequence[str] = (),
    codes: bool | Sequence[bool] | None = None,
    split: SplitMode = SERVE_SPLIT,
    trained_compression: Sequence[Compression] = (),
    capabilities: frozenset[str] | None = None,
    prefix_cache_mb: int | None = 0,
    draft: ModelShape | None = None,
) -> ServePlan | Blocked:
    """Place a serving ring of ``shape`` on ``cluster_nodes``: a ServePlan, or Blocked naming
    every device that cannot take its stage (the node, the device and the bytes).

    ``max_context`` 0 is the model's limit (and no session holds more than it). ``bounds`` and
    ``holders`` (per stage, the nodes holding its trained shard, best first) place a trained
    model. ``compression``: one per boundary (default none); ``codes``: send them as codes
    (default: where both nodes declare the serve codec). ``trained_compression``: a trained
    model's boundaries, one per boundary of ``bounds`` (its manifest's ``compression``).
    ``capabilities`` are the planning peer's own (default: this version's CAPABILITIES).
    ``prefix_cache_mb``: the prefix cache's budget per stage (0: none; None: the largest of
    PREFIX_CACHE_MB, half that, ... 1 MiB with which the ring still places on as many stages as
    without a cache, else none, with a note saying so). ``draft``: the shape of a draft model
    stage 0 holds, priced there. Raises
    SchemaError for a request no cluster could meet (more stages than blocks, bounds that do
    not cover the model).
    """
    args = (shape, cluster_nodes, stages, dtype, quantization, max_sessions, max_context)
    rest = (bounds, holders, compression, codes, split, trained_compression, capabilities, draft)
    if prefix_cache_mb is not None:
        return _plan_serve(*args, *rest, prefix_cache_mb)
    # the default budget: what fits beside the ring (the ring placed without a cache first,
    # then the largest budget that places it on as many stages)
    if shape.recurrent:  # no cache, and a note that says why
        return _plan_serve(*args, *rest, PREFIX_CACHE_MB)
    bare = _plan_serve(*args, *rest, 0)
    if not isinstance(bare, ServePlan):
        return bare
    mb = PREFIX_CACHE_MB
    while mb >= 1:
        plan = _plan_serve(*args, *rest, mb)
        if isinstance(plan, ServePlan) and len(plan.stages) >= len(bare.stages):
            if mb < PREFIX_CACHE_MB:
                plan = _with_notes(
                    plan,
                    f"prefix cache {mb} MiB a stage (of the default {PREFIX_CACHE_MB}: the "
                    "devices have no room for more beside the sessions)",
                )
            return plan
        mb //= 2
    return _with_notes(
        bare,
        "prefix cache off: the devices have no room for a MiB of it beside the sessions "
        "(ask for one with --prefix-cache-mb N)",
    )


def _plan_serve(
    shape: ModelShape,
    cluster_nodes: Sequence[Node],
    stages: int,
    dtype: str | None,
    quantization: QuantSpec | dict | None,
    max_sessions: int,
    max_context: int,
    bounds: Sequence[Sequence[int]] | None,
    holders: Sequence[Sequence[str]] | None,
    compression: Sequence[str],
    codes: bool | Sequence[bool] | None,
    split: SplitMode,
    trained_compression: Sequence[Compression],
    capabilities: frozenset[str] | None,
    draft: ModelShape | None,
    prefix_cache_mb: int,
) -> ServePlan | Blocked:
    n = check_request(shape, stages, bounds, holders, compression, codes)
    trained = tuple(trained_compression)
    if trained and (bounds is None or len(trained) != len(bounds) - 1):
        raise request_error(
            "trained_compression",
            f"{len(trained)} boundary spec(s) need bounds of {len(trained) + 1} stages, got "
            f"{'none' if bounds is None else len(bounds)}",
        )
    own = CAPABILITIES if capabilities is None else frozenset(capabilities)
    quant = parse_quantization(quantization) if isinstance(quantization, dict) else quantization
    context = min(max_context or shape.max_positions, shape.max_positions)
    if not 1 <= max_sessions <= MAX_SESSIONS:
        raise request_error("max_sessions", f"must be in [1, {MAX_SESSIONS}], got {max_sessions}")
    candidates = candidate_devices(cluster_nodes)
    auto = n is None
    required = n if n is not None else min(len(candidates), shape.n_layers)
    if not candidates:
        return Blocked(
            reason=f"placed 0 of {max(required, 1)} serving stage(s); no live node advertises a device; start swarm up on a machine with a GPU or CPU",
            dtype=dtype,
            required=max(required, 1),
        )
    notes: list[str] = []
    if dtype is not None:
        choice = resolve_dtype(candidates, dtype)
        if choice.excluded:
            ok = [p for p in candidates if p not in choice.excluded]
            if auto or len(ok) < min(required, len(candidates)):
                return Blocked(
                    reason=f"placed {min(len(ok), required)} of {required} serving stage(s); "
                    f"{len(choice.excluded)} device(s) cannot serve in {dtype}:\n"
                    + "\n".join(choice.reason_lines)
                    + f"\nleave --dtype out (the best dtype every device runs) or serve on "
                    f"fewer stages (--stages {len(ok)})",
                    dtype=dtype,
                    required=required,
                    placed=min(len(ok), required),
                )
            notes.append(
                "left out, cannot run "
                + dtype
                + ": "
                + ", ".join(f"{nd.name} {d.label}" for nd, d in choice.excluded)
            )
            candidates = ok
    needs = bottleneck_needs(len(trained) + 1, trained)
    if needs:
        lacking = lacking_capabilities([nd for nd, _ in candidates], needs, own)
        bad = {nd.node_id for nd, _ in candidates if any(c not in nd.capabilities for c in needs)}
        ok = [p for p in candidates if p[0].node_id not in bad and all(c in own for c in needs)]
        if not ok:
            return Blocked(
                reason=f"placed 0 of {required} serving stage(s); {len(lacking)} capability(ies) "
                "missing:\n" + "\n".join(lacking),
                dtype=dtype,
                required=required,
            )
        if lacking:
            notes.append("left out: " + "; ".join(lacking))
        candidates = ok
    if not 0 <= prefix_cache_mb <= MAX_PREFIX_CACHE_MB:
        raise request_error(
            "prefix_cache_mb", f"must be in [0, {MAX_PREFIX_CACHE_MB}], got {prefix_cache_mb}"
        )
    if prefix_cache_mb and shape.recurrent:
        notes.append("prefix cache off: the model's linear-attention layers keep a recurrent state")
        prefix_cache_mb = 0
    if draft is not None and draft.max_positions < context:
        raise request_error(
            "draft",
            f"the draft model {draft.name} holds {draft.max_positions} positions, fewer than "
            f"the {context} a session may hold; serve with --max-context {draft.max_positions}",
        )
    ask = _Ask(
        shape,
        quant,
        max_sessions,
        context,
        compression,
        codes,
        split,
        bounds,
        trained,
        prefix_cache_mb * 2**20,
        draft,
    )
    if holders is not None:
        dtype_now = resolve_dtype(candidates, dtype).dtype
        return _place(ask, _by_holders(ask, candidates, dtype_now, holders), dtype_now, notes)
    selected = (
        select_devices(candidates, required)
        if required <= len(candidates)
        else _stack(candidates, required)
    )
    attempts = device_attempts(selected, auto)
    first: Blocked | None = None
    for devices in attempts:
        result = _place(ask, devices, resolve_dtype(devices, dtype).dtype, notes)
        if isinstance(result, ServePlan):
            if len(devices) < len(selected):
                left = [f"{nd.name} {d.label}" for nd, d in selected if (nd, d) not in devices]
                result = _with_notes(result, "left out for lack of free memory: " + ", ".join(left))
            return result
        first = first or result
    assert first is not None
    return first


@dataclass(frozen=True, slots=True)
class _Ask:
    shape: ModelShape
    quant: QuantSpec | None
    sessions: int
    context: int
    compression: Sequence[str]
    codes: bool | Sequence[bool] | None
    split: str
    bounds: Sequence[Sequence[int]] | None
    trained: tuple[Compression, ...] = ()
    prefix_bytes: int = 0
    draft: ModelShape | None = None

    def pricer(self, dtype: str) -> StagePricer:
        return StagePricer(
            self.shape,
            Pricing(dtype=dtype, finetune_mode="none", quantization=self.quant),
            Workload(
                training=False,
                serving_sessions=self.sessions,
                serving_tokens=self.context,
                prefix_cache_bytes=self.prefix_bytes,
                draft_bytes=self.draft_bytes(dtype),
            ),
        )

    def draft_bytes(self, dtype: str) -> int:
        """The draft model on stage 0: all its blocks, embedding and head in ``dtype`` (never
        quantized), with the KV cache of the same sessions and context."""
        if self.draft is None:
            return 0
        pricer = StagePricer(
            self.draft,
            Pricing(dtype=dtype, finetune_mode="none"),
            Workload(training=False, serving_sessions=self.sessions, serving_tokens=self.context),
        )
        return pricer.price(0, self.draft.n_layers, first=True, last=True).peak

    def sides(self, i: int, n: int) -> tuple[Compression | None, Compression | None]:
        """The trained boundaries stage i of n receives from and sends to (None: none)."""
        if not self.trained:
            return None, None
        return (self.trained[i - 1] if i > 0 else None, self.trained[i] if i < n - 1 else None)

    @property
    def cuts(self) -> tuple[int, ...] | None:
        return None if self.bounds is None else tuple(b[0] for b in self.bounds[1:])


def _by_holders(
    ask: _Ask, candidates: list[Placed], dtype: str, holders: Sequence[Sequence[str]]
) -> list[Placed]:
    """A trained model's stages: each on the first holder of its shard with room left, else on
    the device with the most room left (ties: pipeline order)."""
    assert ask.bounds is not None
    pricer, n = ask.pricer(dtype), len(ask.bounds)
    left = {device_key(nd, d): usable_memory(d) for nd, d in candidates}
    order = {device_key(nd, d): i for i, (nd, d) in enumerate(candidates)}
    out = []
    for i, (a, b) in enumerate(ask.bounds):
        receive, send = ask.sides(i, n)
        need = pricer.price(a, b, first=i == 0, last=i == n - 1, receive=receive, send=send).peak
        mine = [p for h in holders[i] for p in candidates if p[0].node_id == h]
        mine.sort(key=lambda p: list(holders[i]).index(p[0].node_id))
        others = sorted(
            (p for p in candidates if p not in mine),
            key=lambda p: (-left[device_key(*p)], order[device_key(*p)]),
        )
        fits = [p for p in (*mine, *others) if left[device_key(*p)] >= need]
        pick = fits[0] if fits else (mine or others)[0]
        left[device_key(*pick)] -= need
        out.append(pick)
    return out


def _place(ask: _Ask, devices: list[Placed], dtype: str, notes: list[str]) -> ServePlan | Blocked:
    placer = Placer(
        ask.shape,
        devices,
        ask.pricer(dtype),
        mode=ask.split,
        compression=ask.trained,
        flops_per_param_token=SERVE_FLOPS_PER_PARAM_TOKEN,
    )
    attempt = placer.split(ask.cuts)
    if attempt.ranges is None:
        return _memory_blocked(ask, placer, attempt.tried, attempt.prices, dtype)
    n = len(devices)
    compression = list(ask.compression) or ["none"] * (n - 1)
    stages = []
    for i, ((node, dev), (a, b)) in enumerate(zip(devices, attempt.ranges)):
        send = compression[i] if i < n - 1 else "none"
        if i == n - 1:
            codes = False
        elif ask.codes is None:
            codes = all("serve-codec" in nd.capabilities for nd in (node, devices[i + 1][0]))
        else:
            codes = ask.codes if isinstance(ask.codes, bool) else bool(ask.codes[i])
        stages.append(
            ServeStagePlan(
                index=i,
                node_id=node.node_id,
                node=node.name,
                device=torch_device(dev),
                device_label=dev.label,
                layers=(a, b),
                memory=attempt.prices[i],
                device_free=dev.memory_free,
                send_compression=send,
                send_codes=codes,
            )
        )
    pricer = ask.pricer(dtype)
    largest = max(pricer.prefix_block_bytes(a, b) for a, b in attempt.ranges)
    blocks = ask.prefix_bytes // largest if largest else 0
    if ask.prefix_bytes and not blocks:
        notes = [
            *notes,
            f"prefix cache off: one block of {PREFIX_BLOCK_TOKENS} tokens takes "
            f"{_size(largest)} on a stage, more than its budget",
        ]
    return ServePlan(
        model=ask.shape.name,
        dtype=dtype,
        quantization=ask.quant,
        max_sessions=ask.sessions,
        max_context=ask.context,
        prefix_blocks=blocks,
        draft=None if ask.draft is None else ask.draft.name,
        draft_compute=0.0
        if ask.draft is None
        else round(_compute(ask.draft) / _compute(ask.shape), 6),
        split_mode="fixed" if ask.cuts is not None else ask.split,
        stages=tuple(stages),
        notes=tuple(notes),
    )


def _memory_blocked(
    ask: _Ask,
    placer: Placer,
    ranges: Sequence[tuple[int, int]],
    prices: Sequence[StageMemory],
    dtype: str,
) -> Blocked:
    over = placer.overfull(tuple(ranges), prices)
    lines, bad = [], 0
    seen: set[tuple[str, str, int]] = set()
    for node, dev in placer.devices:
        key = device_key(node, dev)
        if key not in over or key in seen:
            continue
        seen.add(key)
        mine = [j for j, p in enumerate(placer.devices) if device_key(*p) == key]
        bad += len(mine)
        kv = sum(prices[j].kv_cache for j in mine)
        draft = sum(prices[j].draft for j in mine)
        what = ", ".join(f"{j} (layers {ranges[j][0]}-{ranges[j][1] - 1})" for j in mine)
        also = f", draft model {_size(draft)}" if draft else ""
        lines.append(
            f"{node.name} {dev.label}: stage{'s' if len(mine) > 1 else ''} {what} "
            f"need{'' if len(mine) > 1 else 's'} {_size(over[key])} (KV cache {_size(kv)}"
            f"{also}), {_size(usable_memory(dev))} usable"
        )
    hints = ["lower --max-sessions or --max-context", "add a node"]
    if ask.prefix_bytes:
        hints[0] += f" (or --prefix-cache-mb, {ask.prefix_bytes // 2**20} MiB a stage)"
    if ask.quant is None or ask.quant.bits == 8:
        hints.insert(1, """quantize (--quantization '{"bits": 4}')""")
    n = placer.n
    return Blocked(
        reason=(
            f"placed {n - bad} of {n} serving stage(s); {len(lines)} device(s) lack the memory "
            f"({ask.split if ask.cuts is None else 'fixed'} split, {dtype}, KV cache for "
            f"{ask.sessions} session(s) of {ask.context} tokens):\n"
            + "\n".join(lines)
            + "\n"
            + ", or ".join(hints)
        ),
        dtype=dtype,
        required=n,
        placed=n - bad,
    )


def _compute(shape: ModelShape) -> int:
    """Weights one token's forward multiplies: every block's active ones and the head's."""
    return sum(shape.layer_active_params) + shape.head_compute_params


def _with_notes(plan: ServePlan, note: str) -> ServePlan:
    fields = {name: getattr(plan, name) for name in ServePlan.__dataclass_fields__}
    fields["notes"] = (*plan.notes, note)
    return ServePlan(**fields)


# --- what every stage node re-checks ----------------------------------------------------------


@dataclass(frozen=True, kw_only=True, slots=True)
class ServeInputs:
    """Everything ``plan_serve`` reads. The issuing node fills in the request's side, the
    leader the live nodes' records (``cluster``); each stage's node plans again from these and
    refuses a plan it does not compute itself."""

    shape: ModelShape
    cluster: tuple[Node, ...] = ()
    """The node records of the live nodes the leader planned on."""
    stages: int = field(default=0, ge=0, le=MAX_STAGES)
    dtype: Dtype | None = None
    quantization: QuantSpec | None = None
    max_sessions: int = field(default=4, ge=1, le=MAX_SESSIONS)
    max_context: int = field(default=0, ge=0, le=MAX_CONTEXT)
    bounds: tuple[tuple[int, int], ...] | None = None
    holders: tuple[tuple[str, ...], ...] | None = None
    compression: tuple[BoundaryCompression, ...] = ()
    codes: bool | None = None
    trained_compression: tuple[Compression, ...] = ()
    """A trained model's boundaries (its manifest's ``compression``), one per boundary."""
    prefix_cache_mb: int | None = field(default=0, ge=0, le=MAX_PREFIX_CACHE_MB)
    """The prefix cache's budget per stage (MiB; 0: none; None: as much as fits, up to
    PREFIX_CACHE_MB)."""
    draft: str | None = field(default=None, min_len=1, max_len=4096)
    """The draft model as stage 0's node finds it (a folder or "embedded"); None: none."""
    draft_shape: ModelShape | None = None
    """Its shape (priced on stage 0)."""

    def __post_init__(self) -> None:
        if (self.draft is None) != (self.draft_shape is None):
            raise ValueError("draft and draft_shape: both or neither")

    def nodes(self) -> list[Node]:
        return list(self.cluster)

    def plan(self) -> ServePlan | Blocked:
        """``plan_serve`` of these inputs."""
        return plan_serve(
            self.shape,
            self.nodes(),
            stages=self.stages,
            dtype=self.dtype,
            quantization=self.quantization,
            max_sessions=self.max_sessions,
            max_context=self.max_context,
            bounds=self.bounds,
            holders=self.holders,
            compression=self.compression,
            codes=self.codes,
            trained_compression=self.trained_compression,
            prefix_cache_mb=self.prefix_cache_mb,
            draft=self.draft_shape,
        )


__all__ = [
    "BOUNDARY_COMPRESSIONS",
    "NAME_PATTERN",
    "PREFIX_CACHE_MB",
    "SERVE_SPLIT",
    "ServeInputs",
    "ServePlan",
    "ServeRequest",
    "ServeStagePlan",
    "boundary_codec",
    "fixed_bits",
    "parse_serve_request",
    "plan_serve",
]
