"""``nodeplug install-cni`` on a temporary host root: atomic, idempotent, reversible, and hands off others' files.

The bundle here is a stand-in (a shell script answering VERSION plus a few files): these tests are about what the
installer does to the host's directories. tests/node/test_installcni_chroot.py runs the real bundle.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from cni.install import bundle as installed_bundle
from cni.install import conflist as conflists
from cni.install.errors import InputError
from nodeplug import cli

from support.cnihost import VERSION_REPLY, cni_host


def make_bundle(path: Path, marker: str = "1", works: bool = True) -> Path:
    (path / "_internal" / "lib").mkdir(parents=True)
    reply = VERSION_REPLY if works else '{"code":999}'
    launcher = path / "nodeplug"
    launcher.write_text(f"#!/bin/sh\n# build {marker}\necho '{reply}'\n{'' if works else 'exit 1'}\n")
    launcher.chmod(0o755)
    (path / "_internal" / "lib" / "libx.so").write_bytes(b"\x7fELF" + marker.encode() * 100)
    (path / "_internal" / "data.txt").write_text(marker)
    os.symlink("data.txt", path / "_internal" / "alias.txt")
    (path / "BUNDLE.json").write_text(json.dumps({"marker": marker}))
    return path


def cni(root: Path, *args: str) -> int:
    return cli.main(["install-cni", "--root", str(root), *args])


@pytest.fixture
def bundle(tmp_path: Path) -> Path:
    return make_bundle(tmp_path / "bundle")


@pytest.fixture
def host(tmp_path: Path) -> Path:
    return cni_host(tmp_path / "host")


def link(host: Path) -> Path:
    return host / "opt/cni/bin/nodeplug"


def conflist(host: Path) -> Path:
    return host / "etc/cni/net.d" / conflists.DEFAULT_CONFLIST


def snapshot(root: Path) -> dict[str, tuple[int, int, str]]:
    """Every entry under root: (inode, mtime_ns, symlink target or '')."""
    out = {}
    for p in sorted(root.rglob("*")):
        st = p.lstat()
        out[str(p.relative_to(root))] = (st.st_ino, st.st_mtime_ns, os.readlink(p) if p.is_symlink() else "")
    return out


def version_via(path: Path) -> dict[str, object]:
    p = subprocess.run(
        [str(path)], env={"CNI_COMMAND": "VERSION"}, input=b"{}", capture_output=True, timeout=10, check=True
    )
    reply: dict[str, object] = json.loads(p.stdout)
    return reply


def test_install_puts_the_bundle_behind_a_symlink_and_writes_the_conflist(host: Path, bundle: Path) -> None:
    assert cni(host, "--bundle", str(bundle)) == 0
    target = os.readlink(link(host))
    bid = installed_bundle.bundle_id(bundle)
    assert target == f"nodeplug.d/{bid}/nodeplug"
    installed = host / "opt/cni/bin/nodeplug.d" / bid
    assert installed_bundle.bundle_id(installed) == bid
    assert os.readlink(installed / "_internal/alias.txt") == "data.txt"
    assert os.access(installed / "nodeplug", os.X_OK) and not os.access(installed / "_internal/data.txt", os.X_OK)
    assert "1.0.0" in version_via(link(host))["supportedVersions"]  # type: ignore[operator]
    conf = json.loads(conflist(host).read_text())
    assert conf["name"] == "nodeplug" and conf["plugins"][0]["type"] == "nodeplug"
    assert conf["plugins"][0]["ipam"] == {"type": "nodeplug", "ranges": [[{"subnet": conflists.DEFAULT_SUBNET}]]}
    assert not [p for p in host.rglob("*") if ".tmp" in p.name]


def test_a_second_install_changes_nothing(host: Path, bundle: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cni(host, "--bundle", str(bundle)) == 0
    before = snapshot(host)
    assert cni(host, "--bundle", str(bundle)) == 0
    assert snapshot(host) == before
    out = capsys.readouterr().out.splitlines()
    assert out[-2].startswith("unchanged ") and out[-1].startswith("unchanged ")


def test_an_upgrade_switches_the_link_and_keeps_only_the_previous_build(host: Path, tmp_path: Path) -> None:
    b1, b2, b3 = (make_bundle(tmp_path / f"b{i}", str(i)) for i in (1, 2, 3))
    ids = [installed_bundle.bundle_id(b) for b in (b1, b2, b3)]
    assert len(set(ids)) == 3
    builds = host / "opt/cni/bin/nodeplug.d"
    assert cni(host, "--bundle", str(b1)) == 0
    assert cni(host, "--bundle", str(b2)) == 0
    assert os.readlink(link(host)) == f"nodeplug.d/{ids[1]}/nodeplug"
    record = ["agent-socket"]  # the conflist's agent socket, for the launcher (it reads no JSON)
    assert sorted(p.name for p in builds.iterdir()) == sorted(ids[:2] + record)  # still running from b1: kept
    assert cni(host, "--bundle", str(b3)) == 0
    assert sorted(p.name for p in builds.iterdir()) == sorted(ids[1:] + record)


def test_a_bundle_that_does_not_answer_version_is_never_linked(host: Path, bundle: Path, tmp_path: Path) -> None:
    assert cni(host, "--bundle", str(bundle)) == 0
    good = os.readlink(link(host))
    broken = make_bundle(tmp_path / "broken", "2", works=False)
    assert cni(host, "--bundle", str(broken)) == 1
    assert os.readlink(link(host)) == good
    assert "1.0.0" in version_via(link(host))["supportedVersions"]  # type: ignore[operator]


def test_a_damaged_installed_build_is_repaired(host: Path, bundle: Path) -> None:
    assert cni(host, "--bundle", str(bundle)) == 0
    installed = host / "opt/cni/bin/nodeplug.d" / installed_bundle.bundle_id(bundle)
    (installed / "_internal/data.txt").write_text("changed by hand")
    assert cni(host, "--bundle", str(bundle)) == 0
    assert installed_bundle.bundle_id(installed) == installed_bundle.bundle_id(bundle)
    assert not [p for p in host.rglob("*") if ".tmp-" in p.name]


def test_leftovers_of_a_crash_are_cleaned_up(host: Path, bundle: Path) -> None:
    builds = host / "opt/cni/bin/nodeplug.d"
    builds.mkdir()
    (builds / f".tmp-{installed_bundle.bundle_id(bundle)}-99999").mkdir()
    (builds / ".tmp-x-1" / "half").mkdir(parents=True)
    os.symlink("nodeplug.d/x/nodeplug", host / "opt/cni/bin/.nodeplug.tmp-99999")
    (host / "etc/cni/net.d/.10-nodeplug.conflist.tmp-99999").write_text("{")
    (builds / ".agent-socket.x1y2.tmp").write_text("/run/nod")
    assert cni(host, "--bundle", str(bundle)) == 0
    assert sorted(p.name for p in builds.iterdir()) == sorted([installed_bundle.bundle_id(bundle), "agent-socket"])
    assert (builds / "agent-socket").read_text() == "/run/nodeplug/cni.sock\n"
    assert not [p for p in host.rglob("*") if ".tmp-" in p.name]
    assert "1.0.0" in version_via(link(host))["supportedVersions"]  # type: ignore[operator]


def test_files_of_others_are_left_alone_unless_forced(host: Path, bundle: Path) -> None:
    theirs = {"cniVersion": "1.0.0", "name": "other", "plugins": [{"type": "bridge"}]}
    conflist(host).write_text(json.dumps(theirs))
    neighbour = host / "etc/cni/net.d/05-other.conflist"
    neighbour.write_text("{}")
    assert cni(host, "--bundle", str(bundle)) == 1
    assert json.loads(conflist(host).read_text()) == theirs
    assert cni(host, "--bundle", str(bundle), "--force") == 0
    assert json.loads(conflist(host).read_text())["plugins"][0]["type"] == "nodeplug"
    assert neighbour.read_text() == "{}"
    # A plain file named nodeplug (not our symlink) is not ours either.
    other_host = host.parent / "host2"
    (other_host / "opt/cni/bin").mkdir(parents=True)
    link(other_host).write_text("#!/bin/sh\n")
    assert cni(other_host, "--bundle", str(bundle), "--skip-conflist") == 1
    assert link(other_host).read_text() == "#!/bin/sh\n"
    assert cni(other_host, "--bundle", str(bundle), "--skip-conflist", "--force") == 0
    assert link(other_host).is_symlink()


def test_uninstall_removes_exactly_what_install_wrote(host: Path, bundle: Path) -> None:
    (host / "opt/cni/bin/bridge").write_text("reference plugin")
    (host / "etc/cni/net.d/05-other.conflist").write_text("{}")
    before = {p for p in snapshot(host)}
    assert cni(host, "--bundle", str(bundle)) == 0
    assert cni(host, "--uninstall") == 0
    assert {p for p in snapshot(host)} == before
    assert cni(host, "--uninstall") == 0  # nothing left to remove: still fine


def test_uninstall_leaves_a_conflist_that_is_no_longer_ours(host: Path, bundle: Path) -> None:
    assert cni(host, "--bundle", str(bundle)) == 0
    conflist(host).write_text(json.dumps({"cniVersion": "1.0.0", "name": "x", "plugins": [{"type": "bridge"}]}))
    assert cni(host, "--uninstall") == 0
    assert conflist(host).exists() and not link(host).exists()


def test_bad_input_is_refused_before_the_host_is_touched(
    host: Path, bundle: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    before = snapshot(host)
    bad = tmp_path / "bad.conflist"
    bad.write_text(json.dumps({"cniVersion": "1.0.0", "name": "n", "plugins": [{"type": "nodeplug", "mtu": "big"}]}))
    assert cni(host, "--bundle", str(bundle), "--conflist-file", str(bad)) == 2
    assert "plugins[0]" in capsys.readouterr().err
    bad.write_text("{not json")
    assert cni(host, "--bundle", str(bundle), "--conflist-file", str(bad)) == 2
    assert cni(host, "--bundle", str(bundle), "--conflist-name", "../escape.conflist") == 2
    assert cni(host, "--bundle", str(tmp_path / "no-bundle")) == 1
    assert "not a CNI bundle" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        cni(host, "--bundle", str(bundle), "--subnet", "10.0.0.1/8")
    assert e.value.code == 2
    assert snapshot(host) == before


def test_a_given_conflist_is_installed_as_written(host: Path, bundle: Path, tmp_path: Path) -> None:
    chained = {
        "cniVersion": "1.0.0",
        "name": "pods",
        "plugins": [
            {"type": "nodeplug", "bridge": "pods0", "ipam": {"type": "nodeplug", "subnet": "10.77.0.0/24"}},
            {"type": "portmap", "capabilities": {"portMappings": True}},
        ],
    }
    src = tmp_path / "pods.conflist"
    src.write_text(json.dumps(chained))
    assert cni(host, "--bundle", str(bundle), "--conflist-file", str(src), "--conflist-name", "20-pods.conflist") == 0
    assert json.loads((host / "etc/cni/net.d/20-pods.conflist").read_text()) == chained


def test_generated_conflists_parse_as_the_entry_point_parses_them() -> None:
    parser = cli.build_parser()
    args = parser.parse_args(
        ["install-cni", "--subnet", "10.60.0.0/16", "--subnet", "fd60::/64", "--mtu", "1400", "--no-ip-masq"]
    )
    conf = conflists.generate_conflist(args)
    conflists.check_conflist(conf, "generated")
    plugin = conf["plugins"][0]
    assert plugin["ipam"]["ranges"] == [[{"subnet": "10.60.0.0/16"}], [{"subnet": "fd60::/64"}]]
    assert plugin["mtu"] == 1400 and plugin["ipMasq"] is False
    with pytest.raises(InputError, match="bridge"):
        conflists.check_conflist({**conf, "plugins": [{**plugin, "bridge": "x" * 16}]}, "generated")
