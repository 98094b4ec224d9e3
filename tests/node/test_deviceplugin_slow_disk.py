"""A disk that stops answering writes never stops the device plugin's event loop.

The device plugin's CDI spec (written after every change, with two fsyncs and a rename) and the DRA driver's claims
database (opened, migrated and read at start; checkpointed at close) live on a filesystem that is frozen while the
plugin works (tests/support/slowdisk.py: a real ext4 on a loop device, ``fsfreeze``): the writes wait in a worker
thread, and meanwhile the loop answers kubelet for the other resources, so the stand-in's Allocate and listings
arrive. Each test then thaws the disk and sees the held-back work finish.
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Callable
from pathlib import Path

import pytest

from deviceplugin import cdi
from deviceplugin.config import Resource
from deviceplugin.plugin import DevicePlugin
from nodeplug.kube import KubeClient, resolve
from nodeplug.paths import PLUGINS_DIR

from lab.devicehost import alloc
from support.dpharness import Harness, ids
from support.slowdisk import SlowDisk
from support.wait import eventually

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root: mounts and freezes a filesystem, mknod")

STATE = "/var/lib/nodeplug/dra"
HANG = 60  # bounds a hang; none of these waits takes more than a fraction of a second when the code is right


def spec_ids(path: Path) -> list[str]:
    return [d["name"] for d in json.loads(path.read_text())["devices"]]


async def test_a_stuck_cdi_spec_write_holds_back_its_resource_only(
    dp: Harness, slow_disk: Callable[[Path], SlowDisk]
) -> None:
    disk = slow_disk(dp.cdi_dir)
    dp.mknod("/dev/widget0")
    dp.mknod("/dev/ttyUSB0")
    await dp.start(dp.config([
        {"name": "widget", "devices": ["/dev/widget*"], "cdi": True},
        {"name": "serial", "devices": ["/dev/ttyUSB*"]},
    ]))  # fmt: skip
    widget, serial = await dp.ep("widget"), await dp.ep("serial")
    spec = dp.cdi_dir / cdi.spec_filename(Resource(name="widget", devices=["/dev/widget*"], cdi=True))
    assert ids(widget.latest) == ["widget0"] and spec_ids(spec) == ["widget0"]
    with disk.frozen(hang_bound=HANG * 2):
        dp.mknod("/dev/widget1")  # its spec write now waits for the disk
        dp.mknod("/dev/ttyUSB1")  # seen in the same scan round or the next
        await serial.wait_listing(lambda listing: ids(listing) == ["ttyUSB0", "ttyUSB1"], timeout=HANG)
        resp = await asyncio.wait_for(serial.stub.Allocate(alloc(["ttyUSB1"])), HANG)
        assert [d.host_path for d in resp.container_responses[0].devices] == ["/dev/ttyUSB1"]
        # an ID the spec names already is answered at once, the disk stuck or not
        resp = await asyncio.wait_for(widget.stub.Allocate(alloc(["widget0"])), HANG)
        assert [d.name for d in resp.container_responses[0].cdi_devices] == ["nodeplug.io/widget=widget0"]
        # kubelet is not told of widget1 before the spec names it
        assert ids(widget.latest) == ["widget0"] and spec_ids(spec) == ["widget0"]
    await widget.wait_listing(lambda listing: ids(listing) == ["widget0", "widget1"], timeout=HANG)
    assert spec_ids(spec) == ["widget0", "widget1"]


async def test_the_claims_database_opens_and_closes_off_the_event_loop(
    dp: Harness, slow_disk: Callable[[Path], SlowDisk], tmp_path: Path
) -> None:
    """The DRA driver starts after the device plugin's resources: while its database waits for the disk, they are
    served; the same when it closes on stop. A real API client, of a server that is not there (DRA never waits for
    it)."""
    state = dp.ctx.root(STATE)
    disk = slow_disk(state)
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(
        "apiVersion: v1\nkind: Config\ncurrent-context: x\n"
        'clusters: [{name: c, cluster: {server: "https://127.0.0.1:9", insecure-skip-tls-verify: true}}]\n'
        "users: [{name: u, user: {token: t}}]\ncontexts: [{name: x, context: {cluster: c, user: u}}]\n"
    )
    source = resolve(kubeconfig, env={})
    assert source is not None
    dp.ctx.kube, dp.ctx.node_name = KubeClient(source), "node-a"
    dp.mknod("/dev/fuse")
    cfg = dp.config([{"name": "fuse", "devices": ["/dev/fuse"]}], dra={"enabled": True, "state_dir": STATE})
    dra_socket = dp.ctx.root(f"{PLUGINS_DIR}/devices.nodeplug.io/dra.sock")
    try:
        with disk.frozen(hang_bound=HANG * 2):
            await dp.kubelet.start()
            dp.plugin = plugin = DevicePlugin(cfg, dp.ctx)
            starting = asyncio.create_task(plugin.start())
            fuse = await dp.ep("fuse")  # registered while the database waits for the disk
            resp = await asyncio.wait_for(fuse.stub.Allocate(alloc(["fuse"])), HANG)
            assert [d.host_path for d in resp.container_responses[0].devices] == ["/dev/fuse"]
            assert not starting.done() and not dra_socket.exists()  # the driver did wait for the disk
        await asyncio.wait_for(starting, HANG)
        assert dra_socket.is_socket() and (state / "claims.db").is_file()
        with disk.frozen(hang_bound=HANG * 2):
            stopping = asyncio.create_task(plugin.stop(0))  # the DRA driver first: its socket, then its database
            await eventually(lambda: not dra_socket.exists(), HANG, "the DRA socket removed")
            resp = await asyncio.wait_for(fuse.stub.Allocate(alloc(["fuse"])), HANG)
            assert [d.host_path for d in resp.container_responses[0].devices] == ["/dev/fuse"]
            assert not stopping.done()  # the database's close did wait for the disk
        await asyncio.wait_for(stopping, HANG)
        dp.plugin = None
    finally:
        await dp.ctx.kube.close()
