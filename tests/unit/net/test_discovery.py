"""Discovery: TXT encode/decode and interface selection (pure parts)."""

from __future__ import annotations

import pytest

from swarmp2p.net.discovery import SERVICE_TYPE, Advert, select_interfaces

ADVERT = Advert(
    swarm_id="s" * 16, node_id="a1", name="box", port=7737, protocol=1, hardware="cpu:2c/23G"
)


def test_txt_roundtrip_bytes_and_str():
    txt = ADVERT.to_txt()
    assert Advert.from_txt(txt) == ADVERT
    assert Advert.from_txt({k.encode(): v.encode() for k, v in txt.items()}) == ADVERT
    assert ADVERT.instance_name.endswith("." + SERVICE_TYPE)
    assert ADVERT.instance_name.startswith("a1-")


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"sid": None}, "lacks 'sid'"),
        ({"nid": ""}, "lacks 'nid'"),
        ({"port": "x"}, "are not integers"),
        ({"port": "70000"}, "out of range"),
    ],
)
def test_bad_txt_is_refused(change, message):
    txt = {**ADVERT.to_txt(), **change}
    txt = {k: v for k, v in txt.items() if v is not None}
    with pytest.raises(ValueError, match=message):
        Advert.from_txt(txt)


IFACES = [
    ("lo", ["127.0.0.1"]),
    ("eth0", ["192.168.1.5"]),
    ("docker0", ["172.17.0.1"]),
    ("br-1234", ["172.18.0.1"]),
    ("veth99", []),
    ("virbr0", ["192.168.122.1"]),
    ("cni0", ["10.88.0.1"]),
    ("flannel.1", ["10.244.0.0"]),
    ("wlan0", ["10.0.0.7"]),
]


def test_skips_container_bridges_and_loopback():
    assert select_interfaces(IFACES) == [("eth0", "192.168.1.5"), ("wlan0", "10.0.0.7")]


def test_loopback_when_nothing_else():
    assert select_interfaces([("lo", ["127.0.0.1"]), ("docker0", ["172.17.0.1"])]) == [
        ("lo", "127.0.0.1")
    ]


@pytest.mark.parametrize(
    ("pin", "expected"),
    [
        ("docker0", [("docker0", "172.17.0.1")]),
        ("10.0.0.7", [("wlan0", "10.0.0.7")]),
        ("lo", [("lo", "127.0.0.1")]),
    ],
)
def test_pin_by_name_or_ip(pin, expected):
    assert select_interfaces(IFACES, pin) == expected


def test_pin_unknown_names_the_choices():
    with pytest.raises(
        ValueError, match=r"--interface .eth9. matches no interface.*eth0=192\.168\.1\.5"
    ):
        select_interfaces(IFACES, "eth9")


def test_best_address_prefers_our_networks():
    import ipaddress

    from swarmp2p.net.discovery import best_address

    ours = [ipaddress.ip_network("192.168.1.0/24"), ipaddress.ip_network("127.0.0.0/8")]
    assert best_address(["10.9.0.4", "192.168.1.7"], ours) == "192.168.1.7"
    assert best_address(["10.9.0.4", "10.9.0.5"], ours) == "10.9.0.4"
    with pytest.raises(ValueError, match="no IPv4 address"):
        best_address([], ours)


def test_local_networks_include_loopback():
    import ipaddress

    from swarmp2p.net.discovery import local_networks

    assert any(ipaddress.ip_address("127.0.0.1") in net for net in local_networks())
