"""Shared fixtures for the three tiers.

- unit: pure logic (a fake /dev and /sys tree in a temporary directory at most);
- integration: no root; real unix sockets, subprocesses, inotify and tools (kubectl kustomize), in this process;
- node: root; real network namespaces, veth pairs, bridges, loop devices and mounts made through the fixtures here,
  each removed even when the test fails;
- e2e: the whole agent on a temporary root, driven as kubelet and a runtime drive it.

At the end of the session :func:`pytest_sessionfinish` compares the host against a snapshot taken at the start and
fails the run if a test left a network namespace, a link, a mount or a loop device behind.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from lab import bundle
from support.agent import AgentProcess
from support.host import IS_ROOT, sh, unique
from support.kubeassets import kube_tool

# Shared helpers as registered plugins (tests/ is on sys.path through the pytest config's ``pythonpath``); their
# fixtures include dp, csi_driver, ctl (the CSI controller), slow_disk and the cluster tier's dratest_resource;
# skipsummary counts, at the end, the tests skipped for lack of the Kubernetes binaries; pytester tests that.
pytest_plugins = [
    "support.dpharness",
    "support.manifests",
    "support.csidriver",
    "support.csicontroller",
    "support.slowdisk",
    "support.clusterdra",
    "support.skipsummary",
    "pytester",
]

# ---------------------------------------------------------------- host snapshot for the leak check


def _netns() -> set[str]:
    try:
        return set(os.listdir("/run/netns"))
    except FileNotFoundError:
        return set()


# Devices the kernel creates by itself when a module first loads (the reference bandwidth plugin loads ifb, which
# brings ifb0 and ifb1): not made by a test, and nothing a test could remove.
_KERNEL_LINKS = re.compile(r"ifb\d+|sit0|tunl0|ip6tnl0|gre0|gretap0|erspan0|ip_vti0|ip6_vti0|ip6gre0")


def _links() -> set[str]:
    try:
        out = sh("ip", "-j", "link", "show")
    except (RuntimeError, FileNotFoundError):
        return set()
    return {link["ifname"] for link in json.loads(out or "[]") if not _KERNEL_LINKS.fullmatch(link["ifname"])}


# iproute2 makes /run/netns a shared bind mount of itself the first time any netns is added and keeps it for good:
# on a freshly booted machine the first test to add a netns creates it, and that is not a leak (the namespaces
# mounted inside it are, and are listed by name).
_SYSTEM_MOUNTS = frozenset({"/run/netns", "/var/run/netns"})


def _mounts() -> set[str]:
    with open("/proc/self/mountinfo") as f:
        return {point for line in f if (point := line.split()[4]) not in _SYSTEM_MOUNTS}


def _loops() -> set[str]:
    try:
        out = sh("losetup", "-J", "-l")
    except (RuntimeError, FileNotFoundError):
        return set()
    if not out.strip():
        return set()
    return {f"{d['name']} -> {d.get('back-file')}" for d in json.loads(out).get("loopdevices", [])}


def _snapshot() -> dict[str, set[str]]:
    return {"netns": _netns(), "link": _links(), "mount": _mounts(), "loop device": _loops()}


def _of_a_running_cluster(leak: str) -> bool:
    kind, _, name = leak.partition(": ")
    owned = ("cni-", "/run/netns/cni-", "/run/nodeplug-cluster/", "/var/lib/kubelet/")
    return name.startswith(owned) or (kind == "loop device" and "/var/lib/nodeplug/" in name)


def pytest_sessionstart(session: pytest.Session) -> None:
    session.config.stash[_BEFORE] = _snapshot() if IS_ROOT else {}


_BEFORE = pytest.StashKey[dict[str, set[str]]]()


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    before = session.config.stash.get(_BEFORE, {})
    if not before or os.environ.get("NODEPLUG_LEAKCHECK") == "off":
        return
    after = _snapshot()
    leaks = [f"{kind}: {name}" for kind in after for name in sorted(after[kind] - before.get(kind, set()))]
    if os.environ.get("NODEPLUG_TEST_CLUSTER"):
        # A cluster made by hand outlives the session: the pods its tests left deleting (their network namespaces,
        # sandboxes, kubelet's and the CSI driver's mounts and loop devices) are its to remove, not the session's.
        leaks = [leak for leak in leaks if not _of_a_running_cluster(leak)]
    if leaks:
        tr = session.config.pluginmanager.get_plugin("terminalreporter")
        msg = "tests left host objects behind:\n  " + "\n  ".join(leaks)
        if tr is not None:
            tr.write_line("")
            tr.write_line(msg, red=True, bold=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


# ---------------------------------------------------------------- fixtures


@pytest.fixture(name="sh")
def sh_fixture() -> Callable[..., str]:
    """:func:`sh` for test modules, which take what they share as fixtures rather than importing conftest."""
    return sh


@pytest.fixture
def tmp_root(tmp_path: Path) -> Path:
    """A fresh directory to use as the agent's ``--root``."""
    root = tmp_path / "root"
    root.mkdir()
    return root


