"""The DRA objects of the kustomize base (daemonset/dra.yaml) against the driver: a DeviceClass per resource that
selects it by driver and attribute, RBAC that only reads claims, and the admission policy that keeps each agent to
its own node's slices."""

from __future__ import annotations

from typing import Any

from deviceplugin.dra.config import DRIVER_NAME
from nodeplug.config import AgentConfig

from support.manifests import one


def test_dra_device_classes_rbac_and_policy(objs: list[dict[str, Any]], agent_config: AgentConfig) -> None:
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
