"""CNI spec versions: negotiation and result conversion, in one place.

nodeplug speaks 0.3.0, 0.3.1, 0.4.0, 1.0.0 and 1.1.0. Results are held in the 1.x shape (:class:`cni.types.Result`)
and converted only here, when they are written for the config's ``cniVersion``:

- 1.1.0: everything (interface ``mtu``/``socketPath``/``pciID``; route ``mtu``/``advmss``/``priority``/``table``/
  ``scope``);
- 1.0.0: interfaces name/mac/sandbox; routes dst/gw; no ``ips[].version``;
- 0.3.0, 0.3.1, 0.4.0: as 1.0.0 plus ``ips[].version`` ("4" or "6").

Commands have a minimum version: CHECK needs 0.4.0, GC and STATUS need 1.1.0 (code 1 otherwise, as the Go skel).

VERSION has one answer, :func:`version_answer`, whatever the caller's config says (as the Go skel and the reference
plugins answer it): the latest version we speak and all of them. The bundle's launcher prints the very same bytes
(its C copy is generated from this module by :mod:`cni.launcher.protocol`).

Standard library only: this is on the entry point's start-up path.
"""

from __future__ import annotations

from cni.errors import INCOMPATIBLE_VERSION, CniError

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (start-up path: every import costs)
if TYPE_CHECKING:
    from typing import Any

SUPPORTED = ("0.3.0", "0.3.1", "0.4.0", "1.0.0", "1.1.0")
LATEST = "1.1.0"

_MIN_FOR_COMMAND = {"CHECK": "0.4.0", "GC": "1.1.0", "STATUS": "1.1.0"}


def parse_version(v: str) -> tuple[int, int, int]:
    """``"1.0.0"`` -> (1, 0, 0); raise code 1 for anything that is not three dot-separated numbers."""
    parts = v.split(".")
    if len(parts) != 3 or not all(p.isdigit() for p in parts):
        raise CniError(INCOMPATIBLE_VERSION, details=f'cniVersion: expected a version like "1.1.0", got {v!r}')
    return int(parts[0]), int(parts[1]), int(parts[2])


def check_supported(version: str, command: str = "") -> None:
    """Code 1 unless ``version`` is one we speak and allows ``command``."""
    if version not in SUPPORTED:
        parse_version(version)  # a malformed version is reported as such
        raise CniError(
            INCOMPATIBLE_VERSION,
            details=f"cniVersion {version!r} is not supported; nodeplug supports {', '.join(SUPPORTED)}",
        )
    need = _MIN_FOR_COMMAND.get(command)
    if need is not None and parse_version(version) < parse_version(need):
        raise CniError(
            INCOMPATIBLE_VERSION,
            details=f"config version {version} does not allow {command} (it needs cniVersion {need} or later)",
        )


def config_version(config: Any) -> str:
    """A decoded config's ``cniVersion`` when we speak it, else :data:`LATEST` (also for a config that is not an
    object): the version errors are written in."""
    v = config.get("cniVersion") if isinstance(config, dict) else None
    return v if v in SUPPORTED else LATEST


def stdin_version(stdin: bytes) -> str:
    """Best effort, for an error JSON: the ``cniVersion`` of the config on stdin (:func:`config_version`), the latest
    when stdin is empty or not JSON."""
    from cni import strictjson

    try:
        conf = strictjson.loads(stdin)
    except ValueError:  # a decode error, UnicodeDecodeError, deep nesting
        return LATEST
    return config_version(conf)


def version_info() -> dict[str, Any]:
    """The VERSION answer as a dict: the latest version and every version we support."""
    return {"cniVersion": LATEST, "supportedVersions": list(SUPPORTED)}


def version_answer() -> str:
    """The VERSION answer as printed: ``json.dumps(version_info())``, built without importing json (the versions are
    plain ASCII constants; a test checks the two agree)."""
    listed = ", ".join(f'"{v}"' for v in SUPPORTED)
    return f'{{"cniVersion": "{LATEST}", "supportedVersions": [{listed}]}}'


_IFACE_1_1_ONLY = ("mtu", "socketPath", "pciID")
_ROUTE_1_1_ONLY = ("mtu", "advmss", "priority", "table", "scope")


def convert_result(result: dict[str, Any], version: str) -> dict[str, Any]:
    """A 1.1.0-shaped result dict (``Result.to_dict()``) -> the shape of ``version`` (code 1 if unsupported)."""
    check_supported(version)
    out: dict[str, Any] = {**result, "cniVersion": version}
    if version == "1.1.0":
        return out
    if "interfaces" in out:
        out["interfaces"] = [{k: v for k, v in i.items() if k not in _IFACE_1_1_ONLY} for i in out["interfaces"]]
    if "routes" in out:
        out["routes"] = [{k: v for k, v in r.items() if k not in _ROUTE_1_1_ONLY} for r in out["routes"]]
    if version.startswith("0.") and "ips" in out:
        out["ips"] = [{"version": "6" if ":" in ip["address"] else "4", **ip} for ip in out["ips"]]
    return out
