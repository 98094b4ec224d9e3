"""Transmit checksum offload of the VXLAN device, through the ethtool ioctl (``ETHTOOL_GTXCSUM``/``STXCSUM``).

A VXLAN device hands the inner packet's checksum to whatever comes after it (``tx-checksum-ip-generic``), the
underlay NIC or the kernel's own fallback. On some NICs and kernels (vmxnet3 and other virtual NICs; outer headers
rewritten by NAT on the way) that checksum arrives wrong and the receiver drops the packet: pods reach each other
over VXLAN only partly, or not at all, while ping works. It is the most common complaint about VXLAN pod networks;
flannel documents turning the offload off (``ethtool -K flannel.1 tx-checksum-ip-generic off``) and kops does so
for every flannel node.

What to do about it is a trade: with the offload off the kernel checksums every inner packet before encapsulation,
and the VXLAN device loses segmentation offload with it, so each pod packet is encapsulated one MTU at a time.
Measured on namespace nodes here (``scripts/bench-cluster-network``), pod -> pod over VXLAN fell from 11.8 to 2.1
Gbit/s and its CPU per Gbit rose fivefold. So nodeplug follows Calico (felix, since 2021): ``auto`` (the default of
``cluster_network.vxlan.tx_checksum_offload``) turns it off on kernels older than 5.7, whose UDP checksum handling
of NAT'ed tunnel packets is the bug behind most reports, and leaves the kernel's default (on) elsewhere; ``false``
turns it off everywhere (a NIC that mangles offloaded checksums on any kernel), ``true`` leaves it on everywhere.
The setting is compared with the device's on every pass and set again when someone changed it.
``ETHTOOL_STXCSUM`` turns every transmit checksum feature of the device on or off together, as ``ethtool -K DEV tx
on|off`` does.
"""

from __future__ import annotations

import ctypes
import fcntl
import os
import socket
import struct

SIOCETHTOOL = 0x8946
ETHTOOL_GTXCSUM = 0x16
ETHTOOL_STXCSUM = 0x17
_VALUE = struct.Struct("=II")  # struct ethtool_value: cmd, data
_IFREQ_SIZE = 40  # struct ifreq: the name (IFNAMSIZ) and a union of 24 bytes holding ifr_data


class OffloadError(Exception):
    """The kernel refused to read or change the device's offload setting."""


def _ethtool(name: str, cmd: int, data: int = 0) -> int:
    buf = ctypes.create_string_buffer(_VALUE.pack(cmd, data), _VALUE.size)
    ifreq = struct.pack("16sP", name.encode(), ctypes.addressof(buf)).ljust(_IFREQ_SIZE, b"\0")
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as s:  # the thread's netns
        try:
            fcntl.ioctl(s.fileno(), SIOCETHTOOL, ifreq)
        except OSError as e:
            what = "read" if cmd == ETHTOOL_GTXCSUM else "set"
            raise OffloadError(f"{what} tx checksum offload of {name}: {os.strerror(e.errno or 0)}") from None
    return int(_VALUE.unpack(buf.raw)[1])


FIXED_IN = (5, 7)  # the first kernel whose VXLAN checksum offload survives NAT of the outer headers (Calico's rule)


def wanted(setting: bool | str, release: str | None = None) -> bool:
    """Whether the offload should be on: ``setting`` true/false as it says; ``"auto"``: on from kernel 5.7
    (``release`` as ``uname -r`` prints it, default this kernel's; one that cannot be read counts as older)."""
    if isinstance(setting, bool):
        return setting
    release = os.uname().release if release is None else release
    try:
        major, minor = (int(part) for part in release.split("-", 1)[0].split(".")[:2])
    except ValueError:
        return False
    return (major, minor) >= FIXED_IN


def tx_checksum(name: str) -> bool:
    """Whether link ``name`` offloads transmit checksums."""
    return bool(_ethtool(name, ETHTOOL_GTXCSUM))


def ensure_tx_checksum(name: str, on: bool) -> bool:
    """Turn transmit checksum offload of ``name`` on or off unless it already is; True when it changed."""
    if tx_checksum(name) == on:
        return False
    _ethtool(name, ETHTOOL_STXCSUM, int(on))
    return True
