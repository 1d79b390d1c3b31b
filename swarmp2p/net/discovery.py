"""mDNS discovery: advertise this node as ``_swarmp2p._tcp.local.`` and browse for its swarm.

The TXT record carries only what finding a peer needs (swarm id, node id, name, control and
join ports, the node's public key, open invites, protocol version, a short hardware summary);
full details travel in the authenticated hello. mDNS is not trusted: an advert only says where
to try an authenticated join (which needs the secret) or a pairing (which needs the code), and
a removal only asks the daemon to confirm with a heartbeat. :func:`browse` lists the swarms on
the LAN for a machine that has none yet (`swarm up`).
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import socket
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from swarmp2p.timings import TIMINGS

SERVICE_TYPE = "_swarmp2p._tcp.local."
SKIPPED_INTERFACE_PREFIXES = ("docker", "br-", "veth", "virbr", "cni", "flannel")
"""Container and bridge interfaces that discovery skips unless pinned (loopback too, unless
it is all there is)."""

_log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True, slots=True)
class Advert:
    """What one node's TXT record says."""

    swarm_id: str
    node_id: str
    name: str
    port: int
    protocol: int
    hardware: str = ""
    join_port: int = 0
    key: str = ""
    """The node's z85 public key (its control and pairing ports' server key)."""
    invites: str = ""
    """Open pairing invites: ``nameplate:port`` pairs separated by commas (``open:port`` for
    an open swarm); the code's words never appear here."""

    def to_txt(self) -> dict[str, str]:
        txt = {
            "sid": self.swarm_id,
            "nid": self.node_id,
            "name": self.name,
            "port": str(self.port),
            "pv": str(self.protocol),
            "hw": self.hardware,
        }
        if self.join_port:
            txt["jp"] = str(self.join_port)
        if self.key:
            txt["key"] = self.key
        if self.invites:
            txt["inv"] = self.invites
        return txt

    def invite_ports(self) -> dict[str, int]:
        """Open invites: nameplate -> pairing port (malformed entries are skipped)."""
        out = {}
        for item in self.invites.split(","):
            plate, _, port = item.partition(":")
            if plate and port.isdigit() and 0 < int(port) < 65536:
                out[plate] = int(port)
        return out

    @classmethod
    def from_txt(cls, txt: Mapping[bytes | str, bytes | str | None]) -> Advert:
        """Decode a TXT record; ValueError naming the missing or bad key."""
        fields = {_text(k): _text(v) if v is not None else "" for k, v in txt.items()}
        for key in ("sid", "nid", "port", "pv"):
            if not fields.get(key):
                raise ValueError(f"mDNS TXT record lacks {key!r}: {sorted(fields)}")
        try:
            port, protocol = int(fields["port"]), int(fields["pv"])
            join_port = int(fields.get("jp") or 0)
        except ValueError:
            raise ValueError(
                f"mDNS TXT port {fields['port']!r} / pv {fields['pv']!r} / jp "
                f"{fields.get('jp')!r} are not integers"
            ) from None
        if not 0 < port < 65536 or not 0 <= join_port < 65536:
            raise ValueError(f"mDNS TXT port {port} or jp {join_port} is out of range")
        return cls(
            swarm_id=fields["sid"],
            node_id=fields["nid"],
            name=fields.get("name", ""),
            port=port,
            protocol=protocol,
            hardware=fields.get("hw", ""),
            join_port=join_port,
            key=fields.get("key", "")[:40],
            invites=fields.get("inv", "")[:400],
        )

    @property
    def instance_name(self) -> str:
        """The mDNS service instance name: unique per node and swarm."""
        return f"{self.node_id}-{self.swarm_id[:12]}.{SERVICE_TYPE}"


def _text(value: bytes | str) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else value


def list_interfaces() -> list[tuple[str, list[str]]]:
    """This host's interfaces with their IPv4 addresses, from ``ifaddr``."""
    import ifaddr  # a zeroconf dependency

    result = []
    for adapter in ifaddr.get_adapters():
        ips = [ip.ip for ip in adapter.ips if isinstance(ip.ip, str)]
        result.append((adapter.nice_name, ips))
    return result


