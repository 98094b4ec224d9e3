"""The CNI protocol with injected env, stdin and stdout: every malformed input gets its spec error JSON."""

from __future__ import annotations

import io
import json
from typing import Any

import pytest

from cni import skel, versions
from cni.errors import CniError
from cni.types import Interface, IPConfig, Result, Route

CONF: dict[str, Any] = {
    "cniVersion": "1.1.0",
    "name": "podnet",
    "type": "nodeplug",
    "ipam": {"type": "nodeplug", "ranges": [[{"subnet": "10.22.0.0/24"}]]},
}
ENV = {
    "CNI_COMMAND": "ADD",
    "CNI_CONTAINERID": "abc123",
    "CNI_NETNS": "/run/netns/x",
    "CNI_IFNAME": "eth0",
    "CNI_PATH": "/opt/cni/bin:/usr/lib/cni",
}


class Recorder:
    def __init__(self, result: Result | None = None, error: Exception | None = None) -> None:
        self.calls: list[skel.Request] = []
        self.result, self.error = result, error

    def __call__(self, req: skel.Request) -> Result | None:
        self.calls.append(req)
        if self.error is not None:
            raise self.error
        return self.result


def sample_result() -> Result:
    import ipaddress

    return Result(
        interfaces=(
            Interface("br0", "aa:bb:cc:dd:ee:01"),
            Interface("veth1"),
            Interface("eth0", "aa:bb", "/run/x", 1400),
        ),
        ips=(
            IPConfig(ipaddress.ip_interface("10.22.0.2/24"), ipaddress.ip_address("10.22.0.1"), 2),
            IPConfig(ipaddress.ip_interface("fd00::2/64"), ipaddress.ip_address("fd00::1"), 2),
        ),
        routes=(Route(ipaddress.ip_network("0.0.0.0/0"), ipaddress.ip_address("10.22.0.1"), mtu=1400, priority=5),),
    )


def invoke(env: dict[str, str], conf: Any = CONF, handler: Recorder | None = None) -> tuple[int, Any, Recorder]:
    h = handler or Recorder(sample_result())
    stdin = conf if isinstance(conf, bytes) else json.dumps(conf).encode()
    out = io.StringIO()
    code = skel.run({c: h for c in ("ADD", "DEL", "CHECK", "GC", "STATUS")}, env, stdin, out)
    text = out.getvalue()
    return code, (json.loads(text) if text else None), h


def test_add_prints_the_result_in_the_config_version() -> None:
    code, out, h = invoke(ENV)
    assert code == 0
    assert out["cniVersion"] == "1.1.0"
    assert out["routes"] == [{"dst": "0.0.0.0/0", "gw": "10.22.0.1", "mtu": 1400, "priority": 5}]
    req = h.calls[0]
    assert (req.command, req.container_id, req.netns, req.ifname) == ("ADD", "abc123", "/run/netns/x", "eth0")
    assert req.path == ("/opt/cni/bin", "/usr/lib/cni")
    assert req.conf.name == "podnet"
    assert req.env["CNI_COMMAND"] == "ADD" and json.loads(req.stdin) == CONF


@pytest.mark.parametrize("version", ["0.3.0", "0.3.1", "0.4.0"])
def test_old_result_versions_carry_ip_version_and_drop_new_fields(version: str) -> None:
    code, out, _ = invoke(ENV, {**CONF, "cniVersion": version})
    assert code == 0
    assert out["cniVersion"] == version
    assert [ip["version"] for ip in out["ips"]] == ["4", "6"]
    assert out["routes"] == [{"dst": "0.0.0.0/0", "gw": "10.22.0.1"}]
    assert out["interfaces"][2] == {"name": "eth0", "mac": "aa:bb", "sandbox": "/run/x"}


def test_1_0_0_result_has_no_ip_version_and_no_1_1_fields() -> None:
    code, out, _ = invoke(ENV, {**CONF, "cniVersion": "1.0.0"})
    assert code == 0
    assert all("version" not in ip for ip in out["ips"])
    assert "mtu" not in out["interfaces"][2]
    assert out["routes"][0] == {"dst": "0.0.0.0/0", "gw": "10.22.0.1"}


@pytest.mark.parametrize("command", ["DEL", "CHECK", "GC", "STATUS"])
def test_other_commands_print_nothing_on_success(command: str) -> None:
    code, out, h = invoke({**ENV, "CNI_COMMAND": command}, handler=Recorder(None))
    assert (code, out) == (0, None)
    assert h.calls[0].command == command


def test_del_without_netns_is_fine() -> None:
    env = {k: v for k, v in ENV.items() if k != "CNI_NETNS"}
    code, _, h = invoke({**env, "CNI_COMMAND": "DEL"}, handler=Recorder(None))
    assert code == 0 and h.calls[0].netns == ""


def test_gc_and_status_need_no_container_vars() -> None:
    for command in ("GC", "STATUS"):
        code, _, _ = invoke({"CNI_COMMAND": command}, handler=Recorder(None))
        assert code == 0


