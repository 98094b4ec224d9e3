"""The device plugin driven as kubelet drives it: a kubelet stand-in (v1beta1 Registration server from the generated
stubs) on a temp ``kubelet.sock``; real device nodes made with mknod in a temp host root; a fake sysfs for PCI/NUMA.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import stat
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from deviceplugin.config import Config
from deviceplugin.kubeletstub import Endpoint, FakeKubelet
from deviceplugin.plugin import DevicePlugin, create
from nodeplug.api.deviceplugin.v1beta1 import api_pb2
from nodeplug.paths import CDI_DIR, DEVICE_PLUGIN_DIR, Root
from nodeplug.plugin import AgentContext

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root: makes device nodes with mknod"),
]

NULL = os.stat("/dev/null").st_rdev


class Harness:
    def __init__(self, tmp: Path, root: Path) -> None:
        self.host = tmp / "host"
        (self.host / "dev").mkdir(parents=True)
        self.tmp = tmp
        self.ctx = AgentContext(root=Root(root))
        self.plugin_dir = self.ctx.root(DEVICE_PLUGIN_DIR)
        self.cdi_dir = self.ctx.root(CDI_DIR)
        self.kubelet = FakeKubelet(self.plugin_dir)
        self.plugin: DevicePlugin | None = None

    def mknod(self, path: str) -> Path:
        p = self.host / path.lstrip("/")
        p.parent.mkdir(parents=True, exist_ok=True)
        os.mknod(p, stat.S_IFCHR | 0o666, NULL)
        return p

    def config(self, resources: list[dict[str, Any]], **kw: Any) -> Config:
        return Config.model_validate({"host_root": str(self.host), "resources": resources, **kw})

    async def start(self, cfg: Config, kubelet: bool = True) -> DevicePlugin:
        if kubelet:
            await self.kubelet.start()
        self.plugin = create(cfg, self.ctx)
        await self.plugin.start()
        return self.plugin

    async def ep(self, name: str, after: int = 0) -> Endpoint:
        return await self.kubelet.wait_registered(f"nodeplug.io/{name}", after=after)

    async def close(self) -> None:
        if self.plugin is not None:
            await self.plugin.stop(0)
        await self.kubelet.stop()


@pytest.fixture
async def h() -> AsyncIterator[Harness]:
    # unix socket paths are limited to 107 bytes: pytest's tmp_path is too deep for the device-plugins directory
    short = Path(tempfile.mkdtemp(prefix="npdp-"))
    (short / "root").mkdir()
    harness = Harness(short, short / "root")
    try:
        yield harness
    finally:
        await harness.close()
        shutil.rmtree(short)
    leftover = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    assert leftover == [], f"tasks left behind: {leftover}"


def ids(listing: list[tuple[str, str, tuple[int, ...]]]) -> list[str]:
    return [d[0] for d in listing]


def health(listing: list[tuple[str, str, tuple[int, ...]]]) -> dict[str, str]:
    return {d[0]: d[1] for d in listing}


def alloc(*containers: list[str]) -> api_pb2.AllocateRequest:
    return api_pb2.AllocateRequest(
        container_requests=[api_pb2.ContainerAllocateRequest(devices_ids=c) for c in containers]
    )


async def test_registration_fields_initial_list_and_readiness(h: Harness) -> None:
    h.mknod("/dev/fuse")
    h.mknod("/dev/net/tun")
    reset = {"command": ["true"]}
    plugin = await h.start(
        h.config(
            [{"name": "fuse", "devices": ["/dev/fuse"]}, {"name": "tun", "devices": ["/dev/net/tun"], "reset": reset}]
        )
    )
    fuse, tun = await h.ep("fuse"), await h.ep("tun")
    assert fuse.request.version == "v1beta1"
    assert fuse.request.endpoint == "nodeplug-fuse.sock"
    assert fuse.request.resource_name == "nodeplug.io/fuse"
    assert fuse.request.options == api_pb2.DevicePluginOptions(get_preferred_allocation_available=True)
    assert tun.request.options.pre_start_required and tun.request.options.get_preferred_allocation_available
    assert fuse.options == fuse.request.options
    assert fuse.latest == [("fuse", "Healthy", ())]
    assert tun.latest == [("net-tun", "Healthy", ())]
    sock = h.plugin_dir / "nodeplug-fuse.sock"
    assert stat.S_ISSOCK(sock.stat().st_mode) and stat.S_IMODE(sock.stat().st_mode) == 0o600
    assert plugin.readiness().ready, plugin.readiness()


async def test_waits_for_kubelet_then_registers(h: Harness) -> None:
    h.mknod("/dev/fuse")
    plugin = await h.start(h.config([{"name": "fuse", "devices": ["/dev/fuse"]}]), kubelet=False)
    await asyncio.sleep(0.2)
    r = plugin.readiness()
    assert not r.ready and "fuse: not registered with kubelet" in r.detail
    t0 = time.monotonic()
    await h.kubelet.start()  # kubelet.sock appears: inotify, not the backoff timer, triggers Register
    await h.ep("fuse")
    assert time.monotonic() - t0 < 1.0
    assert plugin.readiness().ready


async def test_hotplug_add_and_remove_seen_on_the_stream(h: Harness) -> None:
    h.mknod("/dev/ttyUSB0")
    await h.start(h.config([{"name": "serial", "devices": ["/dev/ttyUSB*"], "forget_after_seconds": 0}]))
    ep = await h.ep("serial")
    assert ids(ep.latest) == ["ttyUSB0"]
    t0 = time.monotonic()
    h.mknod("/dev/ttyUSB1")
    await ep.wait_listing(lambda listing: ids(listing) == ["ttyUSB0", "ttyUSB1"], timeout=1)
    assert time.monotonic() - t0 < 0.1 + 0.05
    before = len(ep.listings)
    for i in range(2, 12):  # a burst is debounced into one or two updates, not ten
        h.mknod(f"/dev/ttyUSB{i}")
    await ep.wait_listing(lambda listing: len(listing) == 12, timeout=1)
    assert len(ep.listings) - before <= 3
    assert ids(ep.latest)[-3:] == ["ttyUSB9", "ttyUSB10", "ttyUSB11"]  # natural order
    os.unlink(h.host / "dev/ttyUSB0")
    await ep.wait_listing(lambda listing: "ttyUSB0" not in ids(listing), timeout=1)


async def test_vanished_node_is_unhealthy_and_healthy_again(h: Harness) -> None:
    node = h.mknod("/dev/ttyUSB0")
    h.mknod("/dev/ttyUSB1")
    plugin = await h.start(h.config([{"name": "serial", "devices": ["/dev/ttyUSB*"]}]))
    ep = await h.ep("serial")
    os.unlink(node)
    await ep.wait_listing(lambda listing: health(listing) == {"ttyUSB0": "Unhealthy", "ttyUSB1": "Healthy"}, 1)
    metrics = plugin.ctx.metrics.render().decode()
    assert 'nodeplug_deviceplugin_devices{health="Unhealthy",resource="serial"} 1.0' in metrics
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await ep.stub.Allocate(alloc(["ttyUSB0"]))
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "ttyUSB0 (device is gone from the node)" in (e.value.details() or "")
    h.mknod("/dev/ttyUSB0")
    await ep.wait_listing(lambda listing: health(listing) == {"ttyUSB0": "Healthy", "ttyUSB1": "Healthy"}, 1)
    await ep.stub.Allocate(alloc(["ttyUSB0"]))


async def test_health_command_flips_both_ways_and_times_out(h: Harness) -> None:
    h.mknod("/dev/fuse")
    flag = h.tmp / "ok-fuse"
    flag.write_text("")
    cmd = {"command": ["test", "-e", str(h.tmp / "ok-{id}")], "interval_seconds": 0.05, "timeout_seconds": 2}
    await h.start(h.config([{"name": "fuse", "devices": ["/dev/fuse"], "health": cmd}]))
    ep = await h.ep("fuse")
    await ep.wait_listing(lambda listing: health(listing) == {"fuse": "Healthy"}, 2)
    flag.unlink()
    await ep.wait_listing(lambda listing: health(listing) == {"fuse": "Unhealthy"}, 2)
    flag.write_text("")
    await ep.wait_listing(lambda listing: health(listing) == {"fuse": "Healthy"}, 2)


async def test_health_command_timeout_is_unhealthy(h: Harness) -> None:
    h.mknod("/dev/fuse")
    cmd = {"command": ["sleep", "5"], "interval_seconds": 0.05, "timeout_seconds": 0.1}
    plugin = await h.start(h.config([{"name": "fuse", "devices": ["/dev/fuse"], "health": cmd}]))
    ep = await h.ep("fuse")
    assert ep.latest == [("fuse", "Unhealthy", ())]  # not checked yet: never offered unchecked
    table = plugin.resources["fuse"].table
    for _ in range(100):
        if "timed out" in table.reason("fuse"):
            break
        await asyncio.sleep(0.02)
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await ep.stub.Allocate(alloc(["fuse"]))
    assert "timed out after 0.1s" in (e.value.details() or "")


async def test_kubelet_restart_reregisters_every_resource(h: Harness) -> None:
    h.mknod("/dev/fuse")
    h.mknod("/dev/net/tun")
    plugin = await h.start(
        h.config([{"name": "fuse", "devices": ["/dev/fuse"]}, {"name": "tun", "devices": ["/dev/net/tun"]}])
    )
    await h.ep("fuse")
    await h.ep("tun")
    for round_ in (1, 2):
        t0 = time.monotonic()
        await h.kubelet.restart()  # streams closed, directory wiped (our sockets too), new kubelet.sock
        fuse = await h.ep("fuse", after=round_)
        tun = await h.ep("tun", after=round_)
        assert time.monotonic() - t0 < 1.0
        assert fuse.latest == [("fuse", "Healthy", ())] and tun.latest == [("net-tun", "Healthy", ())]
        await fuse.stub.Allocate(alloc(["fuse"]))
    assert plugin.readiness().ready
    assert 'nodeplug_deviceplugin_registrations_total{resource="fuse",result="ok"} 3.0' in (
        plugin.ctx.metrics.render().decode()
    )


async def test_directory_removed_and_made_again(h: Harness) -> None:
    h.mknod("/dev/fuse")
    await h.start(h.config([{"name": "fuse", "devices": ["/dev/fuse"]}]))
    await h.ep("fuse")
    await h.kubelet.stop(wipe=True)
    h.plugin_dir.rmdir()
    await asyncio.sleep(0.05)
    await h.kubelet.start()
    ep = await h.ep("fuse", after=1)
    assert ep.latest == [("fuse", "Healthy", ())]


async def test_allocate_device_specs_mounts_and_envs(h: Harness) -> None:
    for i in range(3):
        h.mknod(f"/dev/dri/renderD{128 + i}")
    res = {
        "name": "gpu",
        "devices": ["/dev/dri/renderD*"],
        "permissions": "rwm",
        "mounts": [{"host_path": "/usr/share/gpu", "container_path": "/opt/gpu", "read_only": False}],
        "env": {"GPU_MODE": "compute"},
    }
    await h.start(h.config([res]))
    ep = await h.ep("gpu")
    assert ids(ep.latest) == ["dri-renderD128", "dri-renderD129", "dri-renderD130"]
    resp = await ep.stub.Allocate(alloc(["dri-renderD130", "dri-renderD128"], ["dri-renderD129"]))
    first, second = resp.container_responses
    assert [(d.host_path, d.container_path, d.permissions) for d in first.devices] == [
        ("/dev/dri/renderD130", "/dev/dri/renderD130", "rwm"),
        ("/dev/dri/renderD128", "/dev/dri/renderD128", "rwm"),
    ]
    assert [(m.host_path, m.container_path, m.read_only) for m in first.mounts] == [
        ("/usr/share/gpu", "/opt/gpu", False)
    ]
    assert dict(first.envs) == {"GPU_MODE": "compute", "NODEPLUG_GPU_DEVICES": "dri-renderD130,dri-renderD128"}
    assert dict(second.envs)["NODEPLUG_GPU_DEVICES"] == "dri-renderD129"
    assert list(first.cdi_devices) == []


async def test_allocate_with_cdi_writes_the_spec(h: Harness) -> None:
    h.mknod("/dev/ttyUSB0")
    h.mknod("/dev/ttyUSB1")
    res = {"name": "serial", "devices": ["/dev/ttyUSB*"], "cdi": True, "replicas": 2, "env": {"BAUD": "9600"}}
    await h.start(h.config([res]))
    ep = await h.ep("serial")
    spec_path = h.cdi_dir / "nodeplug.io-serial.json"
    spec = json.loads(spec_path.read_text())
    assert spec["cdiVersion"] == "0.6.0" and spec["kind"] == "nodeplug.io/serial"
    assert [d["name"] for d in spec["devices"]] == ["ttyUSB0::0", "ttyUSB0::1", "ttyUSB1::0", "ttyUSB1::1"]
    assert spec["devices"][2]["containerEdits"]["deviceNodes"] == [
        {"path": "/dev/ttyUSB1", "hostPath": "/dev/ttyUSB1", "permissions": "rw"}
    ]
    assert spec["containerEdits"] == {"env": ["BAUD=9600"]}
    resp = await ep.stub.Allocate(alloc(["ttyUSB1::0", "ttyUSB0::1"]))
    (c,) = resp.container_responses
    assert [d.name for d in c.cdi_devices] == ["nodeplug.io/serial=ttyUSB1::0", "nodeplug.io/serial=ttyUSB0::1"]
    assert list(c.devices) == [] and dict(c.envs) == {"NODEPLUG_SERIAL_DEVICES": "ttyUSB1::0,ttyUSB0::1"}
    h.mknod("/dev/ttyUSB2")  # hotplug: the spec follows
    await ep.wait_listing(lambda listing: len(listing) == 6, 1)
    assert "ttyUSB2::1" in [d["name"] for d in json.loads(spec_path.read_text())["devices"]]
    spec_path.unlink()  # someone removed it: Allocate writes it again before answering
    await ep.stub.Allocate(alloc(["ttyUSB2::1"]))
    assert spec_path.exists()
    assert [p.name for p in h.cdi_dir.iterdir()] == ["nodeplug.io-serial.json"]


async def test_allocate_rejects_unknown_and_duplicate_ids_with_no_partial_answer(h: Harness) -> None:
    h.mknod("/dev/ttyUSB0")
    h.mknod("/dev/ttyUSB1")
    await h.start(h.config([{"name": "serial", "devices": ["/dev/ttyUSB*"]}]))
    ep = await h.ep("serial")
    cases = [
        (alloc(["ttyUSB0"], ["ttyUSB7", "ttyUSB9"]), grpc.StatusCode.INVALID_ARGUMENT,
         "container_requests[1]: unknown device IDs: ttyUSB7, ttyUSB9"),
        (alloc(["ttyUSB0", "ttyUSB1", "ttyUSB0"]), grpc.StatusCode.INVALID_ARGUMENT,
         "container_requests[0]: duplicate device IDs: ttyUSB0"),
        (alloc([]), grpc.StatusCode.INVALID_ARGUMENT, "no device IDs"),
        (api_pb2.AllocateRequest(), grpc.StatusCode.INVALID_ARGUMENT, "no container_requests"),
    ]  # fmt: skip
    for req, code, text in cases:
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await ep.stub.Allocate(req)
        assert e.value.code() == code
        assert text in (e.value.details() or ""), e.value.details()


def _pci(host: Path, addr: str, numa: int, group: int) -> None:
    d = host / "sys/devices/pci0000:00" / addr
    d.mkdir(parents=True)
    for name, text in {"vendor": "0x15b3", "device": "0x101b", "class": "0x020700", "numa_node": str(numa)}.items():
        (d / name).write_text(text + "\n")
    g = host / f"sys/kernel/iommu_groups/{group}"
    g.mkdir(parents=True)
    (d / "iommu_group").symlink_to(os.path.relpath(g, d))
    link = host / "sys/bus/pci/devices" / addr
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(os.path.relpath(d, link.parent))


async def test_pci_numa_topology_and_preferred_allocation(h: Harness) -> None:
    layout = {"0000:17:00.0": (0, 10), "0000:17:00.1": (0, 11), "0000:b3:00.0": (1, 20), "0000:b3:00.1": (1, 21)}
    for addr, (numa, group) in layout.items():
        _pci(h.host, addr, numa, group)
        h.mknod(f"/dev/vfio/{group}")
    h.mknod("/dev/vfio/vfio")
    res = {
        "name": "hca",
        "pci": [{"vendor": "15b3", "class_prefix": "0207"}],
        "nodes": ["/dev/vfio/vfio"],
        "replicas": 2,
    }
    await h.start(h.config([res]))
    ep = await h.ep("hca")
    assert ep.latest[0] == ("0000:17:00.0::0", "Healthy", (0,))
    assert ep.latest[-1] == ("0000:b3:00.1::1", "Healthy", (1,))
    avail = ids(ep.latest)

    async def prefer(available: list[str], must: list[str], size: int) -> list[str]:
        req = api_pb2.PreferredAllocationRequest(
            container_requests=[
                api_pb2.ContainerPreferredAllocationRequest(
                    available_deviceIDs=available, must_include_deviceIDs=must, allocation_size=size
                )
            ]
        )
        resp = await ep.stub.GetPreferredAllocation(req)
        return list(resp.container_responses[0].deviceIDs)

    # must_include on NUMA 1: stay on NUMA 1, on distinct physical devices
    assert await prefer(avail, ["0000:b3:00.0::1"], 2) == ["0000:b3:00.0::1", "0000:b3:00.1::0"]
    # three replicas fit on one NUMA node (four per node)
    got = await prefer(avail, [], 3)
    assert {a[:7] for a in got} == {"0000:17"} and len({a.split("::")[0] for a in got}) == 2
    # only from available: NUMA 0 mostly gone, so NUMA 1 is chosen
    assert await prefer(["0000:17:00.0::0", *avail[4:]], [], 2) == ["0000:b3:00.0::0", "0000:b3:00.1::0"]
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await prefer(avail[:1], ["0000:b3:00.0::0"], 2)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "must_include_deviceIDs not in available_deviceIDs: 0000:b3:00.0::0" in (e.value.details() or "")
    resp = await ep.stub.Allocate(alloc(["0000:b3:00.0::0", "0000:b3:00.0::1"]))
    assert [d.host_path for d in resp.container_responses[0].devices] == ["/dev/vfio/20", "/dev/vfio/vfio"]
    # PCI hotplug on the fake sysfs tree (inotify on the bus directory; uevents cover real sysfs)
    _pci(h.host, "0000:b3:00.2", 1, 22)
    await ep.wait_listing(lambda listing: "0000:b3:00.2::0" in ids(listing), 1)
    assert health(ep.latest)["0000:b3:00.2::0"] == "Unhealthy"  # its vfio group node is not there yet
    h.mknod("/dev/vfio/22")
    await ep.wait_listing(lambda listing: health(listing)["0000:b3:00.2::0"] == "Healthy", 1)


async def test_prestart_runs_the_reset_command(h: Harness) -> None:
    h.mknod("/dev/fuse")
    marks = h.tmp / "marks"
    marks.mkdir()
    reset = {"command": ["touch", str(marks / "reset-{id}")], "timeout_seconds": 5}
    await h.start(h.config([{"name": "fuse", "devices": ["/dev/fuse"], "replicas": 2, "reset": reset}]))
    ep = await h.ep("fuse")
    assert ep.options is not None and ep.options.pre_start_required
    await ep.stub.PreStartContainer(api_pb2.PreStartContainerRequest(devices_ids=["fuse::0", "fuse::1"]))
    assert [p.name for p in marks.iterdir()] == ["reset-fuse"]  # once per physical device
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await ep.stub.PreStartContainer(api_pb2.PreStartContainerRequest(devices_ids=["nope"]))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "nope" in (e.value.details() or "")


async def test_prestart_reset_failure_is_an_error(h: Harness) -> None:
    h.mknod("/dev/fuse")
    reset = {"command": ["false"]}
    await h.start(h.config([{"name": "fuse", "devices": ["/dev/fuse"], "reset": reset}]))
    ep = await h.ep("fuse")
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await ep.stub.PreStartContainer(api_pb2.PreStartContainerRequest(devices_ids=["fuse"]))
    assert e.value.code() == grpc.StatusCode.INTERNAL
    assert "command 'false' exited with status 1" in (e.value.details() or "")


async def test_every_stream_gets_every_change_and_cancelled_streams_end(h: Harness) -> None:
    h.mknod("/dev/ttyUSB0")
    plugin = await h.start(h.config([{"name": "serial", "devices": ["/dev/ttyUSB*"]}]))
    ep = await h.ep("serial")
    calls = [ep.stub.ListAndWatch(api_pb2.Empty()) for _ in range(3)]
    firsts = [await c.read() for c in calls]
    assert all([d.ID for d in f.devices] == ["ttyUSB0"] for f in firsts)
    rt = plugin.resources["serial"]
    assert rt.updates.subscribers == 4  # the stand-in's stream and ours
    h.mknod("/dev/ttyUSB1")
    for c in calls:
        msg = await asyncio.wait_for(c.read(), 1)
        assert [d.ID for d in msg.devices] == ["ttyUSB0", "ttyUSB1"]
    for c in calls:
        c.cancel()
    for _ in range(200):
        if rt.updates.subscribers == 1:
            break
        await asyncio.sleep(0.01)
    assert rt.updates.subscribers == 1
    assert 'nodeplug_deviceplugin_streams{resource="serial"} 1.0' in plugin.ctx.metrics.render().decode()


async def test_uevent_rescans_sysfs_resources_and_inotify_only_the_watching_ones(h: Harness) -> None:
    _pci(h.host, "0000:17:00.0", 0, 10)
    h.mknod("/dev/vfio/10")
    h.mknod("/dev/fuse")
    (h.host / "dev/serial").mkdir()
    res: list[dict[str, Any]] = [
        {"name": "hca", "pci": [{"vendor": "15b3"}]},
        {"name": "fuse", "devices": ["/dev/fuse"]},
        {"name": "serial", "devices": ["/dev/serial/tty*"]},
    ]
    plugin = await h.start(h.config(res))
    if plugin._uevents is not None:  # the host's own uevents (other work on this machine) would add scans
        plugin._uevents.close()
        plugin._uevents = None
    scans = dict.fromkeys(plugin.resources, 0)
    for name, rt in plugin.resources.items():
        original = rt.rescan

        def counting(name: str = name, original: Any = original) -> bool:
            scans[name] += 1
            return bool(original())

        rt.rescan = counting  # type: ignore[method-assign]

    async def settle() -> dict[str, int]:
        await asyncio.sleep(0.1)
        out = dict(scans)
        scans.update(dict.fromkeys(scans, 0))
        return out

    plugin._on_uevent("add", {"SUBSYSTEM": "pci", "DEVPATH": "/devices/pci0000:00/0000:17:00.0"})
    assert await settle() == {"hca": 1, "fuse": 0, "serial": 0}
    h.mknod("/dev/serial/tty0")
    assert await settle() == {"hca": 0, "fuse": 0, "serial": 1}
    h.mknod("/dev/other")  # /dev itself: fuse watches it (and hca its vfio nodes' directory, /dev/vfio)
    assert await settle() == {"hca": 0, "fuse": 1, "serial": 0}


async def test_cdi_dir_unwritable_then_fixed(h: Harness) -> None:
    h.mknod("/dev/fuse")
    h.cdi_dir.parent.mkdir(parents=True)
    h.cdi_dir.write_text("")  # a file where the CDI directory should be: every write fails
    await h.start(h.config([{"name": "fuse", "devices": ["/dev/fuse"], "cdi": True}]))
    ep = await h.ep("fuse")  # serving and registered all the same
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await ep.stub.Allocate(alloc(["fuse"]))
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE and str(h.cdi_dir) in (e.value.details() or "")
    h.cdi_dir.unlink()
    resp = await ep.stub.Allocate(alloc(["fuse"]))
    assert [d.name for d in resp.container_responses[0].cdi_devices] == ["nodeplug.io/fuse=fuse"]
    assert json.loads((h.cdi_dir / "nodeplug.io-fuse.json").read_text())["devices"][0]["name"] == "fuse"


async def test_rejected_registration_retries_with_backoff_and_logs_once(
    h: Harness, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(logging.getLogger("nodeplug"), "propagate", True)  # log.setup() elsewhere turns it off
    h.mknod("/dev/fuse")
    h.kubelet.reject = "device manager not ready"
    await h.kubelet.start()
    caplog.set_level(logging.INFO, logger="nodeplug.deviceplugin")
    plugin = await h.start(h.config([{"name": "fuse", "devices": ["/dev/fuse"]}]), kubelet=False)
    await asyncio.sleep(0.5)  # attempts at about 0, 50, 150, 350 ms
    errors = 'nodeplug_deviceplugin_registrations_total{resource="fuse",result="error"}'
    text = plugin.ctx.metrics.render().decode()
    attempts = float(next(line for line in text.splitlines() if line.startswith(errors)).split()[-1])
    assert 3 <= attempts <= 6
    # distinct records: after another test's log.setup() the same record can reach the capture handler twice
    warnings = {id(r) for r in caplog.records if r.getMessage().startswith("not registered")}
    assert len(warnings) == 1
    assert not plugin.readiness().ready
    h.kubelet.reject = None
    await h.kubelet.wait_registered("nodeplug.io/fuse", timeout=3)
    assert plugin.readiness().ready
    assert len({id(r) for r in caplog.records if r.getMessage() == "registered"}) == 1
