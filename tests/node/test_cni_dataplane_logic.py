"""The dataplane's pure parts (no kernel objects, no root): names and marks, nft scripts, route arguments, gateways."""

from __future__ import annotations

import hashlib
import ipaddress
from pathlib import Path

import pytest

from cni import dataplane
from cni.dataplane import masq, names
from cni.dataplane.bridge import gateway_addresses
from cni.dataplane.nl import random_mac
from cni.errors import CniError
from cni.netconf import BridgeConf
from cni.types import IPConfig


def test_host_veth_name_is_deterministic_short_and_distinct() -> None:
    a = names.host_veth_name("abc", "eth0")
    assert a == names.host_veth_name("abc", "eth0") and len(a) == 12 and a.startswith("veth")
    assert a != names.host_veth_name("abc", "eth1") and a != names.host_veth_name("abd", "eth0")
    # the separator keeps ("ab", "ceth0") apart from ("abc", "eth0")
    assert names.host_veth_name("ab", "ceth0") != a


def test_names_never_change_across_versions() -> None:
    """DEL and GC find what an earlier version's ADD made by these names: they are fixed SHA-256 prefixes."""
    assert names.host_veth_name("abc", "eth0") == "vethd887cd28"
    assert names.host_veth_name("abc", "eth0") == "veth" + hashlib.sha256(b"abc\0eth0").hexdigest()[:8]
    long_net = "n" * 100
    assert names.netkey(long_net) == "#" + hashlib.sha256(long_net.encode()).hexdigest()[:12]


def test_alias_and_rule_comment_carry_network_and_attachment() -> None:
    assert names.alias("net1", "cid", "eth0", False) == "nodeplug net1 eth0 cid +nomasq"
    assert names.alias("net1", "cid", "eth0", True) == "nodeplug net1 eth0 cid +masq"
    assert names.alias("net1", "cid", "eth0", True).startswith(names.alias_network_prefix("net1"))
    assert not names.alias("net10", "cid", "eth0", True).startswith(names.alias_network_prefix("net1"))
    assert names.alias_masq("nodeplug net1 eth0 cid +masq") is True
    assert names.alias_masq("nodeplug net1 eth0 cid +nomasq") is False
    assert names.alias_masq("nodeplug net1 eth0 cid") is None  # made by an earlier release: it did not say
    comment = names.rule_comment("net1", "veth01234567", "cid")
    assert comment == "nodeplug veth01234567 net1 cid"
    assert names.parse_rule_comment(comment) == ("veth01234567", "net1")
    assert names.parse_rule_comment("somebody else's rule") is None


def test_long_names_are_hashed_and_comments_fit_nft() -> None:
    long_net = "n" * 100
    key = names.netkey(long_net)
    assert key.startswith("#") and len(key) == 13 and key == names.netkey(long_net)
    comment = names.rule_comment(long_net, "veth01234567", "c" * 200)
    assert len(comment) <= 127 and names.parse_rule_comment(comment) == ("veth01234567", key)
    for cid in ("c" * 400, "c" * 233, "c" * 234, "d" * 234):
        text = names.alias(long_net, cid, "ethé12345678", True)
        assert len(text.encode()) <= 254 and text.endswith(" +masq")
    assert names.alias("n", "c" * 400, "eth0", True) != names.alias("n", "c" * 399 + "d", "eth0", True)


def test_rule_comment_cannot_break_out_of_nft_quotes() -> None:
    comment = names.rule_comment("net", "veth01234567", 'evil"; flush ruleset; "')
    assert '"' not in comment and ";" not in comment


def test_masquerade_script() -> None:
    addrs = [ipaddress.ip_interface("10.1.2.3/16"), ipaddress.ip_interface("fd00::3/64")]
    script = masq.rules_script("nodeplug vethX net c", addrs)
    assert script.splitlines() == [
        "add rule inet nodeplug postrouting ip saddr 10.1.2.3 ip daddr != 10.1.0.0/16 ip daddr != 224.0.0.0/4 "
        'masquerade comment "nodeplug vethX net c"',
        "add rule inet nodeplug postrouting ip6 saddr fd00::3 ip6 daddr != fd00::/64 ip6 daddr != ff00::/8 "
        'masquerade comment "nodeplug vethX net c"',
    ]
    declared = masq.rules_script("c", addrs[:1], declare=True)
    assert declared.startswith(
        "table inet nodeplug {\n  chain postrouting { type nat hook postrouting priority srcnat;"
    )


def test_one_gateway_per_family_with_the_address_prefix() -> None:
    ips = [
        IPConfig(ipaddress.ip_interface("10.0.0.5/24"), ipaddress.ip_address("10.0.0.1")),
        IPConfig(ipaddress.ip_interface("10.1.0.5/16"), ipaddress.ip_address("10.1.0.1")),
        IPConfig(ipaddress.ip_interface("fd00::5/64")),
        IPConfig(ipaddress.ip_interface("fd01::5/64"), ipaddress.ip_address("fd01::1")),
    ]
    assert gateway_addresses(ips) == [ipaddress.ip_interface("10.0.0.1/24"), ipaddress.ip_interface("fd01::1/64")]


def test_random_mac_is_local_unicast() -> None:
    for _ in range(50):
        first = int(random_mac().split(":")[0], 16)
        assert first & 0x02 and not first & 0x01


def test_without_nft_there_are_no_rules_to_delete(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # nft cannot be found
    assert masq.list_rules() == []
    assert masq.delete_attachment("net", "veth01234567") == 0
    with pytest.raises(CniError, match="ipMasq: command 'nft -f -' not found on PATH"):
        masq.add_rules("net", "veth01234567", "cid", [ipaddress.ip_interface("10.0.0.5/24")])


def test_status_without_nft_when_ipmasq_is_set(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    conf = BridgeConf(name="n", cni_version="1.0.0", bridge="npnever0", ip_masq=True)
    with pytest.raises(CniError) as e:
        dataplane.status(conf)
    # without CAP_NET_ADMIN (not root) the capability check comes first and is what STATUS names
    expected = "nft is not installed" if net_admin() else "CAP_NET_ADMIN"
    assert e.value.code == 50 and expected in e.value.details


def net_admin() -> bool:
    """Whether this process may create links (CAP_NET_ADMIN, bit 12 of its effective capabilities)."""
    with open("/proc/thread-self/status") as f:
        caps = next(line.split()[1] for line in f if line.startswith("CapEff:"))
    return bool(int(caps, 16) >> 12 & 1)
