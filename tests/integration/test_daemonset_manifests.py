"""The kustomize base in daemonset/: rendered, schema-checked, and held to the code it deploys.

The base is rendered as users render it, by ``kubectl kustomize`` (kubectl from KUBE_ASSETS; the tests skip, saying
why, where it is absent). Every object is validated against the Kubernetes OpenAPI schemas of several minor versions
(kubernetes-validate, strict: unknown fields are errors); the VolumeSnapshotClass, a CRD, against the schema of its
upstream CRD.

Then the manifests are checked against the code: the agent config validates, every host path it uses is mounted,
every flag passed to ``nodeplug`` exists in its CLI, probes reach the agent. The CSI objects and the RBAC are held to
the driver in test_daemonset_csi_objects.py.
"""

from __future__ import annotations

import copy
import tomllib
from collections.abc import Iterator
from pathlib import Path, PurePosixPath
from typing import Any

import pytest

from cni.install import bundle, conflist
from csi.plugin import csi_socket_default, registration_socket_default
from nodeplug import cli, paths
from nodeplug.config import AgentConfig

from support.manifests import container, containers, key, one

REPO = Path(__file__).resolve().parents[2]
BASE = REPO / "daemonset"
K8S_VERSIONS = ["1.33.0", "1.35.0", "1.37.0"]

# From the upstream CRD snapshot.storage.k8s.io_volumesnapshotclasses.yaml (v1), closed to unknown fields.
VOLUME_SNAPSHOT_CLASS_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "driver", "deletionPolicy"],
    "additionalProperties": False,
    "properties": {
        "apiVersion": {"const": "snapshot.storage.k8s.io/v1"},
        "kind": {"const": "VolumeSnapshotClass"},
        "metadata": {
            "type": "object",
            "required": ["name"],
            "properties": {
                "name": {"type": "string", "pattern": "^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$", "maxLength": 253},
                "labels": {"type": "object", "additionalProperties": {"type": "string"}},
                "annotations": {"type": "object", "additionalProperties": {"type": "string"}},
            },
        },
        "driver": {"type": "string", "minLength": 1},
        "deletionPolicy": {"enum": ["Delete", "Retain"]},
        "parameters": {"type": "object", "additionalProperties": {"type": "string"}},
    },
}


# ---------------------------------------------------------------- rendering and schemas

_DEV_DEP = "dev dependency kubernetes-validate (pip install kubernetes-validate) is not installed"


@pytest.fixture(scope="module")
def kv() -> Any:
    return pytest.importorskip("kubernetes_validate", reason=_DEV_DEP)


@pytest.fixture(scope="module")
def jsonschema() -> Any:
    return pytest.importorskip("jsonschema", reason=_DEV_DEP)


def test_the_config_map_is_generated_and_mounted(objs: list[dict[str, Any]], pod: dict[str, Any]) -> None:
    (cm,) = [o for o in objs if o["kind"] == "ConfigMap"]
    assert cm["metadata"]["name"].startswith("nodeplug-config-")  # kustomize's content hash: a new config rolls
    mounted = {v["configMap"]["name"] for v in pod["volumes"] if "configMap" in v}
    assert mounted == {cm["metadata"]["name"]}


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_every_object_validates_against_the_kubernetes_schema(
    objs: list[dict[str, Any]], version: str, kv: Any, jsonschema: Any
) -> None:
    checked = 0
    for obj in objs:
        if obj["kind"] == "VolumeSnapshotClass":
            jsonschema.validate(obj, VOLUME_SNAPSHOT_CLASS_SCHEMA)
            continue
        try:
            kv.validate(obj, version, strict=True)
        except kv.ValidationError as e:
            pytest.fail(f"{key(obj)} on Kubernetes {version}: {'.'.join(map(str, e.path))}: {e.message}")
        checked += 1
    assert checked >= 10


@pytest.mark.parametrize(
    "mutate",
    [
        lambda o: o["spec"]["template"]["spec"]["containers"][0]["ports"][0].update(containerPort="9450"),
        lambda o: o["spec"]["template"]["spec"].update(hostNetwrok=True),
        lambda o: o["spec"].pop("selector"),
    ],
    ids=["wrong-type", "unknown-field", "missing-required"],
)
def test_the_schema_check_rejects_a_broken_daemonset(ds: dict[str, Any], mutate: Any, kv: Any) -> None:
    broken = copy.deepcopy(ds)
    mutate(broken)
    with pytest.raises(kv.ValidationError):
        kv.validate(broken, K8S_VERSIONS[-1], strict=True)