def select_interfaces(
    interfaces: Iterable[tuple[str, list[str]]], pin: str | None = None
) -> list[tuple[str, str]]:
    """The ``(interface, IPv4)`` pairs to use: ``pin`` (a name or an IP) alone, or every
    interface except container/bridge ones and loopback -- loopback only when nothing else is."""
    interfaces = list(interfaces)
    if pin:
        chosen = [(name, ip) for name, ips in interfaces for ip in ips if pin in (name, ip)]
        if not chosen:
            known = ", ".join(f"{name}={'/'.join(ips) or '-'}" for name, ips in interfaces)
            raise ValueError(
                f"--interface {pin!r} matches no interface name or IPv4 address here ({known})"
            )
        return chosen
    chosen, loopback = [], []
    for name, ips in interfaces:
        for ip in ips:
            if ipaddress.ip_address(ip).is_loopback:
                loopback.append((name, ip))
            elif not name.startswith(SKIPPED_INTERFACE_PREFIXES):
                chosen.append((name, ip))
    return chosen or loopback


def local_networks() -> list[ipaddress.IPv4Network]:
    """The IPv4 networks this host's interfaces are on (from ``ifaddr``)."""
    import ifaddr

    return [
        ipaddress.ip_network(f"{ip.ip}/{ip.network_prefix}", strict=False)
        for adapter in ifaddr.get_adapters()
        for ip in adapter.ips
        if isinstance(ip.ip, str)
    ]


def best_address(addresses: Iterable[str], networks: Iterable[ipaddress.IPv4Network]) -> str:
    """The first of a peer's ``addresses`` on one of our ``networks``, else its first one."""
    addresses, networks = list(addresses), list(networks)
    if not addresses:
        raise ValueError("a peer advertised no IPv4 address")
    for address in addresses:
        try:
            ip = ipaddress.ip_address(address)
        except ValueError:
            continue
        if any(ip in net for net in networks):
            return address
    return addresses[0]


PeerCallback = Callable[[Advert, list[str]], None]
"""Called with a peer's advert and its IPv4 addresses."""


