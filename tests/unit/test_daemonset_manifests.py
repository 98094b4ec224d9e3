"""The kustomize base in daemonset/: rendered, schema-checked, and held to the code it deploys.

The base is rendered by :func:`render`, a loader for exactly the kustomize features the base uses (resources,
configMapGenerator with kustomize's name hash, images); when ``kubectl`` is on PATH its built-in kustomize
renders the base too and the two must agree object for object. Every object is validated against the Kubernetes
OpenAPI schemas of several minor versions (kubernetes-validate, strict: unknown fields are errors); the
VolumeSnapshotClass, a CRD, against the schema of its upstream CRD.

Then the manifests are checked against the code: the agent config validates, every host path it uses is mounted,
every flag passed to ``nodeplug`` exists in its CLI, the CSIDriver, StorageClasses and VolumeSnapshotClass agree with
the driver's name, capabilities and parameters, and the sidecars reach the socket the driver serves.
"""

from __future__ import annotations

import copy
import hashlib
import json
import shutil
import subprocess
import tomllib
from collections.abc import Iterator
from pathlib import Path, PurePosixPath
from typing import Any

import pytest
import yaml

from csi import controller as csi_controller
from csi import identity as csi_identity
from csi import node as csi_node
from csi import nodehost as csi_nodehost
from csi import volumes as csi_volumes
from csi.config import TOPOLOGY_KEY
from csi.model import BACKENDS, FS_TYPES
from csi.plugin import csi_socket_default, registration_socket_default
from nodeplug import cli, installcni, paths
from nodeplug.api.csi.v1 import csi_pb2
from nodeplug.config import AgentConfig, parse

REPO = Path(__file__).resolve().parents[2]
BASE = REPO / "daemonset"
K8S_VERSIONS = ["1.33.0", "1.35.0", "1.37.0"]
CLUSTER_SCOPED = {
    "Namespace",
    "ClusterRole",
    "ClusterRoleBinding",
    "CSIDriver",
    "StorageClass",
    "VolumeSnapshotClass",
    "PriorityClass",
    "CustomResourceDefinition",
    "DeviceClass",
    "ValidatingAdmissionPolicy",
    "ValidatingAdmissionPolicyBinding",
}
KUSTOMIZE_FEATURES = {"apiVersion", "kind", "resources", "configMapGenerator", "images"}

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


# ---------------------------------------------------------------- the loader


def _kustomize_hash(data: dict[str, str]) -> str:
    """kustomize's name suffix for a generated ConfigMap: the first 10 hex digits of the sha256 of Go's JSON of
    {data, kind, name}, re-lettered. (kustomize v5 looks the name up by a path its lookup does not split, so the name
    always hashes as "".)"""
    encoded = json.dumps({"data": data, "kind": "ConfigMap", "name": ""}, sort_keys=True, separators=(",", ":"))
    encoded = encoded.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")
    digest = hashlib.sha256(encoded.encode()).hexdigest()[:10]
    return digest.translate(str.maketrans({"0": "g", "1": "h", "3": "k", "a": "m", "e": "t"}))


def _pod_specs(obj: dict[str, Any]) -> Iterator[dict[str, Any]]:
    spec = obj.get("spec", {})
    if obj["kind"] == "Pod":
        yield spec
    elif "template" in spec:
        yield spec["template"]["spec"]


def _containers(pod: dict[str, Any]) -> Iterator[dict[str, Any]]:
    yield from pod.get("initContainers", [])
    yield from pod.get("containers", [])


def render(base: Path) -> list[dict[str, Any]]:
    k = yaml.safe_load((base / "kustomization.yaml").read_text())
    unknown = set(k) - KUSTOMIZE_FEATURES
    assert not unknown, f"kustomization.yaml uses {sorted(unknown)}: teach render() about them"
    objs = [d for r in k["resources"] for d in yaml.safe_load_all((base / r).read_text()) if d]
    renames: dict[str, str] = {}
    for gen in k.get("configMapGenerator", []):
        assert set(gen) <= {"name", "namespace", "files"}, f"configMapGenerator uses {sorted(gen)}"
        data = {PurePosixPath(f).name: (base / f).read_text() for f in gen["files"]}
        name = f"{gen['name']}-{_kustomize_hash(data)}"
        renames[gen["name"]] = name
        meta = {"name": name, **({"namespace": gen["namespace"]} if "namespace" in gen else {})}
        objs.append({"apiVersion": "v1", "kind": "ConfigMap", "metadata": meta, "data": data})
    for obj in objs:
        for pod in _pod_specs(obj):
            for vol in pod.get("volumes", []):
                if "configMap" in vol:
                    vol["configMap"]["name"] = renames.get(vol["configMap"]["name"], vol["configMap"]["name"])
            for c in _containers(pod):
                for img in k.get("images", []):
                    if c["image"].split(":")[0] == img["name"]:
                        c["image"] = f"{img.get('newName', img['name'])}:{img['newTag']}"
    return objs


