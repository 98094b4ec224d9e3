"""Allocate and PreStartContainer as kubelet calls them: device specs, mounts and envs, CDI specs and names,
bad IDs named in the error with no partial answer, reset commands.

Through the ``dp`` fixture (tests/support/dpharness.py), with real device nodes (mknod) in its host root.
"""

from __future__ import annotations

import json
import os

import grpc
import pytest

from nodeplug.api.deviceplugin.v1beta1 import api_pb2

from lab.devicehost import alloc
from support.dpharness import Harness, ids

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root: makes device nodes with mknod"),
]


async def test_allocate_device_specs_mounts_and_envs(dp: Harness) -> None:
    for i in range(3):
        dp.mknod(f"/dev/dri/renderD{128 + i}")
    res = {
        "name": "gpu",
        "devices": ["/dev/dri/renderD*"],
        "permissions": "rwm",
        "mounts": [{"host_path": "/usr/share/gpu", "container_path": "/opt/gpu", "read_only": False}],
        "env": {"GPU_MODE": "compute"},
    }
    await dp.start(dp.config([res]))
    ep = await dp.ep("gpu")
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


async def test_allocate_with_cdi_writes_the_spec(dp: Harness) -> None:
    dp.mknod("/dev/ttyUSB0")
    dp.mknod("/dev/ttyUSB1")
    res = {"name": "serial", "devices": ["/dev/ttyUSB*"], "cdi": True, "replicas": 2, "env": {"BAUD": "9600"}}
    await dp.start(dp.config([res]))
    ep = await dp.ep("serial")
    spec_path = dp.cdi_dir / "nodeplug.io-serial.json"
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
    dp.mknod("/dev/ttyUSB2")  # hotplug: the spec follows
    await ep.wait_listing(lambda listing: len(listing) == 6)
    assert "ttyUSB2::1" in [d["name"] for d in json.loads(spec_path.read_text())["devices"]]
    spec_path.unlink()  # someone removed it: Allocate writes it again before answering
    await ep.stub.Allocate(alloc(["ttyUSB2::1"]))
    assert spec_path.exists()
    assert [p.name for p in dp.cdi_dir.iterdir()] == ["nodeplug.io-serial.json"]


async def test_cdi_dir_unwritable_then_fixed(dp: Harness) -> None:
    dp.mknod("/dev/fuse")
    dp.cdi_dir.parent.mkdir(parents=True)
    dp.cdi_dir.write_text("")  # a file where the CDI directory should be: every write fails
    await dp.start(dp.config([{"name": "fuse", "devices": ["/dev/fuse"], "cdi": True}]))
    ep = await dp.ep("fuse")  # serving and registered all the same
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await ep.stub.Allocate(alloc(["fuse"]))
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE and str(dp.cdi_dir) in (e.value.details() or "")
    dp.cdi_dir.unlink()
    resp = await ep.stub.Allocate(alloc(["fuse"]))
    assert [d.name for d in resp.container_responses[0].cdi_devices] == ["nodeplug.io/fuse=fuse"]
    assert json.loads((dp.cdi_dir / "nodeplug.io-fuse.json").read_text())["devices"][0]["name"] == "fuse"


async def test_allocate_rejects_unknown_and_duplicate_ids_with_no_partial_answer(dp: Harness) -> None:
    dp.mknod("/dev/ttyUSB0")
    dp.mknod("/dev/ttyUSB1")
    await dp.start(dp.config([{"name": "serial", "devices": ["/dev/ttyUSB*"]}]))
    ep = await dp.ep("serial")
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


async def test_prestart_runs_the_reset_command(dp: Harness) -> None:
    dp.mknod("/dev/fuse")
    marks = dp.base / "marks"
    marks.mkdir()
    reset = {"command": ["touch", str(marks / "reset-{id}")], "timeout_seconds": 5}
    await dp.start(dp.config([{"name": "fuse", "devices": ["/dev/fuse"], "replicas": 2, "reset": reset}]))
    ep = await dp.ep("fuse")
    assert ep.options is not None and ep.options.pre_start_required
    await ep.stub.PreStartContainer(api_pb2.PreStartContainerRequest(devices_ids=["fuse::0", "fuse::1"]))
    assert [p.name for p in marks.iterdir()] == ["reset-fuse"]  # once per physical device
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await ep.stub.PreStartContainer(api_pb2.PreStartContainerRequest(devices_ids=["nope"]))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "nope" in (e.value.details() or "")


async def test_prestart_reset_failure_is_an_error(dp: Harness) -> None:
    dp.mknod("/dev/fuse")
    reset = {"command": ["false"]}
    await dp.start(dp.config([{"name": "fuse", "devices": ["/dev/fuse"], "reset": reset}]))
    ep = await dp.ep("fuse")
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await ep.stub.PreStartContainer(api_pb2.PreStartContainerRequest(devices_ids=["fuse"]))
    assert e.value.code() == grpc.StatusCode.INTERNAL
    assert "command 'false' exited with status 1" in (e.value.details() or "")
