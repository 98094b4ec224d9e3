"""Network config parsing: defaults, the reference bridge's key names, IPAM-plugin invocations, result round trips."""

from __future__ import annotations

import ipaddress
from typing import Any

import pytest

from cni import netconf, versions
from cni.errors import CniError
from cni.netconf import BridgeConf, IpamPluginConf
from cni.types import Result


def base(**kw: Any) -> dict[str, Any]:
    return {"cniVersion": "1.0.0", "name": "podnet", "type": "nodeplug", **kw}


def test_defaults() -> None:
    c = netconf.parse(base())
    assert isinstance(c, BridgeConf)
    assert (c.bridge, c.socket, c.mtu, c.is_gateway, c.ip_masq, c.ipam_conf) == (
        "nodeplug0",
        "/run/nodeplug/cni.sock",
        None,
        False,
        False,
        None,
    )


def test_bridge_keys_and_is_default_gateway_implies_gateway() -> None:
    c = netconf.parse(
        base(bridge="br9", mtu=1400, isDefaultGateway=True, ipMasq=True, hairpinMode=True, promiscMode=True, vlan=7)
    )
    assert isinstance(c, BridgeConf)
    assert (c.bridge, c.mtu, c.is_gateway, c.is_default_gateway, c.ip_masq, c.hairpin_mode, c.promisc_mode, c.vlan) == (
        "br9",
        1400,
        True,
        True,
        True,
        True,
        True,
        7,
    )


def test_datapath_defaults_to_bridge_and_is_checked() -> None:
    """A config naming no datapath is a bridge config (every conflist written before the routed datapath existed)."""
    assert isinstance(c := netconf.parse(base()), BridgeConf) and (c.datapath, c.routed) == ("bridge", False)
    assert isinstance(c := netconf.parse(base(datapath="routed")), BridgeConf) and c.routed
    cases = [("Routed", '"bridge" or "routed", got "Routed"'), (1, "a string, got 1"), (["x"], 'a string, got ["x"]')]
    for bad, why in cases:
        with pytest.raises(CniError) as e:
            netconf.parse(base(datapath=bad))
        assert e.value.code == 7 and e.value.details == f"datapath: expected {why}"
    with pytest.raises(CniError, match='vlan: expected nothing with "datapath": "routed"'):
        netconf.parse(base(datapath="routed", vlan=7))


def test_ipam_ranges_defaults_like_host_local() -> None:
    c = netconf.parse(
        base(ipam={"type": "nodeplug", "ranges": [[{"subnet": "10.1.0.0/24"}], [{"subnet": "fd01::/120"}]]})
    )
    assert isinstance(c, BridgeConf) and c.ipam_conf is not None
    v4, v6 = c.ipam_conf.ranges[0][0], c.ipam_conf.ranges[1][0]
    assert (str(v4.range_start), str(v4.range_end), str(v4.gateway)) == ("10.1.0.1", "10.1.0.254", "10.1.0.1")
    assert (str(v6.range_start), str(v6.range_end), str(v6.gateway)) == ("fd01::1", "fd01::ff", "fd01::1")
    assert c.ipam_conf.data_dir == "/var/lib/nodeplug/ipam"


def test_host_local_single_range_shorthand() -> None:
    c = netconf.parse(base(ipam={"type": "nodeplug", "subnet": "10.2.0.0/16", "rangeStart": "10.2.1.0"}))
    assert isinstance(c, BridgeConf) and c.ipam_conf is not None
    assert str(c.ipam_conf.ranges[0][0].range_start) == "10.2.1.0"