def _key(obj: dict[str, Any]) -> tuple[str, str, str]:
    return obj["kind"], obj["metadata"].get("namespace", ""), obj["metadata"]["name"]


@pytest.fixture(scope="module")
def objs() -> list[dict[str, Any]]:
    return render(BASE)


def one(objs: list[dict[str, Any]], kind: str, name: str | None = None) -> dict[str, Any]:
    found = [o for o in objs if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)]
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {len(found)}"
    return found[0]


@pytest.fixture(scope="module")
def ds(objs: list[dict[str, Any]]) -> dict[str, Any]:
    return one(objs, "DaemonSet", "nodeplug")


@pytest.fixture(scope="module")
def pod(ds: dict[str, Any]) -> dict[str, Any]:
    return dict(ds["spec"]["template"]["spec"])


def container(pod: dict[str, Any], name: str) -> dict[str, Any]:
    found = [c for c in _containers(pod) if c["name"] == name]
    assert found, f"no container {name}"
    return found[0]


@pytest.fixture(scope="module")
def agent_config(objs: list[dict[str, Any]], pod: dict[str, Any]) -> AgentConfig:
    agent = container(pod, "agent")
    config_arg = [a for a in agent["command"] if a.startswith("--config=")]
    assert config_arg, "the agent is started with --config=FILE"
    path = PurePosixPath(config_arg[0].split("=", 1)[1])
    mount = next(m for m in agent["volumeMounts"] if path.is_relative_to(m["mountPath"]))
    vol = next(v for v in pod["volumes"] if v["name"] == mount["name"])
    cm = one(objs, "ConfigMap", vol["configMap"]["name"])
    key = str(path.relative_to(mount["mountPath"]))
    assert key in cm["data"], f"{path}: ConfigMap {cm['metadata']['name']} has no key {key}"
    return parse(yaml.safe_load(cm["data"][key]), f"ConfigMap {key}")


# ---------------------------------------------------------------- rendering and schemas

_DEV_DEP = "dev dependency kubernetes-validate (pip install kubernetes-validate) is not installed"


@pytest.fixture(scope="module")
def kv() -> Any:
    return pytest.importorskip("kubernetes_validate", reason=_DEV_DEP)


@pytest.fixture(scope="module")
def jsonschema() -> Any:
    return pytest.importorskip("jsonschema", reason=_DEV_DEP)


def test_loader_renders_what_kubectl_kustomize_renders(objs: list[dict[str, Any]]) -> None:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl not on PATH: the Python loader's output is not cross-checked")
    out = subprocess.run([kubectl, "kustomize", str(BASE)], capture_output=True, text=True, timeout=60, check=True)
    theirs = {_key(o): o for o in yaml.safe_load_all(out.stdout) if o}
    ours = {_key(o): o for o in objs}
    assert sorted(ours) == sorted(theirs)
    for key, obj in ours.items():
        assert obj == theirs[key], f"{key} differs from kubectl kustomize"


@pytest.mark.parametrize(("data", "suffix"), [({"k": "x"}, "59kf84ccfh"), ({"k": "v<&>\n"}, "t9mhh57f85")])
def test_kustomize_hash_matches_kustomize(data: dict[str, str], suffix: str) -> None:
    # Suffixes kustomize v5.5.0 (kubectl kustomize) gives a generated ConfigMap with a file "k" of this content.
    assert _kustomize_hash(data) == suffix


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
            pytest.fail(f"{_key(obj)} on Kubernetes {version}: {'.'.join(map(str, e.path))}: {e.message}")
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
    conf = installcni.generate_conflist(args)
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
    for c in _containers(pod):
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
    assert str(args.bundle) == installcni.DEFAULT_BUNDLE
    assert f"COPY --from=builder /out/cni-bundle {installcni.DEFAULT_BUNDLE}" in (BASE / "Dockerfile").read_text()
    for flag_dir in (args.bin_dir, args.conf_dir):
        assert _mounted(flag_dir, pod, "install-cni") is not None, flag_dir