@pytest.mark.parametrize("stdin", [b"", b'{"cniVersion": "0.4.0"}', b"{not json", b"[" * 5000])
def test_version_has_one_answer_as_the_reference_plugins_give(stdin: bytes) -> None:
    out = io.StringIO()
    assert skel.run({}, {"CNI_COMMAND": "VERSION"}, stdin, out) == 0
    assert out.getvalue() == versions.version_answer() == json.dumps(versions.version_info())
    assert json.loads(out.getvalue()) == {
        "cniVersion": "1.1.0",
        "supportedVersions": ["0.3.0", "0.3.1", "0.4.0", "1.0.0", "1.1.0"],
    }


MALFORMED: list[tuple[str, dict[str, str], Any, int, str]] = [
    ("no command", {k: v for k, v in ENV.items() if k != "CNI_COMMAND"}, CONF, 4, "CNI_COMMAND"),
    ("unknown command", {**ENV, "CNI_COMMAND": "ATTACH"}, CONF, 4, "CNI_COMMAND"),
    ("no container id", {**ENV, "CNI_CONTAINERID": ""}, CONF, 4, "CNI_CONTAINERID"),
    ("bad container id", {**ENV, "CNI_CONTAINERID": "-bad/id"}, CONF, 4, "CNI_CONTAINERID"),
    ("no netns on ADD", {k: v for k, v in ENV.items() if k != "CNI_NETNS"}, CONF, 4, "CNI_NETNS"),
    ("relative netns", {**ENV, "CNI_NETNS": "netns/x"}, CONF, 4, "CNI_NETNS"),
    ("no ifname", {k: v for k, v in ENV.items() if k != "CNI_IFNAME"}, CONF, 4, "CNI_IFNAME"),
    ("long ifname", {**ENV, "CNI_IFNAME": "a-very-long-ifname0"}, CONF, 4, "CNI_IFNAME"),
    ("ifname with slash", {**ENV, "CNI_IFNAME": "eth/0"}, CONF, 4, "CNI_IFNAME"),
    ("no CNI_PATH", {k: v for k, v in ENV.items() if k != "CNI_PATH"}, CONF, 4, "CNI_PATH"),
    ("CNI_ARGS without =", {**ENV, "CNI_ARGS": "FOO"}, CONF, 4, "CNI_ARGS"),
    ("CNI_ARGS unknown key", {**ENV, "CNI_ARGS": "FOO=bar"}, CONF, 4, "'FOO'"),
    ("CNI_ARGS bad IgnoreUnknown", {**ENV, "CNI_ARGS": "IgnoreUnknown=maybe"}, CONF, 4, "IgnoreUnknown"),
    ("not JSON", ENV, b"{nope", 6, "not valid JSON"),
    ("JSON array", ENV, b"[1, 2]", 6, "JSON object"),
    ("no cniVersion", ENV, {k: v for k, v in CONF.items() if k != "cniVersion"}, 7, "cniVersion"),
    ("numeric cniVersion", ENV, {**CONF, "cniVersion": 1}, 7, "cniVersion"),
    ("unsupported version", ENV, {**CONF, "cniVersion": "0.2.0"}, 1, "0.2.0"),
    ("garbage version", ENV, {**CONF, "cniVersion": "one"}, 1, "cniVersion"),
    ("CHECK on 0.3.1", {**ENV, "CNI_COMMAND": "CHECK"}, {**CONF, "cniVersion": "0.3.1"}, 1, "CHECK"),
    ("GC on 1.0.0", {**ENV, "CNI_COMMAND": "GC"}, {**CONF, "cniVersion": "1.0.0"}, 1, "GC"),
    ("STATUS on 0.4.0", {**ENV, "CNI_COMMAND": "STATUS"}, {**CONF, "cniVersion": "0.4.0"}, 1, "STATUS"),
    ("no name", ENV, {k: v for k, v in CONF.items() if k != "name"}, 7, "name"),
    ("bad name", ENV, {**CONF, "name": "my net"}, 7, "name"),
    ("mtu string", ENV, {**CONF, "mtu": "abc"}, 7, 'mtu: expected an integer from 68 to 65535, got "abc"'),
    ("mtu too small", ENV, {**CONF, "mtu": 10}, 7, "mtu"),
    ("isGateway string", ENV, {**CONF, "isGateway": "yes"}, 7, "isGateway: expected true or false"),
    ("vlan out of range", ENV, {**CONF, "vlan": 5000}, 7, "vlan"),
    ("bridge name too long", ENV, {**CONF, "bridge": "a-very-long-bridge"}, 7, "bridge"),
    ("socket relative", ENV, {**CONF, "socket": "cni.sock"}, 7, "socket"),
    ("ipam not an object", ENV, {**CONF, "ipam": "nodeplug"}, 7, "ipam"),
    ("no ranges", ENV, {**CONF, "ipam": {"type": "nodeplug"}}, 7, "ipam.ranges"),
    ("bad subnet", ENV, {**CONF, "ipam": {"type": "nodeplug", "ranges": [[{"subnet": "10.0.0.300/24"}]]}}, 7, "subnet"),
    (
        "gateway outside subnet",
        ENV,
        {**CONF, "ipam": {"type": "nodeplug", "ranges": [[{"subnet": "10.0.0.0/24", "gateway": "10.0.1.1"}]]}},
        7,
        "ipam.ranges[0][0].gateway",
    ),
    (
        "rangeEnd before rangeStart",
        ENV,
        {
            **CONF,
            "ipam": {
                "type": "nodeplug",
                "ranges": [[{"subnet": "10.0.0.0/24", "rangeStart": "10.0.0.50", "rangeEnd": "10.0.0.10"}]],
            },
        },
        7,
        "rangeEnd",
    ),
    (
        "overlapping ranges",
        ENV,
        {**CONF, "ipam": {"type": "nodeplug", "ranges": [[{"subnet": "10.0.0.0/24"}], [{"subnet": "10.0.0.0/25"}]]}},
        7,
        "overlaps",
    ),
    (
        "mixed families in a set",
        ENV,
        {**CONF, "ipam": {"type": "nodeplug", "ranges": [[{"subnet": "10.0.0.0/24"}, {"subnet": "fd00::/64"}]]}},
        7,
        "IPv4",
    ),
    (
        "subnet too small",
        ENV,
        {**CONF, "ipam": {"type": "nodeplug", "ranges": [[{"subnet": "10.0.0.0/31"}]]}},
        7,
        "subnet",
    ),
    ("bad route", ENV, {**CONF, "ipam": {**CONF["ipam"], "routes": [{"dst": "default"}]}}, 7, "ipam.routes[0].dst"),
    ("relative dataDir", ENV, {**CONF, "ipam": {**CONF["ipam"], "dataDir": "ipam"}}, 7, "dataDir"),
    (
        "prevResult bad ip",
        ENV,
        {**CONF, "prevResult": {"ips": [{"address": "10.0.0.1"}]}},
        7,
        "prevResult.ips[0].address",
    ),
    (
        "prevResult bad interface index",
        ENV,
        {**CONF, "prevResult": {"interfaces": [{"name": "eth0"}], "ips": [{"address": "10.0.0.1/24", "interface": 3}]}},
        7,
        "prevResult.ips[0].interface",
    ),
    (
        "valid-attachments wrong",
        {"CNI_COMMAND": "GC"},
        {**CONF, "cni.dev/valid-attachments": [{"ifname": "x"}]},
        7,
        "containerID",
    ),
    ("dns wrong type", ENV, {**CONF, "dns": {"nameservers": "8.8.8.8"}}, 7, "dns.nameservers"),
]