def test_ipam_invocation_is_recognised_and_ignores_the_callers_fields() -> None:
    raw = {
        "cniVersion": "1.0.0",
        "name": "refnet",
        "type": "bridge",
        "mtu": "not ours to judge",
        "ipam": {"type": "nodeplug", "ranges": [[{"subnet": "10.3.0.0/24"}]]},
    }
    assert netconf.is_ipam_invocation(raw)
    c = netconf.parse(raw)
    assert isinstance(c, IpamPluginConf) and c.type == "bridge"
    assert not netconf.is_ipam_invocation(base(ipam={"type": "nodeplug", "ranges": [[{"subnet": "10.3.0.0/24"}]]}))
    assert not netconf.is_ipam_invocation({**raw, "ipam": {"type": "host-local"}})


def test_delegated_ipam_is_kept_raw() -> None:
    c = netconf.parse(base(ipam={"type": "host-local", "subnet": "10.4.0.0/24"}))
    assert isinstance(c, BridgeConf) and c.ipam_conf is None and c.ipam_type == "host-local"


def test_prev_result_and_valid_attachments() -> None:
    prev = {
        "cniVersion": "0.4.0",
        "interfaces": [{"name": "eth0", "sandbox": "/run/netns/p"}],
        "ips": [{"version": "4", "address": "10.5.0.2/24", "gateway": "10.5.0.1", "interface": 0}],
        "routes": [{"dst": "0.0.0.0/0"}],
    }
    c = netconf.parse(base(prevResult=prev, **{"cni.dev/valid-attachments": [{"containerID": "a", "ifname": "eth0"}]}))
    assert c.prev_result is not None
    assert c.prev_result.ips[0].address == ipaddress.ip_interface("10.5.0.2/24")
    assert c.valid_attachments == (("a", "eth0"),)


@pytest.mark.parametrize("version", versions.SUPPORTED)
def test_result_round_trip_through_every_version(version: str) -> None:
    r = Result.from_dict(
        {
            "cniVersion": "1.1.0",
            "interfaces": [{"name": "eth0", "mac": "aa:bb:cc:dd:ee:ff", "sandbox": "/run/netns/p", "mtu": 1400}],
            "ips": [{"address": "fd00::5/64", "gateway": "fd00::1", "interface": 0}],
            "routes": [{"dst": "::/0", "gw": "fd00::1", "table": 100, "scope": 0}],
            "dns": {"nameservers": ["fd00::53"], "search": ["svc"]},
        }
    )
    out = versions.convert_result(r.to_dict(), version)
    back = Result.from_dict(out)
    assert back.ips == r.ips and back.dns == r.dns
    assert back.interfaces[0].name == "eth0" and back.routes[0].dst == r.routes[0].dst
    if version == "1.1.0":
        assert back == r


def test_unsupported_conversion_is_code_1() -> None:
    with pytest.raises(CniError) as e:
        versions.convert_result(Result().to_dict(), "0.2.0")
    assert e.value.code == 1


def test_gc_attachments_under_the_older_key_too() -> None:
    c = netconf.parse(base(**{"cni.dev/attachments": [{"containerID": "b", "ifname": "net1"}]}))
    assert c.valid_attachments == (("b", "net1"),)


def test_reprs_leave_out_the_raw_config_and_the_request_s_environment_and_stdin() -> None:
    from cni import skel

    secret = "s3cret-token"
    # a key for another plugin of the chain: nodeplug keeps it only in the raw config
    bridge = netconf.parse(base(kubeconfigToken=secret))
    ipam = {"type": "nodeplug", "ranges": [[{"subnet": "10.3.0.0/24"}]]}
    plugin = netconf.parse({**base(type="bridge"), "kubeconfigToken": secret, "ipam": ipam})
    assert isinstance(plugin, IpamPluginConf) and secret in str(bridge.raw) and secret in str(plugin.raw)
    request = skel.Request(
        "ADD", "cid", "/run/netns/x", "eth0", skel.CniArgs(), (), bridge, env={"CNI_X": secret}, stdin=secret.encode()
    )
    for value in (bridge, plugin, request):
        text = repr(value)
        assert secret not in text, text
        assert text.startswith(f"{type(value).__name__}(") and "name='podnet'" in text
