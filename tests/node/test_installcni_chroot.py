"""The installed CNI entry point on a host with no Python and no glibc: a busybox root filesystem.

The real bundle (scripts/build-cni-bundle, cached under build/ by a hash of its sources) is installed into the root
by ``nodeplug install-cni --root``; then, chrooted there and inside a network namespace standing in for the node, the
runtime's calls are made: VERSION, and ADD and DEL of a pod network namespace in standalone mode (no agent socket
exists in the chroot). The chroot has /proc (the frozen program re-executes itself through /proc/self/exe, as on any
real host) and the pod's namespace bind-mounted at the path CNI_NETNS names.
"""

from __future__ import annotations

import ipaddress
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from cni import thick

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root: chroot, mounts, network namespaces")

REPO = Path(__file__).resolve().parents[2]
SUBNET = "10.98.0.0/24"


@pytest.fixture(scope="module")
def bundle(cni_bundle: Path) -> Path:
    """The real CNI bundle for the sources in the tree (built once per source change, about 20 s)."""
    return cni_bundle


PROBE = """\
import json
import os
import sys


def main():
    sys.stdout.write(json.dumps(dict(os.environ)))
    return 0
"""


@pytest.fixture(scope="module")
def probe_bundle(tmp_path_factory: pytest.TempPathFactory, bundle_builder: Callable[..., Path]) -> Path:
    """A bundle built the same way around an entry point that prints the environment it runs with."""
    src = tmp_path_factory.mktemp("probe")
    (src / "nodeplug_env_probe.py").write_text(PROBE)
    return bundle_builder(REPO / "build" / "test-cni-probe", "--entry", "nodeplug_env_probe:main", pythonpath=str(src))


@pytest.fixture
def busybox_root(tmp_path: Path, bundle: Path, mounts: Callable[[Path], Path]) -> Path:
    """A root filesystem of busybox and its applets, with the CNI entry point installed by install-cni."""
    busybox = shutil.which("busybox")
    if busybox is None:
        pytest.skip("busybox-static is not installed")
    root = tmp_path / "rootfs"
    for d in ("bin", "proc", "tmp", "var/run/netns", "var/lib/nodeplug/ipam"):
        (root / d).mkdir(parents=True)
    shutil.copy2(busybox, root / "bin/busybox")
    applets = subprocess.run([busybox, "--list"], capture_output=True, text=True, check=True, timeout=10).stdout
    for name in applets.split():
        if name != "busybox":
            os.symlink("busybox", root / "bin" / name)
    p = subprocess.run(
        [sys.executable, "-m", "nodeplug.cli", "install-cni", "--root", str(root), "--bundle", str(bundle),
         "--subnet", SUBNET, "--no-ip-masq", "--network-name", "chroot-test"],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert p.returncode == 0, p.stderr
    subprocess.run(["mount", "-t", "proc", "proc", str(mounts(root / "proc"))], check=True, timeout=10)
    return root


def _no_python_or_glibc_outside_the_bundle(root: Path) -> None:
    skip = {root / "opt/cni/bin/nodeplug.d", root / "proc"}
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if Path(dirpath) / d not in skip]
        for name in filenames + dirnames:
            assert not name.startswith(("python", "libc.so", "ld-linux", "libpython")), Path(dirpath) / name


def call(root: Path, hostns: str, command: str, conf: dict[str, object], **env: str) -> tuple[int, dict[str, object]]:
    """Run /opt/cni/bin/nodeplug in the chroot, in the node's network namespace, as a runtime does."""
    full = {"CNI_COMMAND": command, "CNI_PATH": "/opt/cni/bin", **env}
    p = subprocess.run(
        [shutil.which("ip") or "ip", "netns", "exec", hostns, "/usr/sbin/chroot", str(root), "/opt/cni/bin/nodeplug"],
        input=json.dumps(conf).encode(), env=full, capture_output=True, timeout=60, check=False,
    )  # fmt: skip
    try:
        out = json.loads(p.stdout) if p.stdout.strip() else {}
    except ValueError:
        pytest.fail(f"{command}: not JSON on stdout: {p.stdout!r} (stderr {p.stderr!r})")
    return p.returncode, out


def network_conf(root: Path) -> dict[str, object]:
    """The single plugin config a runtime derives from the installed conflist."""
    conflist = json.loads((root / "etc/cni/net.d/10-nodeplug.conflist").read_text())
    (plugin,) = conflist["plugins"]
    return {"cniVersion": conflist["cniVersion"], "name": conflist["name"], **plugin}