def test_the_snapshot_class_schema_rejects_a_missing_driver(objs: list[dict[str, Any]], jsonschema: Any) -> None:
    broken = copy.deepcopy(one(objs, "VolumeSnapshotClass"))
    del broken["driver"]
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(broken, VOLUME_SNAPSHOT_CLASS_SCHEMA)


# ---------------------------------------------------------------- the agent config and the host paths


def _config_paths(value: Any, where: str = "") -> Iterator[tuple[str, str]]:
    """Every absolute path in the config as (field path, value), minus paths that name something inside pods."""
    if isinstance(value, dict):
        for k, v in value.items():
            if k not in ("container_path",):
                yield from _config_paths(v, f"{where}.{k}" if where else str(k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from _config_paths(v, f"{where}[{i}]")
    elif isinstance(value, str) and value.startswith("/"):
        yield where, value


def _mounted(path: str, pod: dict[str, Any], name: str = "agent") -> dict[str, Any] | None:
    """The hostPath volume mounted over ``path`` in the container, at the same path as on the host."""
    c = container(pod, name)
    vols = {v["name"]: v for v in pod["volumes"]}
    best: dict[str, Any] | None = None
    for m in c.get("volumeMounts", []):
        host = vols[m["name"]].get("hostPath", {}).get("path")
        if host is None or host.rstrip("/") != m["mountPath"].rstrip("/"):
            continue
        p = PurePosixPath(path)
        if (p == PurePosixPath(host) or p.is_relative_to(host)) and (
            best is None or len(m["mountPath"]) > len(best["mountPath"])
        ):
            best = m
    return best


def test_the_agent_config_validates_and_uses_host_paths(agent_config: AgentConfig) -> None:
    assert agent_config.root == Path("/"), "paths in the ConfigMap are host paths mounted at the same place"
    assert agent_config.csi.enabled and agent_config.cni.enabled and agent_config.deviceplugin.enabled


def test_every_host_path_the_agent_uses_is_mounted(agent_config: AgentConfig, pod: dict[str, Any]) -> None:
    cfg = agent_config.model_dump(mode="json")
    used = dict(_config_paths({k: v for k, v in cfg.items() if k != "root"}))
    # deviceplugin.host_root is where the node's /dev and /sys are seen.
    host_root = PurePosixPath(used.pop("deviceplugin.host_root"))
    used["deviceplugin.host_root: dev"] = str(host_root / "dev")
    used["deviceplugin.host_root: sys"] = str(host_root / "sys")
    for name in ("DEVICE_PLUGIN_DIR", "KUBELET_SOCKET", "PLUGINS_DIR", "PLUGINS_REGISTRY_DIR", "STATE_DIR", "RUN_DIR"):
        used[f"nodeplug.paths.{name}"] = getattr(paths, name)
    for name in ("CNI_SOCKET", "CDI_DIR", "CNI_BIN_DIR", "CNI_CONF_DIR"):
        used[f"nodeplug.paths.{name}"] = getattr(paths, name)
    used["csi socket"] = csi_socket_default(agent_config.csi.driver_name)
    used["csi registration socket"] = registration_socket_default(agent_config.csi.driver_name)
    used["csi data"] = agent_config.csi.data_dir
    if agent_config.csi.btrfs.enabled:
        used["csi.btrfs.path"] = agent_config.csi.btrfs.path
    missing = {f: p for f, p in used.items() if _mounted(p, pod) is None}
    assert not missing, f"host paths the agent uses but the DaemonSet does not mount at the same path: {missing}"


def test_mounts_the_issue_asks_for_with_the_right_propagation(pod: dict[str, Any]) -> None:
    for path in ("/dev", "/sys", "/run/netns", "/opt/cni/bin", "/etc/cni/net.d", "/var/lib/nodeplug", "/run/nodeplug"):
        assert _mounted(path, pod) is not None, path
    assert _mounted(paths.CDI_DIR, pod) is not None
    kubelet = _mounted(paths.KUBELET_DIR, pod)
    assert kubelet is not None and kubelet["mountPath"] == paths.KUBELET_DIR
    assert kubelet.get("mountPropagation") == "Bidirectional", "volume mounts must reach kubelet and the pods"
    netns = _mounted("/run/netns/x", pod)
    assert netns is not None and netns.get("mountPropagation") in ("HostToContainer", "Bidirectional")
    assert container(pod, "agent")["securityContext"]["privileged"] is True


def test_the_network_ipam_data_and_socket_of_the_conflist_are_mounted(
    pod: dict[str, Any], agent_config: AgentConfig
) -> None:
    init = container(pod, "install-cni")
    args = cli.build_parser().parse_args(init["command"][1:])
    conf = conflist.generate_conflist(args)
    plugin = conf["plugins"][0]
    from cni.netconf import BridgeConf
    from cni.netconf import parse as parse_netconf

    parsed = parse_netconf({**plugin, "cniVersion": conf["cniVersion"], "name": conf["name"]})
    assert isinstance(parsed, BridgeConf) and parsed.ipam_conf is not None
    assert parsed.socket == agent_config.cni.socket, "the entry point must dial where the agent serves"
    assert _mounted(parsed.socket, pod) is not None
    assert _mounted(parsed.ipam_conf.data_dir, pod) is not None


# ---------------------------------------------------------------- the nodeplug command lines


def test_every_flag_passed_to_nodeplug_exists_in_the_cli(pod: dict[str, Any]) -> None:
    parser = cli.build_parser()
    seen = 0
    for c in containers(pod):
        if c["image"].split(":")[0] != "nodeplug":
            continue
        argv = [*c.get("command", []), *c.get("args", [])]
        assert argv and argv[0] == "nodeplug", f"{c['name']}: runs {argv[:1]}, expected the nodeplug command"
        try:
            parser.parse_args(argv[1:])
        except SystemExit:
            pytest.fail(f"{c['name']}: nodeplug rejects {argv}")
        seen += 1
    assert seen == 2


def test_install_cni_copies_from_where_the_image_puts_the_bundle(pod: dict[str, Any]) -> None:
    args = cli.build_parser().parse_args(container(pod, "install-cni")["command"][1:])
    assert args.command == "install-cni" and not args.uninstall
    assert str(args.bundle) == bundle.DEFAULT_BUNDLE
    assert f"COPY --from=builder /out/cni-bundle {bundle.DEFAULT_BUNDLE}" in (BASE / "Dockerfile").read_text()
    for flag_dir in (args.bin_dir, args.conf_dir):
        assert _mounted(flag_dir, pod, "install-cni") is not None, flag_dir
    from cni.cluster import uninstall

    # an install withdraws an earlier uninstall's request, where the agent looks for it
    assert _mounted(uninstall.MARKER, pod, "install-cni") is not None
    assert _mounted(uninstall.MARKER, pod) is not None and _mounted(uninstall.LOCK, pod) is not None


def test_the_image_tag_is_the_project_version(objs: list[dict[str, Any]], pod: dict[str, Any]) -> None:
    version = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    for c in containers(pod):
        if c["image"].startswith("nodeplug"):
            assert c["image"] == f"nodeplug:{version}"
        else:
            assert c["image"].startswith("registry.k8s.io/sig-storage/"), c["image"]
            assert ":v" in c["image"] and "latest" not in c["image"], f"{c['image']}: pin a release tag"


# ---------------------------------------------------------------- health, metrics, scheduling


def test_probes_reach_the_agents_http_address(
    agent_config: AgentConfig, ds: dict[str, Any], pod: dict[str, Any]
) -> None:
    agent = container(pod, "agent")
    ports = {p["name"]: p["containerPort"] for p in agent["ports"]}
    assert ports["metrics"] == agent_config.http.port
    annotations = ds["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/port"] == str(agent_config.http.port)
    assert pod["hostNetwork"] is True
    for probe, path in (("livenessProbe", "/healthz"), ("readinessProbe", "/readyz"), ("startupProbe", "/healthz")):
        get = agent[probe]["httpGet"]
        assert get["path"] == path
        assert ports.get(get["port"], get["port"]) == agent_config.http.port
        # hostNetwork: kubelet probes the node's address unless a host is given; the agent must listen there.
        host = get.get("host")
        assert agent_config.http.host in ("0.0.0.0", "::") or host == agent_config.http.host, (
            f"{probe} goes to {host or 'the node IP'} but the agent listens on {agent_config.http.address}"
        )


def test_runs_on_every_node_and_updates_one_node_at_a_time(ds: dict[str, Any], pod: dict[str, Any]) -> None:
    assert {"operator": "Exists"} in pod["tolerations"]
    assert pod["priorityClassName"] == "system-node-critical"
    strategy = ds["spec"]["updateStrategy"]
    assert strategy["type"] == "RollingUpdate" and strategy["rollingUpdate"]["maxUnavailable"] == 1
    for c in containers(pod):
        assert c["resources"]["requests"]["cpu"] and c["resources"]["requests"]["memory"], c["name"]
        assert c["resources"]["limits"]["memory"], c["name"]


def test_the_agents_grace_fits_the_pods_termination_grace(agent_config: AgentConfig, pod: dict[str, Any]) -> None:
    assert agent_config.shutdown_grace_seconds + 10 <= pod["terminationGracePeriodSeconds"]
