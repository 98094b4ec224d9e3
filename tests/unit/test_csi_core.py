"""Pure pieces of the CSI core: id validation, sizing rules, operation locks, config validation, error mapping."""

from __future__ import annotations

import grpc
import pytest
from pydantic import ValidationError

from csi.capacity import DEFAULT_BYTES, MIB, expanded_size, volume_size
from csi.config import Config
from csi.errors import Aborted, Internal, InvalidArgument, NotFound, OutOfRange
from csi.grpcerrors import status_of
from csi.locks import OperationLocks
from csi.model import validate_id
from nodeplug.commands import CommandError
from nodeplug.configbase import format_errors


@pytest.mark.parametrize("value", ["vol-0123abcd", "snap-x.y_z", "A1"])
def test_valid_ids(value: str) -> None:
    assert validate_id("volume_id", value) == value


@pytest.mark.parametrize("value", ["", "../etc", "a/b", "a\0b", "a..b", ".hidden", "-x", "x" * 129, "a b"])
def test_invalid_ids_name_the_field(value: str) -> None:
    with pytest.raises(InvalidArgument, match=r"^volume_id: "):
        validate_id("volume_id", value)


def test_volume_size_rules() -> None:
    assert volume_size(0, 0) == DEFAULT_BYTES
    assert volume_size(1, 0) == MIB
    assert volume_size(MIB + 1, 0) == 2 * MIB
    assert volume_size(0, 10 * MIB) == 10 * MIB  # default capped by the limit
    assert volume_size(MIB + 1, MIB + 5000) == MIB + 4096  # no whole MiB fits: whole pages
    assert volume_size(3 * MIB, 0, minimum=300 * MIB) == 300 * MIB
    assert volume_size(MIB, 0, source_size=5 * MIB) == 5 * MIB
    with pytest.raises(OutOfRange, match="at least"):
        volume_size(MIB, 10 * MIB, minimum=300 * MIB)
    with pytest.raises(OutOfRange, match="content source"):
        volume_size(MIB, 2 * MIB, source_size=5 * MIB)
    with pytest.raises(OutOfRange):
        volume_size(MIB + 1, MIB + 100)  # not even a whole page inside the range
    with pytest.raises(InvalidArgument, match="larger than limit_bytes"):
        volume_size(5 * MIB, 2 * MIB)
    with pytest.raises(InvalidArgument, match="required_bytes"):
        volume_size(-1, 0)


def test_expanded_size_rules() -> None:
    assert expanded_size(10 * MIB, 20 * MIB, 0) == 20 * MIB
    assert expanded_size(10 * MIB, 5 * MIB, 0) == 10 * MIB  # never shrinks
    with pytest.raises(InvalidArgument, match="required_bytes"):
        expanded_size(10 * MIB, 0, 0)
    with pytest.raises(InvalidArgument):
        expanded_size(10 * MIB, 20 * MIB, 10 * MIB)


def test_locks_abort_second_holder_and_release() -> None:
    locks = OperationLocks()
    with locks.hold("volume/a", "name/n"):
        assert locks.busy("volume/a")
        with pytest.raises(Aborted, match="volume/a"), locks.hold("volume/a"):
            pass
        with pytest.raises(Aborted, match="name/n"), locks.hold("volume/b", "name/n"):
            pass
        assert not locks.busy("volume/b")  # a refused hold takes nothing
        with locks.hold("volume/b"):
            pass
    assert not locks.busy("volume/a")
    with pytest.raises(RuntimeError), locks.hold("volume/a"):
        raise RuntimeError("boom")
    assert not locks.busy("volume/a")


def test_status_mapping() -> None:
    assert status_of(NotFound("x")) == (grpc.StatusCode.NOT_FOUND, "x")
    err = CommandError(["mkfs.ext4", "/f"], "exited with status 1", 1, "bad magic")
    code, msg = status_of(Internal.from_command(err, "formatting"))
    assert code == grpc.StatusCode.INTERNAL and "mkfs.ext4" in msg and "bad magic" in msg
    assert status_of(ValueError("v"))[0] == grpc.StatusCode.INTERNAL


def test_config_defaults_and_errors() -> None:
    c = Config()
    assert c.driver_name == "local.csi.nodeplug.io" and c.data_dir == "/var/lib/nodeplug/csi"
    assert c.default_fs_type == "ext4" and not c.btrfs.enabled
    with pytest.raises(ValidationError) as e:
        Config.model_validate({"btrfs": {"enabled": True}, "data_dir": "rel", "default_fs_type": "zfs"})
    text = "\n".join(format_errors(e.value, "csi"))
    assert "csi.data_dir: expected an absolute directory path" in text
    assert "csi.default_fs_type" in text
    assert "csi.btrfs: path: expected the mount point" in text
    with pytest.raises(ValidationError, match=r"btrfs\.enabled"):
        Config(default_backend="btrfs")