def test_version_answers_in_a_root_without_python(busybox_root: Path, netns: Callable[[], str]) -> None:
    _no_python_or_glibc_outside_the_bundle(busybox_root)
    probe = subprocess.run(
        ["/usr/sbin/chroot", str(busybox_root), "/bin/sh", "-c", "command -v python3 python || echo none"],
        capture_output=True, text=True, timeout=10, check=True,
    )  # fmt: skip
    assert probe.stdout.strip() == "none"
    code, out = call(busybox_root, netns(), "VERSION", {"cniVersion": "1.0.0"})
    assert code == 0
    assert {"0.4.0", "1.0.0", "1.1.0"} <= set(out["supportedVersions"])  # type: ignore[arg-type]


@pytest.fixture
def node_and_pod(busybox_root: Path, netns: Callable[[], str], mounts: Callable[[Path], Path]) -> tuple[str, str]:
    """A node's network namespace and a pod's, the pod's bind-mounted where the chroot sees it (/var/run/netns/pod)."""
    hostns, podns = netns(), netns()
    target = busybox_root / "var/run/netns/pod"
    target.touch()
    subprocess.run(["mount", "--bind", f"/run/netns/{podns}", str(mounts(target))], check=True, timeout=10)
    return hostns, podns


def test_add_and_del_a_pod_network_standalone(busybox_root: Path, node_and_pod: tuple[str, str]) -> None:
    hostns, podns = node_and_pod
    assert not (busybox_root / "run/nodeplug/cni.sock").exists()
    conf = network_conf(busybox_root)
    env = {"CNI_CONTAINERID": "chroot-test-1", "CNI_NETNS": "/var/run/netns/pod", "CNI_IFNAME": "eth0"}

    code, result = call(busybox_root, hostns, "ADD", conf, **env)
    assert code == 0, result
    (ip,) = result["ips"]  # type: ignore[misc]
    addr = ipaddress.ip_interface(ip["address"])
    assert addr in ipaddress.ip_network(SUBNET) or addr.ip in ipaddress.ip_network(SUBNET)
    shown = subprocess.run(["ip", "-n", podns, "-j", "addr", "show", "eth0"], capture_output=True, text=True,
                           check=True, timeout=10).stdout  # fmt: skip
    assert str(addr.ip) in shown
    assert conf["datapath"] == "routed"  # install-cni's default: the node routes the pod's address to its veth
    host_veth = result["interfaces"][0]["name"]  # type: ignore[index]
    routed = subprocess.run(["ip", "-n", hostns, "route", "show", str(addr.ip)], capture_output=True, text=True,
                            check=True, timeout=10).stdout  # fmt: skip
    assert f"dev {host_veth}" in routed
    # the node's own address, the source of its ping (this stand-in node has no other)
    subprocess.run(["ip", "-n", hostns, "addr", "add", "10.96.0.1/32", "dev", "lo"], check=True, timeout=10)
    ping = subprocess.run(["ip", "netns", "exec", hostns, "ping", "-c", "1", "-W", "2", str(addr.ip)],
                          capture_output=True, timeout=10, check=False)  # fmt: skip
    assert ping.returncode == 0, ping.stdout

    code, out = call(busybox_root, hostns, "DEL", {**conf, "prevResult": result}, **env)
    assert code == 0, out
    gone = subprocess.run(["ip", "-n", podns, "link", "show", "eth0"], capture_output=True, timeout=10, check=False)
    assert gone.returncode != 0, "eth0 is still in the pod's namespace after DEL"
    code, out = call(busybox_root, hostns, "DEL", conf, **env)
    assert code == 0, f"a repeated DEL must succeed: {out}"

    # The address went back to the pool: a new container gets an address, and the pool is not shrinking.
    env2 = {**env, "CNI_CONTAINERID": "chroot-test-2"}
    code, result2 = call(busybox_root, hostns, "ADD", conf, **env2)
    assert code == 0, result2
    code, _ = call(busybox_root, hostns, "DEL", {**conf, "prevResult": result2}, **env2)
    assert code == 0


