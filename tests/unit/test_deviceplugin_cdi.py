"""Container edits and the CDI spec: content, atomic write, removal."""

from __future__ import annotations

import json
import os
from pathlib import Path

from deviceplugin.cdi import build_spec, container_edits, qualified, remove_spec, spec_filename, write_spec
from deviceplugin.config import MountSpec, PciMatch, Resource
from deviceplugin.discovery import Device, DeviceNode
from deviceplugin.state import DeviceTable


def listing(res: Resource) -> DeviceTable:
    t = DeviceTable(replicas=res.replicas)

    def nodes(*paths: str) -> tuple[DeviceNode, ...]:
        return tuple(DeviceNode(x, x) for x in paths)

    t.update(
        [
            Device("0000:3b:00.0", nodes("/dev/vfio/40", "/dev/vfio/vfio"), 0, "0000:3b:00.0"),
            Device("0000:3b:00.1", nodes("/dev/vfio/41", "/dev/vfio/vfio"), 0, "0000:3b:00.1"),
        ],
        now=0,
    )
    return t


RES = Resource(
    name="nic",
    pci=[PciMatch(vendor="8086")],
    permissions="rwm",
    mounts=[MountSpec(host_path="/etc/nic", container_path="/etc/nic")],
    env={"NIC_MODE": "vfio"},
    replicas=2,
)


def test_container_edits_without_cdi() -> None:
    t = listing(RES)
    entries = [t.get("0000:3b:00.0::0"), t.get("0000:3b:00.0::1"), t.get("0000:3b:00.1::0")]
    edits = container_edits(RES, [e for e in entries if e is not None])
    assert [(d.host_path, d.container_path, d.permissions) for d in edits.devices] == [
        ("/dev/vfio/40", "/dev/vfio/40", "rwm"),
        ("/dev/vfio/vfio", "/dev/vfio/vfio", "rwm"),  # once, though three devices carry it
        ("/dev/vfio/41", "/dev/vfio/41", "rwm"),
    ]
    assert [(m.host_path, m.container_path, m.read_only) for m in edits.mounts] == [("/etc/nic", "/etc/nic", True)]
    assert edits.envs == {
        "NIC_MODE": "vfio",
        "NODEPLUG_NIC_DEVICES": "0000:3b:00.0::0,0000:3b:00.0::1,0000:3b:00.1::0",
    }
    assert edits.cdi_devices == []


def test_container_edits_with_cdi_name_devices_only() -> None:
    res = RES.model_copy(update={"cdi": True})
    t = listing(res)
    e = t.get("0000:3b:00.1::1")
    assert e is not None
    edits = container_edits(res, [e])
    assert edits.cdi_devices == ["nodeplug.io/nic=0000:3b:00.1::1"] == [qualified(res, e.id)]
    assert edits.devices == [] and edits.mounts == []
    assert edits.envs == {"NODEPLUG_NIC_DEVICES": "0000:3b:00.1::1"}


def test_spec_content_and_atomic_write(tmp_path: Path) -> None:
    res = RES.model_copy(update={"cdi": True, "replicas": 1})
    spec = build_spec(res, listing(res).listing)
    assert spec["cdiVersion"] == "0.6.0" and spec["kind"] == "nodeplug.io/nic"
    assert spec["devices"][0] == {
        "name": "0000:3b:00.0",
        "containerEdits": {
            "deviceNodes": [
                {"path": "/dev/vfio/40", "hostPath": "/dev/vfio/40", "permissions": "rwm"},
                {"path": "/dev/vfio/vfio", "hostPath": "/dev/vfio/vfio", "permissions": "rwm"},
            ]
        },
    }
    assert spec["containerEdits"] == {
        "env": ["NIC_MODE=vfio"],
        "mounts": [{"hostPath": "/etc/nic", "containerPath": "/etc/nic", "options": ["rbind", "ro"]}],
    }
    d = tmp_path / "var/run/cdi"
    path = write_spec(d, res, spec)
    assert path == d / spec_filename(res) == d / "nodeplug.io-nic.json"
    assert json.loads(path.read_text()) == spec
    assert oct(os.stat(path).st_mode & 0o777) == "0o644"
    spec["devices"] = spec["devices"][:1]
    write_spec(d, res, spec)
    assert json.loads(path.read_text())["devices"] == spec["devices"]
    assert sorted(os.listdir(d)) == ["nodeplug.io-nic.json"]  # no temp files left
    remove_spec(d, res)
    remove_spec(d, res)  # already gone: fine
    assert os.listdir(d) == []
