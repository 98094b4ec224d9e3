"""The DaemonSet's CSI objects against the driver they deploy (CSIDriver, StorageClasses, VolumeSnapshotClass,
sidecars), and its RBAC; the base rendered by ``kubectl kustomize`` (tests/support/manifests.py)."""

from __future__ import annotations

from pathlib import PurePosixPath
from typing import Any

from csi import controller as csi_controller
from csi import identity as csi_identity
from csi import node as csi_node
from csi import nodehost as csi_nodehost
from csi import volumes as csi_volumes
from csi.config import TOPOLOGY_KEY
from csi.model import BACKENDS, FS_TYPES
from csi.plugin import csi_socket_default
from nodeplug.api.csi.v1 import csi_pb2
from nodeplug.config import AgentConfig

from support.manifests import container, one
from support.manifests import key as object_key

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
            assert "namespace" not in obj["metadata"], object_key(obj)
        elif obj["metadata"]["name"] == "nodeplug-network-apiserver":  # reads default/kubernetes' endpoints, there
            assert obj["kind"] in ("Role", "RoleBinding") and obj["metadata"]["namespace"] == "default"
        else:
            assert obj["metadata"].get("namespace") == ns, object_key(obj)


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
        # the agent's cluster network: every Node read, its own Node's annotations patched (narrowed by the policy)
        ("", "nodes", "watch"),
        ("", "nodes", "patch"),
    }
    assert needed <= granted, needed - granted
    assert not {g for g in granted if g[1] in ("nodes", "nodes/status") and g[2] in ("update", "delete", "create")}
    # network policy: exactly list and watch of networkpolicies, namespaces and pods, cluster-wide, and nothing else
    policy = roles[("ClusterRole", "nodeplug-network-policy")]
    assert {(g, r, v) for rule in policy["rules"] for g in rule["apiGroups"] for r in rule["resources"]
            for v in rule["verbs"]} == {(g, r, v) for g, r in (("networking.k8s.io", "networkpolicies"),
                                        ("", "namespaces"), ("", "pods")) for v in ("list", "watch")}  # fmt: skip
    assert not {g for g in granted if g[1] == "networkpolicies" and g[2] not in ("list", "watch")}
    assert not {g for g in granted if g[1] == "namespaces" and g[2] not in ("list", "watch")}
    assert {g[2] for g in granted if g[1] == "pods"} == {"list", "watch", "get"}  # get: the provisioner's, below
    # Not needed: no attacher; leader election for the resizer only, in the driver's namespace only. Endpoints: only
    # the kubernetes Service's, in default, read (where the API server is: never routed to a pod network).
    assert not {g for g in granted if g[1] == "volumeattachments"}
    endpoints = [(k, r["metadata"].get("namespace"), rule) for k, r in roles.items() for rule in r["rules"]
                 if "endpoints" in rule["resources"]]  # fmt: skip
    assert endpoints == [(("Role", "nodeplug-network-apiserver"), "default",
                          {"apiGroups": [""], "resources": ["endpoints"], "resourceNames": ["kubernetes"],
                           "verbs": ["get"]})]  # fmt: skip
    leases = [(k, r) for k, r in roles.items() for rule in r["rules"] if "leases" in rule["resources"]]
    assert [(k, r["metadata"]["namespace"]) for k, r in leases] == [(("Role", "nodeplug-external-resizer-leader"), ns)]
    capacity = roles[("Role", "nodeplug-external-provisioner-capacity")]
    assert capacity["metadata"]["namespace"] == ns
