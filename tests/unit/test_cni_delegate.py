"""Delegated plugin execution against small stand-in plugins (shell scripts in a temp CNI_PATH) and host-local."""

from __future__ import annotations

import json
import os
import select
import stat
from pathlib import Path

import pytest

from cni.errors import CniError
from cni.ipam import delegate


def plugin(d: Path, name: str, body: str) -> Path:
    p = d / name
    p.write_text("#!/bin/sh\n" + body + "\n")
    p.chmod(p.stat().st_mode | stat.S_IXUSR)
    return p


def test_found_in_the_first_cni_path_dir_that_has_it(tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    (a / "ipam").write_text("not executable")
    plugin(b, "ipam", "true")
    assert delegate.find_plugin("ipam", [str(a), str(b)]) == str(b / "ipam")
    with pytest.raises(CniError) as e:
        delegate.find_plugin("absent", [str(a), str(b)])
    assert e.value.code == 7 and "'absent'" in e.value.details
    with pytest.raises(CniError):
        delegate.find_plugin("../b/ipam", [str(a)])


def test_env_stdin_and_result(tmp_path: Path) -> None:
    plugin(
        tmp_path,
        "echoer",
        'cat > "$0.stdin"; env > "$0.env"; '
        'echo \'{"cniVersion":"1.0.0","ips":[{"address":"10.1.0.9/24","gateway":"10.1.0.1"}],"dns":{}}\'',
    )
    env = {"CNI_COMMAND": "DEL", "CNI_CONTAINERID": "c1", "CNI_IFNAME": "eth0", "CNI_PATH": str(tmp_path)}
    res = delegate.ipam_add("echoer", env, b'{"name":"n"}', [str(tmp_path)])
    assert str(res.ips[0].address) == "10.1.0.9/24"
    seen = dict(line.split("=", 1) for line in (tmp_path / "echoer.env").read_text().splitlines() if "=" in line)
    assert seen["CNI_COMMAND"] == "ADD" and seen["CNI_CONTAINERID"] == "c1" and "PATH" in seen
    assert (tmp_path / "echoer.stdin").read_bytes() == b'{"name":"n"}'


def test_the_delegates_error_is_passed_on_unchanged(tmp_path: Path) -> None:
    plugin(tmp_path, "fails", 'echo \'{"cniVersion":"1.0.0","code":11,"msg":"busy","details":"retry"}\'; exit 1')
    with pytest.raises(CniError) as e:
        delegate.exec_plugin("fails", "ADD", {}, b"{}", [str(tmp_path)])
    assert (e.value.code, e.value.msg, e.value.details) == (11, "busy", "retry")


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        ("echo oops >&2; exit 3", "exited with status 3: oops"),
        ("echo not-json", "not JSON"),
        ("echo '[1]'", "JSON list"),
        ("true", "printed no result"),
    ],
)
def test_unreadable_delegates_are_code_104(tmp_path: Path, body: str, needle: str) -> None:
    plugin(tmp_path, "odd", body)
    with pytest.raises(CniError) as e:
        delegate.ipam_add("odd", {}, b"{}", [str(tmp_path)])
    assert e.value.code == 104 and needle in e.value.details


def test_timeout_kills_the_plugin_and_its_children(tmp_path: Path) -> None:
    # the background child holds the output pipes too; it says who it is before it sleeps
    plugin(tmp_path, "slow", f"sleep 30 & echo $! > {tmp_path}/child; sleep 30")
    with pytest.raises(CniError) as e:
        delegate.exec_plugin("slow", "ADD", {}, b"{}", [str(tmp_path)], timeout=0.3)
    assert e.value.code == 11 and "timed out" in e.value.details  # a loaded node: try again later
    child = int((tmp_path / "child").read_text())
    try:
        pidfd = os.pidfd_open(child)
    except ProcessLookupError:
        return  # already gone
    with os.fdopen(pidfd) as f:  # readable once the process has exited
        assert select.select([f], [], [], 30)[0], "the plugin's child outlived the timeout"


@pytest.mark.skipif(not os.access("/usr/lib/cni/host-local", os.X_OK), reason="reference plugins not installed")
def test_host_local_add_and_del(tmp_path: Path) -> None:
    conf = {
        "cniVersion": "1.0.0",
        "name": "hl",
        "type": "nodeplug",
        "ipam": {"type": "host-local", "subnet": "10.95.0.0/24", "dataDir": str(tmp_path)},
    }
    env = {"CNI_CONTAINERID": "c9", "CNI_IFNAME": "eth0", "CNI_NETNS": "/run/netns/x", "CNI_PATH": "/usr/lib/cni"}
    stdin = json.dumps(conf).encode()
    res = delegate.ipam_add("host-local", {**env, "CNI_COMMAND": "ADD"}, stdin, ["/usr/lib/cni"])
    assert str(res.ips[0].address) == "10.95.0.2/24" and str(res.ips[0].gateway) == "10.95.0.1"
    assert (tmp_path / "hl" / "10.95.0.2").exists()
    assert delegate.exec_plugin("host-local", "DEL", env, stdin, ["/usr/lib/cni"]) is None
    assert not (tmp_path / "hl" / "10.95.0.2").exists()