@pytest.fixture
def netns() -> Iterator[Callable[[], str]]:
    """Factory for network namespaces (``nsname = netns()``); every one is deleted at teardown."""
    if not IS_ROOT:
        pytest.skip("needs root: creates network namespaces")
    made: list[str] = []

    def make() -> str:
        name = unique("npt-", 8)
        sh("ip", "netns", "add", name)
        made.append(name)
        sh("ip", "-n", name, "link", "set", "lo", "up")
        return name

    yield make
    for name in made:
        with contextlib.suppress(Exception):
            sh("ip", "netns", "delete", name)


@pytest.fixture
def links() -> Iterator[Callable[[str], str]]:
    """Register root-namespace link names the test creates (``links("npbr0")``); each is deleted at teardown."""
    if not IS_ROOT:
        pytest.skip("needs root: creates network links")
    made: list[str] = []

    def track(name: str) -> str:
        made.append(name)
        return name

    yield track
    for name in made:
        with contextlib.suppress(Exception):
            sh("ip", "link", "delete", name, check=False)


@pytest.fixture
def loop_device(tmp_path: Path) -> Iterator[Callable[[int], str]]:
    """Factory for loop devices over sparse files in tmp_path (``dev = loop_device(size_bytes)``)."""
    if not IS_ROOT:
        pytest.skip("needs root: creates loop devices")
    made: list[str] = []

    def make(size: int = 256 << 20) -> str:
        backing = tmp_path / f"loop-{len(made)}.img"
        with open(backing, "wb") as f:
            f.truncate(size)
        dev = sh("losetup", "-f", "--show", str(backing)).strip()
        made.append(dev)
        return dev

    yield make
    for dev in made:
        with contextlib.suppress(Exception):
            sh("losetup", "-d", dev, check=False)


@pytest.fixture
def mounts() -> Iterator[Callable[[Path], Path]]:
    """Register mount points the test creates; each is lazily unmounted at teardown (deepest first)."""
    made: list[Path] = []

    def track(p: Path) -> Path:
        made.append(Path(p))
        return Path(p)

    yield track
    current = _mounts()
    for p in sorted(made, key=lambda x: len(str(x)), reverse=True):
        for _ in range(8):
            if str(p) not in current:
                break
            sh("umount", "-l", str(p), check=False)
            current = _mounts()


# ---------------------------------------------------------------- the CNI bundle (install-cni tests)

BUNDLE_CACHE = bundle.CACHE


def build_bundle(cache: Path, *extra: str, pythonpath: str = "") -> Path:
    """:func:`lab.bundle.build`, skipping where this machine cannot build one."""
    if why := bundle.missing():
        pytest.skip(why)
    return bundle.build(cache, *extra, pythonpath=pythonpath)


@pytest.fixture(scope="session")
def cni_bundle() -> Path:
    """The real CNI bundle for the sources in the tree (built once per change of its sources)."""
    return build_bundle(BUNDLE_CACHE)


@pytest.fixture(scope="session")
def bundle_builder() -> Callable[..., Path]:
    return build_bundle


# ---------------------------------------------------------------- real Kubernetes tools (KUBE_ASSETS)


@pytest.fixture(scope="session")
def kubectl() -> Path:
    """kubectl 1.32 from KUBE_ASSETS (``kubectl kustomize`` renders the DaemonSet's base as users render it)."""
    return kube_tool("kubectl")


# ---------------------------------------------------------------- the whole agent as a process (e2e)


@pytest.fixture
def spawn_agent() -> Iterator[Callable[..., AgentProcess]]:
    """Factory: ``spawn_agent(root=None, extra_config="")`` starts the agent (a short temporary root when none is
    given: socket paths under it must fit sockaddr_un for every client). Killed and its root removed at teardown."""
    if not IS_ROOT:
        pytest.skip("needs root: the agent's plugins create loop devices and bridges")
    started: list[AgentProcess] = []

    def spawn(root: Path | None = None, extra_config: str = "") -> AgentProcess:
        agent = AgentProcess(root or Path(tempfile.mkdtemp(prefix="npa-", dir="/tmp")), extra_config)
        started.append(agent)
        return agent

    yield spawn
    for agent in started:
        if agent.proc.poll() is None:
            agent.proc.kill()
            agent.proc.wait()
        shutil.rmtree(agent.root, ignore_errors=True)