def test_the_image_tag_is_the_project_version(objs: list[dict[str, Any]], pod: dict[str, Any]) -> None:
    version = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    for c in _containers(pod):
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
    for c in _containers(pod):
        assert c["resources"]["requests"]["cpu"] and c["resources"]["requests"]["memory"], c["name"]
        assert c["resources"]["limits"]["memory"], c["name"]


def test_the_agents_grace_fits_the_pods_termination_grace(agent_config: AgentConfig, pod: dict[str, Any]) -> None:
    assert agent_config.shutdown_grace_seconds + 10 <= pod["terminationGracePeriodSeconds"]


# ---------------------------------------------------------------- the CSI driver objects against the driver


def test_csidriver_agrees_with_the_drivers_capabilities(objs: list[dict[str, Any]], agent_config: AgentConfig) -> None:
    d = one(objs, "CSIDriver")
    spec = d["spec"]
    assert d["metadata"]["name"] == agent_config.csi.driver_name
    ctrl = set(csi_controller.CONTROLLER_CAPABILITIES)
    rpc = csi_pb2.ControllerServiceCapability.RPC
    # attachRequired false: the driver has no ControllerPublishVolume.
    assert spec["attachRequired"] is (rpc.PUBLISH_UNPUBLISH_VOLUME in ctrl) is False
    # storageCapacity: the provisioner's capacity tracking calls GetCapacity.
    assert spec["storageCapacity"] is (rpc.GET_CAPACITY in ctrl) is True
    # Ephemeral: the node side recognises kubelet's ephemeral flag, which kubelet sends only with podInfoOnMount.
    assert "Ephemeral" in spec["volumeLifecycleModes"] and "Persistent" in spec["volumeLifecycleModes"]
    assert csi_nodehost.EPHEMERAL_KEY == "csi.storage.k8s.io/ephemeral" and spec["podInfoOnMount"] is True
    # fsGroupPolicy File: kubelet applies fsGroup itself, since the node does not take it (VOLUME_MOUNT_GROUP).
    node_caps = {c.rpc.type for c in _node_capabilities()}
    assert spec["fsGroupPolicy"] == "File"
    assert csi_pb2.NodeServiceCapability.RPC.VOLUME_MOUNT_GROUP not in node_caps


def _node_capabilities() -> list[Any]:
    """NodeGetCapabilities as kubelet gets it (the servicer's answer does not depend on its state)."""
    import asyncio

    servicer = object.__new__(csi_node.NodeServicer)
    reply = asyncio.run(servicer.NodeGetCapabilities(csi_pb2.NodeGetCapabilitiesRequest(), _Context()))
    return list(reply.capabilities)


class _Context:
    async def abort(self, code: Any, details: str) -> None:
        raise AssertionError(f"NodeGetCapabilities aborted: {code} {details}")

    def __getattr__(self, name: str) -> Any:
        return lambda *a, **k: None


def test_storage_classes_agree_with_the_driver(objs: list[dict[str, Any]], agent_config: AgentConfig) -> None:
    classes = {o["metadata"]["name"]: o for o in objs if o["kind"] == "StorageClass"}
    assert set(classes) == {"nodeplug-local", "nodeplug-btrfs"}
    defaults = [n for n, o in classes.items() if o["metadata"].get("annotations", {}).get(_DEFAULT_SC) == "true"]
    assert defaults == ["nodeplug-local"]
    plugin_caps = csi_identity.plugin_capabilities()
    expands = csi_pb2.ControllerServiceCapability.RPC.EXPAND_VOLUME in csi_controller.CONTROLLER_CAPABILITIES
    assert any(c.HasField("volume_expansion") for c in plugin_caps) or expands
    for name, sc in classes.items():
        assert sc["provisioner"] == agent_config.csi.driver_name, name
        assert sc["volumeBindingMode"] == "WaitForFirstConsumer", name
        assert sc["allowVolumeExpansion"] is True, name
        params = dict(sc.get("parameters", {}))
        fstype = params.pop("csi.storage.k8s.io/fstype", "")
        assert not fstype or fstype in FS_TYPES, f"{name}: fstype {fstype}"
        for key, value in params.items():
            assert key == csi_volumes.PARAM_BACKEND, f"{name}: parameters.{key} is not a driver parameter"
            assert value in BACKENDS, f"{name}: backend {value}"
    assert classes["nodeplug-local"]["parameters"][csi_volumes.PARAM_BACKEND] == "loopfile"
    assert classes["nodeplug-btrfs"]["parameters"][csi_volumes.PARAM_BACKEND] == "btrfs"


