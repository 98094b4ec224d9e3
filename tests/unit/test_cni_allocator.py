"""The IPAM allocator over the in-memory store: order, exclusions, wrap-around, idempotence, dual stack, GC."""

from __future__ import annotations

import ipaddress
from typing import Any

import pytest

from cni.errors import CniError
from cni.ipam import allocator
from cni.ipam.store import MemoryStore
from cni.netconf import IpamConf, parse_ipam


def ipam(*sets: list[dict[str, Any]], **kw: Any) -> IpamConf:
    return parse_ipam({"type": "nodeplug", "ranges": list(sets), **kw})


def alloc(store: MemoryStore, conf: IpamConf, cid: str, ifname: str = "eth0", requested: Any = ()) -> list[str]:
    with store.transaction() as txn:
        return [str(ip.address) for ip in allocator.allocate(txn, conf, cid, ifname, requested)]


def release(store: MemoryStore, cid: str, ifname: str = "eth0") -> list[str]:
    with store.transaction() as txn:
        return [x.ip for x in allocator.release(txn, cid, ifname)]


def test_first_addresses_skip_network_and_gateway() -> None:
    s, c = MemoryStore(), ipam([{"subnet": "10.0.0.0/29"}])
    got = [alloc(s, c, f"c{i}")[0] for i in range(5)]
    assert got == ["10.0.0.2/29", "10.0.0.3/29", "10.0.0.4/29", "10.0.0.5/29", "10.0.0.6/29"]  # .1 gw, .7 broadcast
    with pytest.raises(CniError) as e:
        alloc(s, c, "c5")
    assert e.value.code == 102 and "10.0.0.1-10.0.0.6" in e.value.details


def test_gateway_inside_the_range_is_skipped_wherever_it_is() -> None:
    s, c = MemoryStore(), ipam([{"subnet": "10.0.0.0/29", "gateway": "10.0.0.3"}])
    got = [alloc(s, c, f"c{i}")[0] for i in range(5)]
    assert "10.0.0.3/29" not in got and len(set(got)) == 5


def test_continues_after_the_last_reserved_and_wraps_around() -> None:
    s, c = MemoryStore(), ipam([{"subnet": "10.0.0.0/29"}])
    assert alloc(s, c, "a") == ["10.0.0.2/29"]
    assert alloc(s, c, "b") == ["10.0.0.3/29"]
    release(s, "a")
    assert alloc(s, c, "c") == ["10.0.0.4/29"]  # not the just-freed .2
    for cid in ("d", "e"):
        alloc(s, c, cid)
    assert alloc(s, c, "f") == ["10.0.0.2/29"]  # wrapped


def test_several_ranges_in_one_set_are_walked_in_turn() -> None:
    s = MemoryStore()
    c = ipam(
        [
            {"subnet": "10.0.0.0/24", "rangeStart": "10.0.0.10", "rangeEnd": "10.0.0.11"},
            {"subnet": "10.0.1.0/24", "rangeStart": "10.0.1.10", "rangeEnd": "10.0.1.10"},
        ]
    )
    got = [alloc(s, c, f"c{i}")[0] for i in range(3)]
    assert got == ["10.0.0.10/24", "10.0.0.11/24", "10.0.1.10/24"]


def test_repeat_add_is_idempotent_per_container_and_ifname() -> None:
    s, c = MemoryStore(), ipam([{"subnet": "10.0.0.0/24"}])
    first = alloc(s, c, "a")
    assert alloc(s, c, "a") == first
    assert alloc(s, c, "a", "net1") != first  # another interface of the same container gets its own
    assert len(s.leases) == 2


def test_dual_stack_one_address_per_range_set() -> None:
    s, c = MemoryStore(), ipam([{"subnet": "10.0.0.0/24"}], [{"subnet": "fd00::/64"}])
    with s.transaction() as txn:
        ips = allocator.allocate(txn, c, "a", "eth0")
    assert [str(ip.address) for ip in ips] == ["10.0.0.2/24", "fd00::2/64"]
    assert [str(ip.gateway) for ip in ips] == ["10.0.0.1", "fd00::1"]


def test_v6_and_v4_integers_do_not_collide() -> None:
    s, c = MemoryStore(), ipam([{"subnet": "10.0.0.0/24"}], [{"subnet": "::a00:0/120"}])
    got = alloc(s, c, "a")
    assert got == ["10.0.0.2/24", "::a00:2/120"]


def test_a_failed_set_rolls_back_the_whole_allocation() -> None:
    s, c = MemoryStore(), ipam([{"subnet": "10.0.0.0/24"}], [{"subnet": "fd00::/126"}])
    alloc(s, c, "a")
    alloc(s, c, "b")
    with pytest.raises(CniError):
        alloc(s, c, "c")  # v6 /126 has only ::2, ::3 besides the gateway
    assert {x.container_id for x in s.leases.values()} == {"a", "b"}


def test_requested_address() -> None:
    s, c = MemoryStore(), ipam([{"subnet": "10.0.0.0/24"}])
    assert alloc(s, c, "a", requested=[ipaddress.ip_address("10.0.0.77")]) == ["10.0.0.77/24"]
    with pytest.raises(CniError) as e:
        alloc(s, c, "b", requested=[ipaddress.ip_address("10.0.0.77")])
    assert "already leased" in e.value.details
    for bad in ("10.0.0.1", "10.9.0.1"):
        with pytest.raises(CniError) as e:
            alloc(s, c, "b", requested=[ipaddress.ip_address(bad)])
        assert e.value.code == 7


def test_release_gc_free_counts_and_check() -> None:
    s, c = MemoryStore(), ipam([{"subnet": "10.0.0.0/29"}])
    for cid in ("a", "b", "c"):
        alloc(s, c, cid)
    with s.transaction() as txn:
        assert allocator.free_counts(txn, c) == [2]
        gone = allocator.gc(txn, [("a", "eth0")])
    assert sorted(x.container_id for x in gone) == ["b", "c"]
    with s.transaction() as txn:
        assert allocator.free_counts(txn, c) == [4]
        mine = allocator.leased(txn, c, "a", "eth0")
        allocator.check(txn, "a", "eth0", mine)
        with pytest.raises(CniError):
            allocator.check(txn, "b", "eth0", mine)
    assert release(s, "a") == ["10.0.0.2"]
    assert release(s, "a") == []  # idempotent


def test_big_v6_range_is_cheap() -> None:
    s, c = MemoryStore(), ipam([{"subnet": "fd00::/64"}])
    got = {alloc(s, c, f"c{i}")[0] for i in range(50)}
    assert len(got) == 50
    with s.transaction() as txn:
        assert allocator.free_counts(txn, c)[0] == 2**64 - 1 - 1 - 50
