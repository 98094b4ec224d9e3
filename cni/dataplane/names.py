"""Names and marks that let DEL and GC find what ADD made, without the pod's netns and without a state file.

- host veth name: ``veth`` + 8 hex digits of sha256(container_id, ifname) — the same every time for one attachment;
- host veth alias (IFLA_IFALIAS): ``nodeplug <netkey> <ifname> <container_id> +masq`` (or ``+nomasq``) — marks the
  link as ours, says which network and attachment it serves (for GC and for people reading ``ip link``) and whether
  ADD put masquerade rules in place (so DEL runs ``nft`` only then). A container id too long for the kernel's limit on
  aliases (254 bytes here) is replaced by ``#`` and 32 hex digits of its hash (``#`` never starts a container id);
- pod bridge alias: :data:`BRIDGE_ALIAS` on a bridge ADD created, so that an uninstall never removes a bridge of
  that name that nodeplug did not make;
- nft rule comment: ``nodeplug <host veth> <netkey> <container_id>`` — DEL and GC match on the first three words.

``netkey`` is the network name, or ``#`` + 12 hex digits of its hash when the name is too long to leave room for the
container id in a 127-byte rule comment. Network names (and container ids) never contain spaces, so the words split.
"""

from __future__ import annotations

import re

# SHA-256 from the interpreter's own module (as the standard library's random takes SHA-512): hashlib loads OpenSSL's
# libcrypto, a few milliseconds of every standalone CNI exec. Plain imports, so the CNI bundle's analysis sees them.
# Same digest either way: names made by any version stay findable.
try:
    from _sha2 import sha256 as _sha256  # type: ignore[import-not-found]  # CPython 3.12+
except ImportError:
    try:
        from _sha256 import sha256 as _sha256  # type: ignore[import-not-found]  # CPython 3.11
    except ImportError:
        from hashlib import sha256 as _sha256

ALIAS_PREFIX = "nodeplug "
# The alias of a pod bridge nodeplug created (the uninstall removes only bridges that carry it).
BRIDGE_ALIAS = "nodeplug pod bridge"
_ALIAS_MAX = 254  # bytes: IFALIASZ is 256 with the NUL, and the kernel refuses an alias of 255 bytes (seen on 6.x)
MASQ, NO_MASQ = "+masq", "+nomasq"
_COMMENT_MAX = 127  # NFT_USERDATA_MAXLEN is 256, but nft limits comments to 128 bytes including the NUL

_UNSAFE = re.compile(r"[^A-Za-z0-9_.#\- ]")


def _hexdigest(text: str) -> str:
    return str(_sha256(text.encode()).hexdigest())


def host_veth_name(container_id: str, ifname: str) -> str:
    """The host end's name for one attachment: ``veth`` + 8 hex digits (12 characters, under IFNAMSIZ)."""
    return "veth" + _hexdigest(f"{container_id}\0{ifname}")[:8]


def is_host_veth_name(name: str) -> bool:
    """Whether ``name`` has the shape :func:`host_veth_name` gives (a pod's host end, or one just like it)."""
    return len(name) == 12 and name.startswith("veth") and all(c in "0123456789abcdef" for c in name[4:])


def netkey(network: str) -> str:
    if len(network) <= 48:
        return network
    return "#" + _hexdigest(network)[:12]


def alias(network: str, container_id: str, ifname: str, masq: bool) -> str:
    """The host veth's alias: within the kernel's limit, and different for every attachment."""
    head, flag = f"{ALIAS_PREFIX}{netkey(network)} {ifname} ", MASQ if masq else NO_MASQ
    text = f"{head}{container_id} {flag}"
    if len(text.encode()) > _ALIAS_MAX:
        text = f"{head}#{_hexdigest(container_id)[:32]} {flag}"
    return text


def alias_masq(alias: str) -> bool | None:
    """Whether ADD put masquerade rules in place for the attachment whose host veth has ``alias``; None when the
    alias does not say (one made by an earlier release)."""
    return {MASQ: True, NO_MASQ: False}.get(alias.rsplit(" ", 1)[-1])


def alias_network_prefix(network: str) -> str:
    """Every host veth of ``network`` has an alias starting with this."""
    return f"{ALIAS_PREFIX}{netkey(network)} "


def rule_key(network: str, host_veth: str) -> str:
    """The start of the comment of every masquerade rule of one attachment."""
    return f"{ALIAS_PREFIX}{host_veth} {netkey(network)}"


def rule_comment(network: str, host_veth: str, container_id: str) -> str:
    """The whole comment; anything but letters, digits, ``_.-#`` becomes ``_`` so it is safe inside nft quotes."""
    return _UNSAFE.sub("_", f"{rule_key(network, host_veth)} {container_id}")[:_COMMENT_MAX]


def parse_rule_comment(comment: str) -> tuple[str, str] | None:
    """``(host_veth, netkey)`` of one of our rule comments; None for anybody else's."""
    words = comment.split(" ")
    if len(words) < 3 or words[0] != ALIAS_PREFIX.strip():
        return None
    return words[1], words[2]