_DEFAULT_SC = "storageclass.kubernetes.io/is-default-class"


def test_snapshot_class_agrees_with_the_driver(objs: list[dict[str, Any]], agent_config: AgentConfig) -> None:
    vsc = one(objs, "VolumeSnapshotClass")
    assert vsc["driver"] == agent_config.csi.driver_name
    rpc = csi_pb2.ControllerServiceCapability.RPC
    assert rpc.CREATE_DELETE_SNAPSHOT in csi_controller.CONTROLLER_CAPABILITIES


def test_sidecars_reach_the_drivers_socket_and_run_on_every_node(
    pod: dict[str, Any], agent_config: AgentConfig
) -> None:
    socket = PurePosixPath(csi_socket_default(agent_config.csi.driver_name))
    vols = {v["name"]: v for v in pod["volumes"]}
    rpc = csi_pb2.PluginCapability.Service
    topology = any(c.service.type == rpc.VOLUME_ACCESSIBILITY_CONSTRAINTS for c in csi_identity.plugin_capabilities())
    # Volumes are reachable from one node only (the driver reports TOPOLOGY_KEY per node): the provisioner must
    # ask for exactly the selected node's segment.
    assert topology, "node-deployed provisioning needs VOLUME_ACCESSIBILITY_CONSTRAINTS"
    assert "--strict-topology=true" in container(pod, "csi-provisioner")["args"], TOPOLOGY_KEY
    for name in ("csi-provisioner", "csi-resizer", "csi-snapshotter"):
        c = container(pod, name)
        address = PurePosixPath(next(a for a in c["args"] if a.startswith("--csi-address=")).split("=", 1)[1])
        mount = next(m for m in c["volumeMounts"] if address.is_relative_to(m["mountPath"]))
        host = PurePosixPath(vols[mount["name"]]["hostPath"]["path"]) / address.relative_to(mount["mountPath"])
        assert host == socket, f"{name} dials {host}, the driver serves {socket}"
    for name in ("csi-provisioner", "csi-snapshotter"):
        c = container(pod, name)
        assert not any(a.startswith("--leader-election") for a in c["args"]), f"{name}: one per node, no election"
    # Expansion is node-only (no controller EXPAND_VOLUME): the resizer needs no node of its own, so one is elected.
    node_only = csi_pb2.ControllerServiceCapability.RPC.EXPAND_VOLUME not in csi_controller.CONTROLLER_CAPABILITIES
    assert node_only
    resizer = container(pod, "csi-resizer")["args"]
    assert "--leader-election=true" in resizer and "--leader-election-namespace=nodeplug-system" in resizer
    for name in ("csi-provisioner", "csi-snapshotter"):
        c = container(pod, name)
        assert "--node-deployment=true" in c["args"], name
        env = {e["name"]: e.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") for e in c["env"]}
        assert env["NODE_NAME"] == "spec.nodeName", name
    prov = container(pod, "csi-provisioner")
    env = {e["name"]: e.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") for e in prov["env"]}
    assert "--enable-capacity=true" in prov["args"] and "--capacity-ownerref-level=0" in prov["args"]
    assert env["NAMESPACE"] == "metadata.namespace" and env["POD_NAME"] == "metadata.name"


# ---------------------------------------------------------------- RBAC


def test_namespaced_objects_are_in_the_namespace_and_cluster_objects_are_not(objs: list[dict[str, Any]]) -> None:
    ns = one(objs, "Namespace")["metadata"]["name"]
    for obj in objs:
        if obj["kind"] in CLUSTER_SCOPED:
            assert "namespace" not in obj["metadata"], _key(obj)
        else:
            assert obj["metadata"].get("namespace") == ns, _key(obj)


def test_rbac_binds_the_pods_service_account_without_wildcards_or_secrets(
    objs: list[dict[str, Any]], ds: dict[str, Any], pod: dict[str, Any]
) -> None:
    ns = ds["metadata"]["namespace"]
    sa = one(objs, "ServiceAccount", pod["serviceAccountName"])
    assert sa["metadata"]["namespace"] == ns
    roles = {(o["kind"], o["metadata"]["name"]): o for o in objs if o["kind"] in ("Role", "ClusterRole")}
    bindings = [o for o in objs if o["kind"] in ("RoleBinding", "ClusterRoleBinding")]
    assert bindings
    for b in bindings:
        assert (b["roleRef"]["kind"], b["roleRef"]["name"]) in roles, b["metadata"]["name"]
        assert b["subjects"] == [{"kind": "ServiceAccount", "name": sa["metadata"]["name"], "namespace": ns}]
    granted: set[tuple[str, str, str]] = set()
    for role in roles.values():
        for rule in role["rules"]:
            for field in ("apiGroups", "resources", "verbs"):
                assert "*" not in rule[field], f"{role['metadata']['name']}: wildcard {field}"
            assert "secrets" not in rule["resources"], f"{role['metadata']['name']}: no class uses secrets"
            for g in rule["apiGroups"]:
                for r in rule["resources"]:
                    granted |= {(g, r, v) for v in rule["verbs"]}
    # What the sidecars cannot work without (upstream RBAC for a node deployment with capacity tracking).
    needed = {
        ("", "persistentvolumes", "create"),
        ("", "persistentvolumeclaims", "update"),
        ("", "persistentvolumeclaims/status", "patch"),
        ("storage.k8s.io", "csistoragecapacities", "create"),
        ("storage.k8s.io", "csinodes", "get"),
        ("", "nodes", "get"),
        ("", "pods", "get"),
        ("snapshot.storage.k8s.io", "volumesnapshotcontents/status", "update"),
        ("", "events", "create"),
    }
    assert needed <= granted, needed - granted
    # Not needed: no attacher; leader election for the resizer only, in the driver's namespace only.
    assert not {g for g in granted if g[1] in ("volumeattachments", "endpoints")}
    leases = [(k, r) for k, r in roles.items() for rule in r["rules"] if "leases" in rule["resources"]]
    assert [(k, r["metadata"]["namespace"]) for k, r in leases] == [(("Role", "nodeplug-external-resizer-leader"), ns)]
    capacity = roles[("Role", "nodeplug-external-provisioner-capacity")]
    assert capacity["metadata"]["namespace"] == ns


def test_dra_device_classes_rbac_and_policy(objs: list[dict[str, Any]], agent_config: AgentConfig) -> None:
    from deviceplugin.dra.config import DRIVER_NAME

    driver = agent_config.deviceplugin.dra.driver_name
    assert driver == DRIVER_NAME
    classes = {o["metadata"]["name"]: o for o in objs if o["kind"] == "DeviceClass"}
    assert set(classes) == {f"{r.name}.{driver}" for r in agent_config.deviceplugin.resources}
    for r in agent_config.deviceplugin.resources:
        (sel,) = classes[f"{r.name}.{driver}"]["spec"]["selectors"]
        expr = " ".join(sel["cel"]["expression"].split())
        assert f"device.driver == '{driver}'" in expr
        assert f"device.attributes['{driver}'].resource == '{r.name}'" in expr
    role = one(objs, "ClusterRole", "nodeplug-dra")
    granted = {(g, res, v) for rule in role["rules"] for g in rule["apiGroups"] for res in rule["resources"]
               for v in rule["verbs"]}  # fmt: skip
    assert {("resource.k8s.io", "resourceclaims", "get"), ("resource.k8s.io", "resourceslices", "watch"),
            ("resource.k8s.io", "resourceslices", "create"), ("resource.k8s.io", "resourceslices", "update"),
            ("resource.k8s.io", "resourceslices", "delete")} <= granted  # fmt: skip
    assert not {g for g in granted if g[1] == "resourceclaims" and g[2] != "get"}, "claims are only read"
    policy = one(objs, "ValidatingAdmissionPolicy", "nodeplug-dra-resourceslices")
    assert any(driver in v["expression"] for v in policy["spec"]["validations"])
    binding = one(objs, "ValidatingAdmissionPolicyBinding", "nodeplug-dra-resourceslices")
    assert binding["spec"]["policyName"] == policy["metadata"]["name"]
    assert binding["spec"]["validationActions"] == ["Deny"]
