"""The typed records daemons exchange about their machines. Standard library only.

- :class:`NodeRecord`: a node's hardware as its hellos carry it: the planner's
  :class:`~swarmp2p.plan.hardware.Node`, which of its devices ``SWARM_FAKE_DEVICES`` described
  (a fake GPU runs on the CPU) and what its own workers hold. On the wire it keeps the
  cluster.json form (``"fake": true`` on a fake device, ``"held"`` beside the node's fields).
- :class:`Host`: what the planner does not take (CPU share, machine, driver).
- :class:`MemoryReport`: a heartbeat's live memory, put into the sender's record on arrival.

Every one is parsed by ``swarmp2p.schema``: bad input from the network is refused with the
field's path (``node.hello.record.devices[0].memory_total: must be an integer >= 0``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from dataclasses import field as _field
from typing import Annotated

from swarmp2p.plan.hardware import Device, Node, Speeds
from swarmp2p.schema import Bounds, FieldError, SchemaError, field, parse, replace_errors, show

Bytes = Annotated[int, Bounds(ge=0)]
DeviceKey = Annotated[str, Bounds(pattern=r"(cuda|cpu|mps)(:\d{1,4})?")]
"""``cuda:0``, ``cpu:0``: a device of a node record (a plan's bare ``cuda`` keys as it is)."""


def device_key(device: Device | str) -> str:
    """``cuda:0``, ``cpu:0``: a device of a record, or a stage's torch device (``cpu``)."""
    if isinstance(device, str):
        return "cpu:0" if device == "cpu" else device
    return f"{device.kind}:{device.index}"


@dataclass(frozen=True, kw_only=True, slots=True)
class Held:
    """Bytes a node's own workers hold per device key: its training stages and served ones."""

    jobs: dict[DeviceKey, Bytes] = _field(default_factory=dict)
    serve: dict[DeviceKey, Bytes] = _field(default_factory=dict)


NO_HELD = Held()


@dataclass(frozen=True, kw_only=True, slots=True)
class MemoryReport:
    """A heartbeat's live memory: free bytes per device, what the sender's workers hold, its
    free disk where model files go (None: not told)."""

    free: dict[DeviceKey, Bytes] = _field(default_factory=dict)
    held: Held = NO_HELD
    disk: Bytes | None = None


@dataclass(frozen=True, kw_only=True, slots=True)
class Host:
    """A node's host facts the planner does not take."""

    cpu_cores: int = field(default=1, ge=1, le=1 << 20)
    """The CPUs this node may keep busy (affinity capped by its cgroup's quota)."""
    cpu_quota: float | None = field(default=None, gt=0)
    """Its cgroup's CPU quota in CPUs (None: unlimited)."""
    machine: str = field(default="", max_len=128)
    """A hash telling daemons on one machine from separate ones ("": unknown)."""
    driver: str = field(default="", max_len=128)
    """The NVIDIA driver version ("": none)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class NodeRecord:
    """A node's hardware as its hello carries it (see the module docstring)."""

    node: Node
    fake: frozenset[str] = frozenset()
    """Keys of the devices ``SWARM_FAKE_DEVICES`` described (they run on the CPU)."""
    held: Held = NO_HELD
    """What its own workers hold (its last heartbeat's report)."""

    def __post_init__(self) -> None:
        keys = {device_key(d) for d in self.node.devices}
        unknown = sorted(self.fake - keys)
        if unknown:
            raise ValueError(f"fake devices {unknown} are not devices of node {self.node.node_id}")

    @property
    def node_id(self) -> str:
        return self.node.node_id

    def is_fake(self, device: Device) -> bool:
        return device_key(device) in self.fake

    @classmethod
    def from_data(cls, value: object, path: str) -> NodeRecord:
        """The cluster.json form with ``"fake": true`` on a device and ``"held"`` beside."""
        if not isinstance(value, Mapping):
            raise ValueError(f"must be a node record (an object), got {show(value)}")
        data = dict(value)
        errors: list[FieldError] = []
        held = NO_HELD
        if "held" in data:
            try:
                held = parse(Held, data.pop("held"))
            except SchemaError as exc:
                errors += replace_errors(exc, f"{path}.held" if path else "held")
        fake: set[int] = set()
        devices = data.get("devices")
        if isinstance(devices, list):
            stripped = []
            for i, d in enumerate(devices):
                if isinstance(d, Mapping) and "fake" in d:
                    d = dict(d)
                    mark = d.pop("fake")
                    if type(mark) is not bool:
                        where = f"{path}.devices[{i}].fake" if path else f"devices[{i}].fake"
                        errors.append(
                            FieldError(
                                path=where, message=f"must be true or false, got {show(mark)}"
                            )
                        )
                    elif mark:
                        fake.add(i)
                stripped.append(d)
            data["devices"] = stripped
        try:
            node = parse(Node, data)
        except SchemaError as exc:
            errors += replace_errors(exc, path)
        if errors:
            raise SchemaError(errors)
        keys = frozenset(device_key(node.devices[i]) for i in fake)
        return cls(node=node, fake=keys, held=held)

    def to_data(self) -> dict[str, object]:
        from swarmp2p.schema import to_data

        data = to_data(self.node)
        for d in data["devices"]:
            if f"{d['kind']}:{d['index']}" in self.fake:
                d["fake"] = True
        if self.held != NO_HELD:
            data["held"] = to_data(self.held)
        return data

    def with_memory(self, report: MemoryReport | None) -> NodeRecord:
        """This record with a heartbeat's live memory in it (free memory capped by each
        device's total; the disk and the held bytes as told)."""
        if report is None:
            return self
        devices = tuple(
            dataclasses.replace(d, memory_free=min(report.free[k], d.memory_total))
            if (k := device_key(d)) in report.free
            else d
            for d in self.node.devices
        )
        disk = self.node.disk_free if report.disk is None else report.disk
        node = dataclasses.replace(self.node, devices=devices, disk_free=disk)
        return dataclasses.replace(self, node=node, held=report.held)

    def with_speeds(self, speeds: Mapping[str, Mapping[str, float]]) -> NodeRecord:
        """This record with measured speeds (device key -> dtype -> FLOP/s) on its devices."""
        devices = tuple(
            dataclasses.replace(d, speed=Speeds.from_data(dict(speeds[k]), k))
            if (k := device_key(d)) in speeds and speeds[k]
            else d
            for d in self.node.devices
        )
        return dataclasses.replace(self, node=dataclasses.replace(self.node, devices=devices))

    def with_link_speed(self, link_speed: int) -> NodeRecord:
        return dataclasses.replace(self, node=dataclasses.replace(self.node, link_speed=link_speed))


__all__ = [
    "NO_HELD",
    "Bytes",
    "DeviceKey",
    "Held",
    "Host",
    "MemoryReport",
    "NodeRecord",
    "device_key",
]
