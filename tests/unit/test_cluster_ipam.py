"""IPAM on the cluster network: ranges are this node's podCIDRs from the agent's subnets file, or a clear error."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from cni.errors import PLUGIN_NOT_AVAILABLE, TRY_AGAIN_LATER, CniError
from cni.ipam import service
from cni.ipam.store import MemoryStore
from cni.netconf import parse
from cni.nodesubnets import NodeSubnets


def conf(path: Path, **extra: Any) -> dict[str, Any]:
    return {"cniVersion": "1.0.0", "name": "net", "type": "nodeplug", **extra,
            "ipam": {"type": "nodeplug", "nodeSubnets": str(path), "dataDir": "/nonexistent"}}  # fmt: skip


def test_ranges_and_mtu_follow_the_subnets_file(tmp_path: Path) -> None:
    path = tmp_path / "subnets.json"
    path.write_bytes(NodeSubnets("n1", ("10.244.3.0/24", "fd44:0:0:3::/64"), 1450).dumps())
    c = parse(conf(path))
    assert c.mtu == 1450  # type: ignore[union-attr]
    assert [str(rs[0].subnet) for rs in c.ipam_conf.ranges] == ["10.244.3.0/24", "fd44:0:0:3::/64"]
    assert parse(conf(path, mtu=9000)).mtu == 9000  # type: ignore[union-attr]  # the config's own wins
    store = MemoryStore()
    ips, _ = service.add("net", c.ipam_conf, "c1", "eth0", opener=lambda d, n: store)
    assert [str(i.address) for i in ips] == ["10.244.3.2/24", "fd44:0:0:3::2/64"]
    assert [str(i.gateway) for i in ips] == ["10.244.3.1", "fd44:0:0:3::1"]


@pytest.mark.parametrize(
    "content, words",
    [
        (None, "is missing"),
        (NodeSubnets("n1", (), 1450).dumps(), "node n1 has no pod subnet"),
        (b"{nope", "unreadable"),
    ],
)
def test_no_subnet_is_a_clear_error_on_add_and_status_never_a_guess(
    tmp_path: Path, content: bytes | None, words: str
) -> None:
    path = tmp_path / "subnets.json"
    if content is not None:
        path.write_bytes(content)
    c = parse(conf(path))  # DEL, GC and CHECK still parse: they work from the leases
    assert c.ipam_conf.ranges == ()
    store = MemoryStore()
    with pytest.raises(CniError) as e:
        service.add("net", c.ipam_conf, "c1", "eth0", opener=lambda d, n: store)
    assert e.value.code == TRY_AGAIN_LATER and words in e.value.details
    assert store.leases == {}
    with pytest.raises(CniError) as e:
        service.require_available("net", c.ipam_conf, opener=lambda d, n: store)
    assert e.value.code == PLUGIN_NOT_AVAILABLE and words in e.value.details
    assert service.release("net", c.ipam_conf, "c1", "eth0", opener=lambda d, n: store) == []


def test_node_subnets_must_be_an_absolute_path() -> None:
    with pytest.raises(CniError, match="nodeSubnets"):
        parse(conf(Path("relative/x.json")))
