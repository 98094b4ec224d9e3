"""The device table: replicas, health reasons both ways, forgetting devices that stay gone."""

from __future__ import annotations

from deviceplugin.discovery import Device, DeviceNode
from deviceplugin.state import DeviceTable, physical_id, replica_ids


def dev(i: str, numa: int | None = None, missing: tuple[str, ...] = ()) -> Device:
    return Device(i, (DeviceNode(f"/dev/{i}", f"/dev/{i}"),), numa, "", missing)


def view(t: DeviceTable) -> list[tuple[str, str]]:
    return [(e.id, e.health) for e in t.listing]


def test_replicas_expand_in_natural_order() -> None:
    t = DeviceTable(replicas=2)
    assert t.update([dev("ttyUSB10"), dev("ttyUSB2")], now=0)
    assert [e.id for e in t.listing] == ["ttyUSB2::0", "ttyUSB2::1", "ttyUSB10::0", "ttyUSB10::1"]
    assert replica_ids("a", 1) == ["a"] and physical_id("0000:3b:00.0::3") == "0000:3b:00.0"
    assert t.get("ttyUSB2::1") is not None and t.get("ttyUSB2") is None


def test_gone_device_is_unhealthy_then_back_then_forgotten() -> None:
    t = DeviceTable(forget_after=10)
    t.update([dev("a"), dev("b")], now=0)
    assert t.update([dev("a")], now=1)
    assert view(t) == [("a", "Healthy"), ("b", "Unhealthy")]
    assert t.reason("b") == "device is gone from the node"
    assert t.next_expiry() == 11
    assert t.update([dev("a"), dev("b")], now=2)  # back in time: healthy, same ID
    assert view(t) == [("a", "Healthy"), ("b", "Healthy")] and t.next_expiry() is None
    t.update([dev("a")], now=3)
    assert not t.expire(now=12.9)
    assert t.expire(now=13)
    assert view(t) == [("a", "Healthy")]
    assert [d.id for d in t.devices()] == ["a"]


def test_forget_at_once_when_configured() -> None:
    t = DeviceTable(forget_after=0)
    t.update([dev("a"), dev("b")], now=0)
    assert t.update([dev("a")], now=1)
    assert view(t) == [("a", "Healthy")]


def test_missing_nodes_and_health_command_make_unhealthy_until_fixed() -> None:
    t = DeviceTable()
    t.update([dev("a", missing=("/dev/vfio/3",))], now=0)
    assert view(t) == [("a", "Unhealthy")] and "/dev/vfio/3" in t.reason("a")
    assert t.update([dev("a")], now=1)
    assert t.set_command_health("a", "health command 'x' exited with status 1")
    assert view(t) == [("a", "Unhealthy")]
    assert not t.set_command_health("a", "still failing")  # kubelet sees nothing new
    assert t.set_command_health("a", None)
    assert view(t) == [("a", "Healthy")]
    assert not t.set_command_health("nope", None)


def test_unchanged_discovery_reports_no_change_but_numa_change_does() -> None:
    t = DeviceTable()
    assert t.update([dev("a", numa=0)], now=0)
    assert not t.update([dev("a", numa=0)], now=1)
    assert t.update([dev("a", numa=1)], now=2)


def test_with_a_health_command_new_devices_wait_for_their_first_check() -> None:
    t = DeviceTable(checked=True)
    t.update([dev("a")], now=0)
    assert view(t) == [("a", "Unhealthy")] and t.reason("a") == "health command not run yet"
    assert t.set_command_health("a", None)
    t.update([], now=1)
    t.update([dev("a")], now=2)  # back after a short absence: its last check still stands
    assert view(t) == [("a", "Healthy")]