def test_a_delegated_ipam_plugin_runs_from_the_bundle(busybox_root: Path, node_and_pod: tuple[str, str]) -> None:
    """The bundle execs a host plugin (a busybox script as IPAM) with the request's environment, none of its own."""
    hostns, podns = node_and_pod
    script = busybox_root / "opt/cni/bin/envdump"
    script.write_text(
        "#!/bin/sh\n"
        'env > "/tmp/ipam-env-$CNI_COMMAND"\n'
        'if [ "$CNI_COMMAND" = ADD ]; then\n'
        '  echo \'{"cniVersion":"1.0.0","ips":[{"address":"10.97.0.5/24","gateway":"10.97.0.1"}]}\'\n'
        "fi\n"
    )
    script.chmod(0o755)
    conf = {**network_conf(busybox_root), "bridge": "npenv0", "ipam": {"type": "envdump"}}
    env = {"CNI_CONTAINERID": "chroot-env", "CNI_NETNS": "/var/run/netns/pod", "CNI_IFNAME": "eth0"}
    code, result = call(busybox_root, hostns, "ADD", conf, **env)
    assert code == 0, result
    assert result["ips"][0]["address"] == "10.97.0.5/32"  # type: ignore[index]  # routed: the address alone
    shown = subprocess.run(["ip", "-n", podns, "-j", "addr", "show", "eth0"], capture_output=True, text=True,
                           check=True, timeout=10).stdout  # fmt: skip
    assert "10.97.0.5" in shown
    seen = dict(line.split("=", 1) for line in (busybox_root / "tmp/ipam-env-ADD").read_text().splitlines())
    assert seen["CNI_COMMAND"] == "ADD" and seen["CNI_CONTAINERID"] == "chroot-env"
    assert not [k for k, v in seen.items() if k.startswith("_PYI") or "nodeplug.d" in v], seen
    code, out = call(busybox_root, hostns, "DEL", {**conf, "prevResult": result}, **env)
    assert code == 0, out
    assert (busybox_root / "tmp/ipam-env-DEL").exists()


@pytest.mark.parametrize("callers", [None, "/callers/libs"])
def test_the_entry_point_runs_with_the_callers_environment(
    probe_bundle: Path, callers: str | None, tmp_path: Path
) -> None:
    """Commands the entry point runs (nft, ip) inherit its environment: the bundle's loader path and PyInstaller's
    bookkeeping must be gone by then, and the caller's LD_LIBRARY_PATH back."""
    # the launcher asks an absent socket of the test's own (an agent may serve the default one) and runs the entry
    env = {"CNI_COMMAND": "ADD", "PATH": "/usr/sbin:/usr/bin:/sbin:/bin", thick.ENV_SOCKET: str(tmp_path / "a.sock")}
    if callers is not None:
        env["LD_LIBRARY_PATH"] = callers
    p = subprocess.run([str(probe_bundle / "nodeplug")], env=env, capture_output=True, timeout=30, check=True)
    seen = json.loads(p.stdout)
    assert seen.get("LD_LIBRARY_PATH") == callers
    assert not [k for k in seen if k.startswith(("_PYI", "LD_LIBRARY_PATH_ORIG"))], seen
    assert {k: seen[k] for k in env} == env


def test_a_broken_bundle_answers_with_a_cni_error(bundle: Path, tmp_path: Path) -> None:
    """The launcher's own failure is still a spec-shaped error on stdout; the file at fault is named on stderr."""
    broken = tmp_path / "broken"
    shutil.copytree(bundle, broken, symlinks=True)
    (loader,) = broken.glob("_internal/ld-linux-*")
    loader.unlink()
    # VERSION is answered by the launcher itself; with no agent to forward to, ADD needs the frozen entry point
    ok = subprocess.run([str(broken / "nodeplug")], env={"CNI_COMMAND": "VERSION"}, capture_output=True, timeout=30,
                        check=False)  # fmt: skip
    assert ok.returncode == 0 and json.loads(ok.stdout)["cniVersion"] == "1.1.0"
    env = {"CNI_COMMAND": "ADD", "NODEPLUG_CNI_STANDALONE": "1"}
    p = subprocess.run([str(broken / "nodeplug")], env=env, input=b'{"cniVersion": "1.0.0"}', capture_output=True,
                       timeout=30, check=False)  # fmt: skip
    assert p.returncode == 1
    err = json.loads(p.stdout)
    assert err["code"] == 999 and "install-cni" in err["details"]
    assert str(loader) in p.stderr.decode()  # the file at fault, on stderr: no path is printed into JSON
