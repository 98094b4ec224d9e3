"""Discovery over a fake /sys tree and plain files standing in for PCI/USB device nodes (no root needed)."""

from __future__ import annotations

import os
from pathlib import Path

from deviceplugin.config import PciMatch, Resource, UsbMatch
from deviceplugin.discovery import discover, glob_id, natural_key, watch_dirs


def _files(base: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        p = base / name
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text + "\n")


def _link(link: Path, target: Path) -> None:
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(os.path.relpath(target, link.parent))


def pci(host: Path, addr: str, vendor: str, device: str, klass: str, numa: int, group: int | None) -> None:
    d = host / "sys/devices/pci0000:00" / addr
    _files(d, {"vendor": f"0x{vendor}", "device": f"0x{device}", "class": f"0x{klass}", "numa_node": str(numa)})
    if group is not None:
        g = host / f"sys/kernel/iommu_groups/{group}"
        g.mkdir(parents=True, exist_ok=True)
        _link(d / "iommu_group", g)
    _link(host / "sys/bus/pci/devices" / addr, d)


def usb(host: Path, parent: Path, name: str, vendor: str, product: str, serial: str | None, busdev: str) -> Path:
    d = parent / name
    files = {"idVendor": vendor, "idProduct": product, "dev": "189:9", "uevent": f"DEVNAME=bus/usb/{busdev}"}
    if serial is not None:
        files["serial"] = serial
    _files(d, files)
    _link(host / "sys/bus/usb/devices" / name, d)
    return d


def test_pci_matchers_nodes_and_numa(tmp_path: Path) -> None:
    host = tmp_path
    pci(host, "0000:3b:00.0", "8086", "1572", "020000", 1, 40)
    pci(host, "0000:3b:00.1", "8086", "1572", "020000", 1, 41)
    pci(host, "0000:af:00.0", "10de", "1eb8", "030200", -1, 70)
    pci(host, "0000:00:1f.0", "8086", "a1c8", "060100", 0, None)
    _files(host / "dev/vfio", {"40": "", "70": "", "vfio": ""})
    res = Resource(name="nic", pci=[PciMatch(vendor="8086", class_prefix="02")], nodes=["/dev/vfio/vfio"])
    found = discover(res, str(host))
    assert [d.id for d in found.devices] == ["0000:3b:00.0", "0000:3b:00.1"]
    a, b = found.devices
    assert [n.host_path for n in a.nodes] == ["/dev/vfio/40", "/dev/vfio/vfio"]
    assert a.numa == 1 and a.address == "0000:3b:00.0" and a.missing == ()
    assert b.missing == ("/dev/vfio/41",)  # present in sysfs, node not there: unhealthy later
    gpu = discover(Resource(name="gpu", pci=[PciMatch(vendor="10DE", device="1eb8")]), str(host)).devices
    assert [(d.id, d.numa) for d in gpu] == [("0000:af:00.0", None)]  # numa_node -1: no NUMA node


def test_pci_without_iommu_group_is_reported_not_listed(tmp_path: Path) -> None:
    pci(tmp_path, "0000:00:1f.0", "8086", "a1c8", "060100", 0, None)
    found = discover(Resource(name="isa", pci=[PciMatch(class_prefix="0601")]), str(tmp_path))
    assert found.devices == []
    assert found.problems == ["PCI device 0000:00:1f.0: no iommu_group (bind it to vfio-pci), skipped"]
    plain = PciMatch(class_prefix="0601", nodes=["/dev/isa-{address}"])
    (tmp_path / "dev").mkdir()
    (tmp_path / "dev/isa-0000:00:1f.0").write_text("")
    assert [
        n.host_path for d in discover(Resource(name="isa", pci=[plain]), str(tmp_path)).devices for n in d.nodes
    ] == ["/dev/isa-0000:00:1f.0"]


def test_usb_by_vendor_product_serial_with_nodes_from_sysfs(tmp_path: Path) -> None:
    host = tmp_path
    ctrl = host / "sys/devices/pci0000:00/0000:00:14.0"
    _files(ctrl, {"numa_node": "1"})
    hub = ctrl / "usb1"
    _files(hub, {"idVendor": "1d6b", "idProduct": "0002"})
    _link(host / "sys/bus/usb/devices/usb1", hub)
    ftdi = usb(host, hub, "1-1", "0403", "6001", "A10K", "001/002")
    tty = ftdi / "1-1:1.0/ttyUSB0/tty/ttyUSB0"
    _files(tty, {"dev": "188:0", "uevent": "MAJOR=188\nMINOR=0\nDEVNAME=ttyUSB0"})
    _files(ftdi / "1-1:1.0", {"bInterfaceClass": "ff"})
    _link(host / "sys/bus/usb/devices/1-1:1.0", ftdi / "1-1:1.0")
    nodev = ftdi / "1-1:1.0/ep_81"
    _files(nodev, {"dev": "250:3"})  # no DEVNAME: addressed by number
    child = usb(host, ftdi, "1-1.2", "0403", "6001", "B22", "001/003")  # behind the first one, as behind a hub
    _files(child / "1-1.2:1.0/ttyUSB1/tty/ttyUSB1", {"dev": "188:1", "uevent": "DEVNAME=ttyUSB1"})

    found = discover(Resource(name="serial", usb=[UsbMatch(vendor="0403", product="6001")]), str(host))
    assert [d.id for d in found.devices] == ["1-1", "1-1.2"]
    first = found.devices[0]
    assert [n.host_path for n in first.nodes] == ["/dev/bus/usb/001/002", "/dev/char/250:3", "/dev/ttyUSB0"]
    assert first.numa == 1 and first.address == "1-1"
    assert [n.host_path for n in found.devices[1].nodes] == ["/dev/bus/usb/001/003", "/dev/ttyUSB1"]
    only = discover(Resource(name="s", usb=[UsbMatch(vendor="0403", product="6001", serial="B22")]), str(host))
    assert [d.id for d in only.devices] == ["1-1.2"]
    assert discover(Resource(name="s", usb=[UsbMatch(vendor="0403", product="6010")]), str(host)).devices == []


def test_missing_trees_find_nothing(tmp_path: Path) -> None:
    res = Resource(
        name="x", devices=["/dev/ttyUSB*"], pci=[PciMatch(vendor="8086")], usb=[UsbMatch(vendor="0001", product="0002")]
    )
    assert discover(res, str(tmp_path)).devices == []


def test_glob_ids_and_natural_order() -> None:
    assert glob_id("/dev/net/tun") == "net-tun"
    assert glob_id("/dev/fuse") == "fuse"
    assert sorted(["ttyUSB10", "ttyUSB2", "ttyUSB1"], key=natural_key) == ["ttyUSB1", "ttyUSB2", "ttyUSB10"]


def test_watch_dirs_cover_globs_nodes_and_missing_dirs(tmp_path: Path) -> None:
    (tmp_path / "dev/dri").mkdir(parents=True)
    res = Resource(name="x", devices=["/dev/dri/renderD*", "/dev/ttyUSB*", "/dev/serial/by-id/*"])
    dirs = watch_dirs(res, str(tmp_path), [])
    assert str(tmp_path / "dev/dri") in dirs
    assert str(tmp_path / "dev") in dirs  # for /dev/ttyUSB* and, /dev/serial missing, its nearest ancestor
    (tmp_path / "dev/serial/by-id").mkdir(parents=True)
    assert str(tmp_path / "dev/serial/by-id") in watch_dirs(res, str(tmp_path), [])
