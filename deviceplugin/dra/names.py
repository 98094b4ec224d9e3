"""Kubernetes names as DRA uses them, checked before anything is done with them. Pure.

Everything here is applied to fields kubelet or the API server sent, so each check is strict and each refusal says
which field and why: a claim's namespace (DNS label), name (DNS subdomain) and UID (the API server's UUIDs), and a
device or pool name of a ResourceSlice (DNS label / DNS subdomain path).

:func:`device_name` maps a discovered device to its name in this node's pool: ``<resource>-<id>`` made a DNS label
(``fuse-fuse``, ``vfio-nic-0000-3b-00-0``), with a short hash of the original ID added whenever the plain form would
be too long or ambiguous, so two devices never share a name.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable

_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")
_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_UID = re.compile(r"^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$")
_C_IDENTIFIER = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


class NameError_(ValueError):
    """A name that is not acceptable; the message names the field."""


def _show(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def is_dns_label(v: str) -> bool:
    return bool(_DNS_LABEL.match(v))


def is_dns_subdomain(v: str) -> bool:
    return len(v) <= 253 and bool(_DNS_SUBDOMAIN.match(v))


def _checked(v: object, field: str, ok: Callable[[str], bool], expected: str) -> str:
    """``v`` when it is a string that ``ok`` accepts; else NameError_ naming ``field`` and what was expected."""
    if not isinstance(v, str) or not ok(v):
        raise NameError_(f"{field}: expected {expected}, got {_show(v)}")
    return v


def _is_pool(v: str) -> bool:
    return bool(v) and len(v) <= 253 and all(is_dns_subdomain(p) for p in v.split("/"))


def _is_request(v: str) -> bool:
    return bool(v) and v.count("/") <= 1 and all(is_dns_label(p) for p in v.split("/"))


def check_namespace(v: object, field: str = "namespace") -> str:
    return _checked(v, field, is_dns_label, "a namespace (a DNS label)")


def check_name(v: object, field: str = "name") -> str:
    return _checked(v, field, is_dns_subdomain, "an object name (a DNS subdomain)")


def check_uid(v: object, field: str = "uid") -> str:
    return _checked(v, field, lambda s: bool(_UID.match(s)), "a UID (a lower-case UUID)")


def check_device(v: object, field: str = "device") -> str:
    return _checked(v, field, is_dns_label, "a device name (a DNS label)")


def check_pool(v: object, field: str = "pool") -> str:
    """A pool name: one or more DNS subdomains joined by ``/``, at most 253 characters."""
    return _checked(v, field, _is_pool, "a pool name (DNS subdomains joined by '/')")


def check_request(v: object, field: str = "request") -> str:
    """A request name of a claim (a DNS label; ``<request>/<subrequest>`` in newer API versions)."""
    return _checked(v, field, _is_request, "a request name (a DNS label)")


def is_c_identifier(v: str) -> bool:
    return len(v) <= 32 and bool(_C_IDENTIFIER.match(v))


def _hash(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:8]


def _plain(resource: str, dev_id: str) -> str:
    s = re.sub(r"[^a-z0-9]+", "-", f"{resource}-{dev_id}".lower()).strip("-")
    return s


def device_names(devices: list[tuple[str, str]]) -> dict[tuple[str, str], str]:
    """Names in the pool for ``(resource, device id)`` pairs: the plain form where it is a DNS label no other pair
    shares, else the plain form cut short plus a hash of the pair."""
    plain = {d: _plain(*d) for d in devices}
    counts: dict[str, int] = {}
    for p in plain.values():
        counts[p] = counts.get(p, 0) + 1
    out: dict[tuple[str, str], str] = {}
    for d, p in plain.items():
        if p and len(p) <= 63 and counts[p] == 1 and is_dns_label(p):
            out[d] = p
        else:
            out[d] = (p[:54].strip("-") + "-" + _hash("\x00".join(d))).strip("-")
    return out
