"""``nodeplug install-cni`` for the cluster network: the conflist with node subnets, and the reference plugins
(loopback, portmap) put where the host lacks them, never over the host's own."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cni import nodesubnets
from cni.install import conflist, refplugins
from nodeplug import cli

from support.cnihost import VERSION_REPLY, cni_host


@pytest.fixture
def bundle(tmp_path: Path) -> Path:
    b = tmp_path / "bundle"
    b.mkdir()
    (b / "nodeplug").write_text(f"#!/bin/sh\necho '{VERSION_REPLY}'\n")
    (b / "nodeplug").chmod(0o755)
    return b


@pytest.fixture
def refs(tmp_path: Path) -> Path:
    d = tmp_path / "usr-lib-cni"
    d.mkdir()
    for name in ("loopback", "portmap", "bridge"):
        (d / name).write_bytes(b"\x7fELF " + name.encode())
    return d


@pytest.fixture
def host(tmp_path: Path) -> Path:
    return cni_host(tmp_path / "host")


def install(host: Path, bundle: Path, refs: Path, *args: str) -> int:
    return cli.main(
        ["install-cni", "--root", str(host), "--bundle", str(bundle), "--reference-plugins", str(refs), *args]
    )


def test_missing_reference_plugins_are_installed_then_removed_by_uninstall(
    host: Path, bundle: Path, refs: Path
) -> None:
    assert install(host, bundle, refs) == 0
    bin_dir = host / "opt/cni/bin"
    assert (bin_dir / "loopback").read_bytes() == b"\x7fELF loopback" and (bin_dir / "loopback").stat().st_mode & 0o111
    assert (bin_dir / "portmap").exists() and not (bin_dir / "bridge").exists()
    (refs / "loopback").write_bytes(b"\x7fELF loopback v2")  # a new image: our copy is updated
    assert install(host, bundle, refs) == 0
    assert (bin_dir / "loopback").read_bytes() == b"\x7fELF loopback v2"
    assert cli.main(["install-cni", "--root", str(host), "--uninstall"]) == 0
    assert sorted(p.name for p in bin_dir.iterdir()) == []


def test_a_copy_cut_short_by_a_crash_is_cleaned_up_by_the_next_run(host: Path, bundle: Path, refs: Path) -> None:
    from nodeplug.fsutil import write_atomic

    bin_dir = host / "opt/cni/bin"
    bin_dir.mkdir(parents=True, exist_ok=True)

    def crash(path: Path, data: bytes, mode: int = 0o644) -> None:  # the temp file is written, then the power goes
        (path.parent / f".{path.name}.x1y2z3.tmp").write_bytes(data[:4])
        raise KeyboardInterrupt

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(refplugins, "write_atomic", crash)
        with pytest.raises(KeyboardInterrupt):
            install(host, bundle, refs)
    assert [p.name for p in bin_dir.glob(".loopback.*")] == [".loopback.x1y2z3.tmp"]
    assert refplugins.write_atomic is write_atomic and install(host, bundle, refs) == 0
    assert sorted(p.name for p in bin_dir.iterdir() if p.name.startswith(".")) == [refplugins.RECORD]
    assert (bin_dir / "loopback").read_bytes() == b"\x7fELF loopback"


def test_the_hosts_own_plugins_are_never_overwritten_or_removed(host: Path, bundle: Path, refs: Path) -> None:
    bin_dir = host / "opt/cni/bin"
    (bin_dir / "loopback").write_bytes(b"host loopback")
    assert install(host, bundle, refs) == 0
    assert (bin_dir / "loopback").read_bytes() == b"host loopback" and (bin_dir / "portmap").exists()
    (bin_dir / "portmap").write_bytes(b"host replaced portmap later")  # the host's from now on
    assert install(host, bundle, refs) == 0
    assert (bin_dir / "portmap").read_bytes() == b"host replaced portmap later"
    assert cli.main(["install-cni", "--root", str(host), "--uninstall"]) == 0
    assert (bin_dir / "loopback").read_bytes() == b"host loopback"
    assert (bin_dir / "portmap").read_bytes() == b"host replaced portmap later"


def test_without_a_source_nothing_is_copied(host: Path, bundle: Path, tmp_path: Path) -> None:
    assert install(host, bundle, tmp_path / "none") == 0
    assert not (host / "opt/cni/bin/loopback").exists()
    assert refplugins.uninstall(host / "opt/cni/bin", tmp_path / "no-record", print) is False


def test_cluster_network_conflist_takes_ranges_from_the_node_and_leaves_masquerade_to_the_agent(
    host: Path, bundle: Path, refs: Path
) -> None:
    assert install(host, bundle, refs, "--cluster-network", "--portmap") == 0
    conf = json.loads((host / "etc/cni/net.d" / conflist.DEFAULT_CONFLIST).read_text())
    plugin, portmap = conf["plugins"]
    assert plugin["ipam"] == {"type": "nodeplug", "nodeSubnets": nodesubnets.DEFAULT_PATH}
    assert plugin["ipMasq"] is False and "mtu" not in plugin  # the MTU comes with the node's subnets
    assert portmap == {"type": "portmap", "capabilities": {"portMappings": True}}
    assert install(host, bundle, refs, "--cluster-network", "--subnet", "10.1.0.0/16") == 2
