"""Property tests of the Node service's parsers of untrusted request fields: staging and target paths (kubelet's
shapes), mount flags, ids and sizes. Whatever the input, the answer is the value or INVALID_ARGUMENT, never another
exception, and an accepted value has every property the host work relies on."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from csi.errors import InvalidArgument
from csi.model import validate_id
from csi.nodehost import parse_size
from csi.noderequests import (
    BLOCK_STAGING,
    BLOCK_TARGET,
    MOUNT_TARGET,
    STAGING,
    STAGING_SHAPES,
    TARGET_SHAPES,
    checked_flags,
    checked_path,
    shape_of,
)

# Protobuf strings are UTF-8: no lone surrogates reach the driver.
TEXT = st.text(st.characters(blacklist_categories=("Cs",)), max_size=40)
PIECES = st.sampled_from(
    ["pods", "plugins", "kubernetes.io", "csi", "volumeDevices", "staging", "publish", "volumes", "kubernetes.io~csi",
     "uid", "pv", "mount", "globalmount", "..", ".", "", "plugins_registry", "device-plugins", "a b", "x\n"]
)  # fmt: skip
COMPONENT = st.one_of(PIECES, TEXT.filter(lambda s: "/" not in s))

# The shapes again, written another way (regular expressions over the relative path), as the oracle.
ORACLE = {
    STAGING: re.compile(r"plugins/kubernetes\.io/csi/(?!volumeDevices/)[^/]+/[^/]+/[^/]+"),
    BLOCK_STAGING: re.compile(r"plugins/kubernetes\.io/csi/volumeDevices/staging/[^/]+"),
    BLOCK_TARGET: re.compile(r"plugins/kubernetes\.io/csi/volumeDevices/publish/[^/]+/[^/]+"),
    MOUNT_TARGET: re.compile(r"pods/[^/]+/volumes/kubernetes\.io~csi/[^/]+/[^/]+"),
}


def oracle(rel: str) -> str | None:
    found = [shape for shape, rx in ORACLE.items() if rx.fullmatch(rel)]
    assert len(found) <= 1
    return found[0] if found else None


@given(st.lists(COMPONENT.filter(lambda s: s not in ("", ".", "..")), max_size=9))
@example(["plugins", "kubernetes.io", "csi", "volumeDevices", "staging", "pv"])
@example(["pods", "u", "volumes", "kubernetes.io~csi", "pv", "mount"])
def test_shapes_are_kubelets(parts: list[str]) -> None:
    assert shape_of(tuple(parts)) == oracle("/".join(parts))


@pytest.fixture(scope="module")
def kubelet(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("k") / "var" / "lib" / "kubelet"
    (d / "pods").mkdir(parents=True)
    os.symlink(d / "pods", d / "pods-link")  # a symlink inside kubelet's directory that resolves elsewhere in it
    os.symlink("/etc", d / "etc-link")  # and one that leaves it
    return d


@settings(suppress_health_check=[HealthCheck.function_scoped_fixture], max_examples=300)
@given(
    anchor=st.sampled_from(["kubelet", "/", "", "kubelet/pods-link", "kubelet/etc-link"]),
    parts=st.lists(COMPONENT, max_size=9),
    shapes=st.sampled_from([STAGING_SHAPES, TARGET_SHAPES, frozenset({MOUNT_TARGET}), frozenset({BLOCK_TARGET})]),
)
def test_a_path_is_accepted_only_in_a_shape_asked_for_inside_kubelets_directory(
    kubelet: Path, anchor: str, parts: list[str], shapes: frozenset[str]
) -> None:
    value = "/".join([anchor.replace("kubelet", str(kubelet)), *parts])
    try:
        got = checked_path("target_path", value, kubelet, shapes)
    except InvalidArgument as e:
        assert str(e).startswith("target_path: ")
        return
    assert got is not None
    resolved, shape = got
    assert shape in shapes and resolved == Path(os.path.realpath(value))
    assert kubelet in resolved.parents and ".." not in Path(value).parts
    assert shape == oracle(str(resolved.relative_to(kubelet)))


@given(st.lists(TEXT, max_size=5))
@example(["noatime", "X-mount.mode=0777"])
@example(["Users"])
@example(["discard", "helper=nfs"])
def test_mount_flags_are_single_harmless_options_or_refused(flags: list[str]) -> None:
    try:
        got = checked_flags(flags)
    except InvalidArgument as e:
        first_bad = next(i for i, f in enumerate(flags) if _bad(f))
        assert f"mount_flags[{first_bad}]" in str(e)
        return
    assert got == tuple(flags)
    assert not any(_bad(f) for f in flags)


def _bad(flag: str) -> bool:
    """What a flag must not be, said independently of the implementation."""
    name = flag.partition("=")[0].lower()
    return (
        not flag
        or any(c in flag for c in ", \t\n\r\"'\\\0")
        or flag.count("=") > 1
        or not flag[0].isascii()
        or not flag.isascii()
        or not (flag[0].isalnum() or flag[0] == "_")
        or not all(c.isalnum() or c in "_.:+-" for c in flag.partition("=")[0])
        or not all(c.isalnum() or c in "_.:/+@-" for c in flag.partition("=")[2])
        or name in {"bind", "rbind", "remount", "move", "loop", "user", "users", "owner", "group", "nouser"}
        or name in {"helper", "uhelper"}
        or name.startswith(("x-", "make-"))
        or name.removeprefix("r") in {"shared", "slave", "private", "unbindable"}
    )


@given(TEXT)
@example("vol-../..")
@example("a" * 129)
def test_an_accepted_id_is_a_safe_file_name(value: str) -> None:
    try:
        assert validate_id("volume_id", value) == value
    except InvalidArgument as e:
        assert str(e).startswith("volume_id: ")
        return
    assert 0 < len(value) <= 128 and "/" not in value and ".." not in value and "\0" not in value
    assert value.isascii() and value[0].isalnum()


@given(TEXT)
@example("64Mi")
@example(" 1 Gi ")
@example("99999999999999999999Ti")
@example("1" * 5000)  # more digits than int() converts
@example("\u0661Mi")  # a digit, but not an ASCII one
@example("0\xa0")  # a blank, but not an ASCII one
def test_a_size_is_a_number_of_bytes_or_refused(text: str) -> None:
    try:
        n = parse_size(text)
    except InvalidArgument as e:
        assert "volume_context.size" in str(e)
        return
    assert isinstance(n, int) and n >= 0 and text.isascii()