class Discovery:
    """Advertise this node and report adverts of the same swarm; runs on the caller's loop."""

    def __init__(
        self,
        advert: Advert,
        addresses: list[str],
        *,
        on_add: PeerCallback,
        on_remove: Callable[[str], None],
        accept: Callable[[Advert], bool] | None = None,
    ) -> None:
        self.advert = advert
        self._accept = accept
        """Which adverts to report (default: those of this advert's swarm id)."""
        self.addresses = addresses
        self._on_add = on_add
        self._on_remove = on_remove
        self._zc = None
        self._browser = None
        self._info = None
        self._names: dict[str, str] = {}  # instance name -> node id
        self._tasks: set[asyncio.Task] = set()

    async def start(self) -> None:
        """Register our service and start browsing (both on the running loop)."""
        from zeroconf import IPVersion, ServiceStateChange
        from zeroconf.asyncio import AsyncServiceBrowser, AsyncServiceInfo, AsyncZeroconf

        self._state_change = ServiceStateChange
        self._info_type = AsyncServiceInfo
        self._zc = AsyncZeroconf(interfaces=self.addresses, ip_version=IPVersion.V4Only)
        self._info = self._service_info(self.advert)
        self._browser = AsyncServiceBrowser(
            self._zc.zeroconf, SERVICE_TYPE, handlers=[self._on_change]
        )
        self._registered = asyncio.ensure_future(self._register())

    def _service_info(self, advert: Advert):
        return self._info_type(
            SERVICE_TYPE,
            advert.instance_name,
            addresses=[socket.inet_aton(ip) for ip in self.addresses],
            port=advert.port,
            properties=advert.to_txt(),
            server=f"{advert.node_id}-{advert.swarm_id[:12]}.local.",
        )

    async def update(self, advert: Advert) -> None:
        """Advertise ``advert`` from now on (a new swarm id after a rotation, open invites)."""
        old, self.advert = self.advert, advert
        if self._zc is None:
            return
        registered = getattr(self, "_registered", None)
        if registered is not None and not registered.done():
            await asyncio.wait([registered], timeout=TIMINGS.mdns_resolve_ms / 1000)
        info = self._service_info(advert)
        if advert.instance_name == old.instance_name:
            await (await self._zc.async_update_service(info))
        else:
            with contextlib.suppress(Exception):
                await (await self._zc.async_unregister_service(self._info))
            await (await self._zc.async_register_service(info, cooperating_responders=True))
        self._info = info

    async def _register(self) -> None:
        # No RFC 6762 probing (it costs about a second before the first announcement): the
        # instance name holds the node id and swarm id, so a clash means two nodes share a
        # node id, which the authenticated hello refuses with a clear error anyway.
        await (await self._zc.async_register_service(self._info, cooperating_responders=True))

    def _on_change(self, zeroconf, service_type: str, name: str, state_change) -> None:
        if state_change is self._state_change.Removed:
            node_id = self._names.pop(name, None)
            if node_id is not None:
                self._on_remove(node_id)
            return
        task = asyncio.ensure_future(self._resolve(service_type, name))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _resolve(self, service_type: str, name: str) -> None:
        info = self._info_type(service_type, name)
        if not await info.async_request(self._zc.zeroconf, TIMINGS.mdns_resolve_ms):
            return
        try:
            advert = Advert.from_txt(info.properties or {})
        except ValueError as exc:
            _log.debug("ignoring mDNS service %s: %s", name, exc)
            return
        if advert.node_id == self.advert.node_id:
            return
        wanted = (
            self._accept(advert)
            if self._accept is not None
            else advert.swarm_id == self.advert.swarm_id
        )
        if not wanted:
            return
        self._names[name] = advert.node_id
        self._on_add(advert, info.parsed_addresses())

    async def close(self) -> None:
        """Unregister our service (mDNS goodbye), stop browsing, close the sockets."""
        for task in [*self._tasks, getattr(self, "_registered", None)]:
            if task is not None:
                task.cancel()
        if self._browser is not None:
            await self._browser.async_cancel()
            self._browser = None
        if self._zc is not None:
            if self._info is not None:
                try:
                    await (await self._zc.async_unregister_service(self._info))
                except Exception as exc:  # best effort: we are closing anyway
                    _log.debug("mDNS unregister failed: %s", exc)
            await self._zc.async_close()
            self._zc = None


@dataclass(frozen=True, kw_only=True, slots=True)
class Seen:
    """One node of some swarm, as a browse saw it."""

    advert: Advert
    addresses: tuple[str, ...]


async def browse(
    seconds: float, *, until: Callable[[list[Seen]], bool] | None = None
) -> list[Seen]:
    """Every swarmp2p node advertised on the LAN within ``seconds`` (of any swarm), sooner
    once ``until(seen so far)`` is true. For a machine with no swarm yet: it advertises
    nothing."""
    from zeroconf import IPVersion, ServiceStateChange
    from zeroconf.asyncio import AsyncServiceBrowser, AsyncServiceInfo, AsyncZeroconf

    seen: dict[str, Seen] = {}
    done = asyncio.Event()
    tasks: set[asyncio.Task] = set()
    zc = AsyncZeroconf(ip_version=IPVersion.V4Only)

    async def resolve(name: str) -> None:
        info = AsyncServiceInfo(SERVICE_TYPE, name)
        if not await info.async_request(zc.zeroconf, TIMINGS.mdns_resolve_ms):
            return
        try:
            advert = Advert.from_txt(info.properties or {})
        except ValueError:
            return
        seen[name] = Seen(advert=advert, addresses=tuple(info.parsed_addresses()))
        if until is not None and until(list(seen.values())):
            done.set()

    def on_change(zeroconf, service_type: str, name: str, state_change) -> None:
        if state_change is ServiceStateChange.Removed:
            seen.pop(name, None)
            return
        task = asyncio.ensure_future(resolve(name))
        tasks.add(task)
        task.add_done_callback(tasks.discard)

    browser = AsyncServiceBrowser(zc.zeroconf, SERVICE_TYPE, handlers=[on_change])
    try:
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(done.wait(), seconds)
    finally:
        for task in list(tasks):
            task.cancel()
        await browser.async_cancel()
        await zc.async_close()
    return list(seen.values())
