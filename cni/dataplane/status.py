"""STATUS: can an ADD work on this node right now?

Code 50 (plugin not available) when it cannot: no CAP_NET_ADMIN, no netlink socket, a non-bridge link squatting the
bridge name (bridge datapath), or ``ipMasq`` set while ``nft`` is not installed.
"""

from __future__ import annotations

from cni.dataplane.nl import get_link, host_socket, link_kind
from cni.errors import PLUGIN_NOT_AVAILABLE, CniError
from cni.netconf import BridgeConf

_CAP_NET_ADMIN = 12


def status(conf: BridgeConf) -> None:
    """Raise CniError(50) naming what stops ADD from working."""
    if not _has_cap(_CAP_NET_ADMIN):
        raise CniError(PLUGIN_NOT_AVAILABLE, details="no CAP_NET_ADMIN: cannot create links (run as root)")
    try:
        with host_socket() as nl:
            br = None if conf.routed else get_link(nl, conf.bridge)
    except CniError as e:
        raise CniError(PLUGIN_NOT_AVAILABLE, details=e.details) from None
    if br is not None and link_kind(br) != "bridge":
        raise CniError(
            PLUGIN_NOT_AVAILABLE,
            details=f"bridge {conf.bridge}: a link of that name exists but is a {link_kind(br) or 'non-bridge'} device",
        )
    import shutil  # STATUS only: shutil (with bz2, lzma, zlib) would otherwise load on every standalone ADD and DEL

    if conf.ip_masq and shutil.which("nft") is None:
        raise CniError(PLUGIN_NOT_AVAILABLE, details="ipMasq is set but nft is not installed (Debian package nftables)")


def _has_cap(bit: int) -> bool:
    try:
        with open("/proc/thread-self/status") as f:
            for line in f:
                if line.startswith("CapEff:"):
                    return bool(int(line.split()[1], 16) >> bit & 1)
    except OSError:
        pass
    return False
