"""Holds between the device plugin and DRA (pure): device-plugin allocations withheld until kubelet's pod-resources
API stops listing them; restarts read them back from that API."""

from __future__ import annotations

from deviceplugin.discovery import Device
from deviceplugin.dra.inventory import GRACE_SECONDS, DevicePluginHolds
from deviceplugin.state import Listed


def listed(i: str) -> Listed:
    return Listed(i, Device(i.split("::")[0], ()), True)


def test_holds_released_when_no_pod_lists_them() -> None:
    h = DevicePluginHolds()
    names = {"fuse": "nodeplug.io/fuse"}
    assert h.allocated("fuse", [listed("fuse::0"), listed("fuse::1")], now=100.0)
    assert set(h.held) == {("fuse", "fuse")}
    # too young to judge: kubelet may not list it yet
    assert not h.reconcile({}, names, now=100.0 + GRACE_SECONDS / 2)
    assert h.held
    # listed by kubelet: kept however old
    assert not h.reconcile({"nodeplug.io/fuse": {"fuse::1"}}, names, now=1000.0)
    assert h.held
    # no pod lists it any more
    assert h.reconcile({"nodeplug.io/fuse": set()}, names, now=1000.0)
    assert not h.held


def test_holds_found_in_use_after_a_restart() -> None:
    h = DevicePluginHolds()
    names = {"fuse": "nodeplug.io/fuse", "tun": "nodeplug.io/tun"}
    assert h.reconcile({"nodeplug.io/tun": {"net-tun"}, "nodeplug.io/other": {"x"}}, names, now=5.0)
    assert set(h.held) == {("tun", "net-tun")}