@pytest.mark.parametrize(("env", "conf", "code", "needle"), [m[1:] for m in MALFORMED], ids=[m[0] for m in MALFORMED])
def test_malformed_input_gives_spec_error_json(env: dict[str, str], conf: Any, code: int, needle: str) -> None:
    rc, out, h = invoke(env, conf)
    assert rc == 1
    assert out["code"] == code, out
    assert needle in out["details"], out
    assert set(out) == {"cniVersion", "code", "msg", "details"}
    assert out["msg"]
    assert not h.calls  # nothing ran


def test_error_json_uses_the_config_version() -> None:
    rc, out, _ = invoke({**ENV, "CNI_IFNAME": ""}, {**CONF, "cniVersion": "0.4.0"})
    assert rc == 1 and out["cniVersion"] == "0.4.0"


def test_handler_errors_are_passed_through_and_bugs_become_999() -> None:
    rc, out, _ = invoke(ENV, handler=Recorder(error=CniError(11, details="busy")))
    assert rc == 1 and out == {"cniVersion": "1.1.0", "code": 11, "msg": "try again later", "details": "busy"}
    rc, out, _ = invoke(ENV, handler=Recorder(error=KeyError("boom")))
    assert rc == 1 and out["code"] == 999 and "KeyError" in out["details"]


def test_cni_args() -> None:
    a = skel.parse_cni_args("IgnoreUnknown=1;K8S_POD_NAMESPACE=default;K8S_POD_NAME=web-0;FOO=bar;IP=10.0.0.9")
    assert a.ignore_unknown and a.k8s_pod_namespace == "default" and a.k8s_pod_name == "web-0"
    assert a.ips == ("10.0.0.9",) and ("FOO", "bar") in a.pairs
    b = skel.parse_cni_args("K8S_POD_INFRA_CONTAINER_ID=abc;K8S_POD_UID=u-1;")
    assert b.k8s_pod_infra_container_id == "abc" and b.k8s_pod_uid == "u-1" and not b.ignore_unknown
    assert skel.parse_cni_args("") == skel.CniArgs()
    with pytest.raises(CniError) as e:
        skel.parse_cni_args("IgnoreUnknown=0;FOO=bar")
    assert e.value.code == 4


def test_unknown_config_fields_are_ignored() -> None:
    rc, _, h = invoke(ENV, {**CONF, "someVendorField": {"x": 1}, "capabilities": {"portMappings": True}})
    assert rc == 0 and h.calls
