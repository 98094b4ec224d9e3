"""Sizing rules: from a CSI capacity range (and a content source) to the size a volume gets.

Sizes are whole MiB, or whole 4 KiB pages when a narrow range holds no whole MiB (loop devices, ext4/xfs and qgroup
limits are all happy with that). A volume gets the smallest size that satisfies ``required_bytes``, the
filesystem's minimum and its content source, and must not exceed ``limit_bytes``; when no size is asked for it gets
:data:`DEFAULT_BYTES` (capped by the limit). A range that cannot be met is OUT_OF_RANGE, as the CSI spec's error
table for CreateVolume and ControllerExpandVolume says.
"""

from __future__ import annotations

from dataclasses import dataclass

from csi.errors import InvalidArgument, OutOfRange

MIB = 1 << 20
GIB = 1 << 30
DEFAULT_BYTES = 1 * GIB
UNIT = MIB
PAGE = 4096


@dataclass(frozen=True)
class CapacityRange:
    """CSI capacity range in bytes; 0 means unset."""

    required_bytes: int = 0
    limit_bytes: int = 0


def round_up(n: int, unit: int = UNIT) -> int:
    return -(-n // unit) * unit


def round_down(n: int, unit: int = UNIT) -> int:
    return n // unit * unit


def check_range(required: int, limit: int, field: str = "capacity_range") -> None:
    if required < 0:
        raise InvalidArgument(f"{field}.required_bytes: expected a value >= 0, got {required}")
    if limit < 0:
        raise InvalidArgument(f"{field}.limit_bytes: expected a value >= 0, got {limit}")
    if limit and required > limit:
        raise InvalidArgument(f"{field}: required_bytes {required} is larger than limit_bytes {limit}")


def volume_size(required: int, limit: int, minimum: int = UNIT, source_size: int = 0) -> int:
    """The size of a new volume for the range [required, limit] (0 = unset); OutOfRange when none fits."""
    check_range(required, limit)
    floor = max(required, minimum, source_size)
    size = round_up(floor) if required or source_size else round_up(max(DEFAULT_BYTES, floor))
    if limit and size > limit:
        # the default or the rounding overshoots: the largest whole MiB under the limit, else whole 4 KiB pages
        size = round_down(limit)
        if size < floor:
            size = round_up(floor, PAGE)
        if size > limit or size < floor:
            raise OutOfRange(_why(required, limit, minimum, source_size))
    return size


def _why(required: int, limit: int, minimum: int, source_size: int) -> str:
    parts = [f"capacity_range [{required}, {limit}] cannot be met"]
    if minimum > UNIT:
        parts.append(f"the filesystem needs at least {minimum} bytes")
    if source_size:
        parts.append(f"the content source holds {source_size} bytes")
    return "; ".join(parts)


def expanded_size(current: int, required: int, limit: int) -> int:
    """The size after expansion to [required, limit]: never smaller than ``current``."""
    if required <= 0:
        raise InvalidArgument("capacity_range.required_bytes: required field is missing")
    check_range(required, limit)
    size = round_up(required)
    if limit and size > limit:
        size = round_down(limit)
        if size < required:
            size = round_up(required, PAGE)
        if size > limit:
            raise OutOfRange(f"capacity_range [{required}, {limit}] cannot be met in whole 4 KiB pages")
    return max(size, current)
