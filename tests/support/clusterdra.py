"""The DRA driver on the local cluster, for the cluster tier's tests (a pytest plugin, registered in
tests/conftest.py).

DRA is on as shipped (``deviceplugin.dra.enabled: auto`` on a cluster that has it; fuse and tun offered both ways).
:func:`dratest_resource` adds, for a test module, a resource of device nodes made by the tests, the way an operator
adds one: the agent's ConfigMap gets a resource ``dratest`` offered through DRA only (device nodes
``/dev/nodeplug-dra-*``), and the DaemonSet is restarted; both are put back afterwards. :func:`devnodes` makes
device nodes on the node (character 1,3, like /dev/null) with a name of their own, which claims select by ``path``,
and removes them after the test.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import stat
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from support.localcluster import Cluster

DRIVER = "devices.nodeplug.io"
CLASS = f"dratest.{DRIVER}"
CDI_DIR = Path("/var/run/cdi")


@pytest.fixture(scope="module")
def dratest_resource(cluster: Cluster) -> Iterator[None]:
    def edit(cfg: dict[str, Any]) -> None:
        dp = cfg.setdefault("deviceplugin", {})
        assert dp.get("dra", {}).get("enabled", "auto") == "auto", "the shipped config leaves DRA to auto"
        dp.setdefault("resources", []).append({"name": "dratest", "devices": ["/dev/nodeplug-dra-*"], "offer": "dra"})

    with cluster.agent_config(edit):
        try:
            yield
        finally:
            # The module's namespaces are being deleted (without waiting): a pod holding one of the driver's claims
            # only goes once the driver has unprepared it, so the driver stays until every such claim is gone; turned
            # off before, its pods stay Terminating for good.
            cluster.wait("the driver's claims released", lambda: not claims_of_driver(cluster), 180,
                         explain=f"left: {claims_of_driver(cluster)}")  # fmt: skip


def claims_of_driver(cluster: Cluster) -> list[str]:
    """ResourceClaims (any namespace) allocated from this driver's devices."""
    claims = cluster.get("resourceclaims", "--all-namespaces").get("items", [])
    return [
        f"{c['metadata']['namespace']}/{c['metadata']['name']}"
        for c in claims
        if any(r.get("driver") == DRIVER for r in ((c.get("status") or {}).get("allocation") or {}).get("devices", {})
               .get("results") or ())
    ]  # fmt: skip


@pytest.fixture
def devnodes() -> Iterator[Callable[[], str]]:
    """Factory for device nodes /dev/nodeplug-dra-<random> on the node; each removed after the test."""
    made: list[Path] = []

    def make() -> str:
        p = Path("/dev") / f"nodeplug-dra-{secrets.token_hex(3)}"
        os.mknod(p, stat.S_IFCHR | 0o666, os.makedev(1, 3))
        made.append(p)
        return str(p)

    yield make
    for p in made:
        with contextlib.suppress(FileNotFoundError):
            p.unlink()


@pytest.fixture
def device_class(cluster: Cluster) -> Iterator[str]:
    obj = {
        "apiVersion": "resource.k8s.io/v1beta1",
        "kind": "DeviceClass",
        "metadata": {"name": CLASS},
        "spec": {"selectors": [{"cel": {"expression": (
            f"device.driver == '{DRIVER}' && device.attributes['{DRIVER}'].resource == 'dratest'")}}]},
    }  # fmt: skip
    cluster.kubectl("apply", "-f", "-", input=json.dumps(obj))
    yield CLASS
    cluster.kubectl("delete", "deviceclass", CLASS, "--ignore-not-found", check=False)


def slice_devices(cluster: Cluster) -> dict[str, dict[str, Any]]:
    """Device name -> attributes, over this driver's slices of the node."""
    out: dict[str, dict[str, Any]] = {}
    for s in cluster.get("resourceslices")["items"]:
        if s["spec"]["driver"] == DRIVER and s["spec"].get("nodeName") == cluster.node:
            for d in s["spec"]["devices"]:
                out[d["name"]] = {k: next(iter(v.values())) for k, v in d["basic"]["attributes"].items()}
    return out


def wait_published(cluster: Cluster, path: str, timeout: float = 30) -> str:
    """The pool's device name for ``path``, once the slice lists it."""
    found: list[str] = []

    def probe() -> bool:
        found[:] = [n for n, a in slice_devices(cluster).items() if a.get("path") == path]
        return bool(found)

    cluster.wait(f"{path} in the ResourceSlice", probe, timeout)
    return found[0]


def template(name: str, path: str) -> dict[str, Any]:
    """A ResourceClaimTemplate for one dratest device, the one at ``path``."""
    sel = f"device.attributes['{DRIVER}'].path == '{path}'"
    return {
        "apiVersion": "resource.k8s.io/v1beta1",
        "kind": "ResourceClaimTemplate",
        "metadata": {"name": name},
        "spec": {"spec": {"devices": {"requests": [
            {"name": "dev", "deviceClassName": CLASS, "selectors": [{"cel": {"expression": sel}}]}]}}},
    }  # fmt: skip


def claim_pod(cluster: Cluster, name: str, tmpl: str) -> dict[str, Any]:
    pod = cluster.pod(name, resources={"claims": [{"name": "dev"}]})
    pod["spec"]["resourceClaims"] = [{"name": "dev", "resourceClaimTemplateName": tmpl}]
    return pod


def pod_claim(cluster: Cluster, ns: str, pod: str) -> dict[str, Any]:
    status = cluster.get("-n", ns, "pod", pod)["status"]
    (ref,) = status.get("resourceClaimStatuses") or [{}]
    return cluster.get("-n", ns, "resourceclaim", ref["resourceClaimName"])  # type: ignore[no-any-return]
