"""The wire contracts: every full method path and key field number is upstream's.

kubelet, the CSI sidecars and the container runtime only see method paths and field numbers on the wire, so a typo
in a package, service or rpc name, or a renumbered field, breaks interoperability without breaking any import.
tests/integration/test_protos_generated.py regenerates the stubs and calls them over a real socket.
"""

from __future__ import annotations

from typing import Any

import pytest
from google.protobuf.descriptor import FileDescriptor

from nodeplug.api.csi.v1 import csi_pb2, csi_pb2_grpc
from nodeplug.api.deviceplugin.v1beta1 import api_pb2 as dp_pb2
from nodeplug.api.deviceplugin.v1beta1 import api_pb2_grpc as dp_grpc
from nodeplug.api.dra.v1 import api_pb2 as dra_v1_pb2
from nodeplug.api.dra.v1 import api_pb2_grpc as dra_v1_grpc
from nodeplug.api.dra.v1beta1 import api_pb2 as dra_v1beta1_pb2
from nodeplug.api.dra.v1beta1 import api_pb2_grpc as dra_v1beta1_grpc
from nodeplug.api.pluginregistration.v1 import api_pb2 as reg_pb2
from nodeplug.api.pluginregistration.v1 import api_pb2_grpc as reg_grpc
from nodeplug.api.podresources.v1 import api_pb2 as pr_pb2
from nodeplug.api.podresources.v1 import api_pb2_grpc as pr_grpc

# Every rpc of every service, as "/<package>.<Service>/<Rpc>": (client streaming, server streaming).
METHODS: dict[str, tuple[bool, bool]] = {
    # kubelet device plugin API (package v1beta1)
    "/v1beta1.Registration/Register": (False, False),
    "/v1beta1.DevicePlugin/GetDevicePluginOptions": (False, False),
    "/v1beta1.DevicePlugin/ListAndWatch": (False, True),
    "/v1beta1.DevicePlugin/GetPreferredAllocation": (False, False),
    "/v1beta1.DevicePlugin/Allocate": (False, False),
    "/v1beta1.DevicePlugin/PreStartContainer": (False, False),
    # kubelet DRA plugin API: the full upstream package names are on the wire (kubelet 1.32 calls v1beta1)
    "/k8s.io.kubelet.pkg.apis.dra.v1beta1.DRAPlugin/NodePrepareResources": (False, False),
    "/k8s.io.kubelet.pkg.apis.dra.v1beta1.DRAPlugin/NodeUnprepareResources": (False, False),
    "/k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin/NodePrepareResources": (False, False),
    "/k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin/NodeUnprepareResources": (False, False),
    # kubelet plugin watcher (package pluginregistration)
    "/pluginregistration.Registration/GetInfo": (False, False),
    "/pluginregistration.Registration/NotifyRegistrationStatus": (False, False),
    # kubelet pod resources (package v1)
    "/v1.PodResourcesLister/List": (False, False),
    "/v1.PodResourcesLister/GetAllocatableResources": (False, False),
    "/v1.PodResourcesLister/Get": (False, False),
    # CSI v1.12 (package csi.v1)
    "/csi.v1.Identity/GetPluginInfo": (False, False),
    "/csi.v1.Identity/GetPluginCapabilities": (False, False),
    "/csi.v1.Identity/Probe": (False, False),
    "/csi.v1.Controller/CreateVolume": (False, False),
    "/csi.v1.Controller/DeleteVolume": (False, False),
    "/csi.v1.Controller/ControllerPublishVolume": (False, False),
    "/csi.v1.Controller/ControllerUnpublishVolume": (False, False),
    "/csi.v1.Controller/ValidateVolumeCapabilities": (False, False),
    "/csi.v1.Controller/ListVolumes": (False, False),
    "/csi.v1.Controller/GetCapacity": (False, False),
    "/csi.v1.Controller/ControllerGetCapabilities": (False, False),
    "/csi.v1.Controller/CreateSnapshot": (False, False),
    "/csi.v1.Controller/DeleteSnapshot": (False, False),
    "/csi.v1.Controller/ListSnapshots": (False, False),
    "/csi.v1.Controller/GetSnapshot": (False, False),
    "/csi.v1.Controller/ControllerExpandVolume": (False, False),
    "/csi.v1.Controller/ControllerGetVolume": (False, False),
    "/csi.v1.Controller/ControllerModifyVolume": (False, False),
    "/csi.v1.GroupController/GroupControllerGetCapabilities": (False, False),
    "/csi.v1.GroupController/CreateVolumeGroupSnapshot": (False, False),
    "/csi.v1.GroupController/DeleteVolumeGroupSnapshot": (False, False),
    "/csi.v1.GroupController/GetVolumeGroupSnapshot": (False, False),
    "/csi.v1.SnapshotMetadata/GetMetadataAllocated": (False, True),
    "/csi.v1.SnapshotMetadata/GetMetadataDelta": (False, True),
    "/csi.v1.Node/NodeStageVolume": (False, False),
    "/csi.v1.Node/NodeUnstageVolume": (False, False),
    "/csi.v1.Node/NodePublishVolume": (False, False),
    "/csi.v1.Node/NodeUnpublishVolume": (False, False),
    "/csi.v1.Node/NodeGetVolumeStats": (False, False),
    "/csi.v1.Node/NodeExpandVolume": (False, False),
    "/csi.v1.Node/NodeGetCapabilities": (False, False),
    "/csi.v1.Node/NodeGetInfo": (False, False),
}

FILES: list[FileDescriptor] = [
    dp_pb2.DESCRIPTOR,
    dra_v1beta1_pb2.DESCRIPTOR,
    dra_v1_pb2.DESCRIPTOR,
    reg_pb2.DESCRIPTOR,
    pr_pb2.DESCRIPTOR,
    csi_pb2.DESCRIPTOR,
]
GRPC_MODULES: list[Any] = [dp_grpc, dra_v1beta1_grpc, dra_v1_grpc, reg_grpc, pr_grpc, csi_pb2_grpc]

# The two DRA packages carry the same messages with the same field numbers.
_DRA_FIELDS: dict[str, dict[str, int]] = {
    "NodePrepareResourcesRequest": {"claims": 1},
    "NodePrepareResourcesResponse": {"claims": 1},
    "NodePrepareResourceResponse": {"devices": 1, "error": 2},
    "Device": {"request_names": 1, "pool_name": 2, "device_name": 3, "cdi_device_ids": 4},
    "NodeUnprepareResourcesRequest": {"claims": 1},
    "NodeUnprepareResourcesResponse": {"claims": 1},
    "NodeUnprepareResourceResponse": {"error": 1},
    "Claim": {"namespace": 1, "uid": 2, "name": 3},
}

# Field numbers the peers depend on: message full name -> {field: number}.
FIELDS: dict[str, dict[str, int]] = {
    "v1beta1.RegisterRequest": {"version": 1, "endpoint": 2, "resource_name": 3, "options": 4},
    "v1beta1.DevicePluginOptions": {"pre_start_required": 1, "get_preferred_allocation_available": 2},
    "v1beta1.Device": {"ID": 1, "health": 2, "topology": 3},
    "v1beta1.ListAndWatchResponse": {"devices": 1},
    "v1beta1.AllocateRequest": {"container_requests": 1},
    "v1beta1.ContainerAllocateRequest": {"devices_ids": 1},
    "v1beta1.AllocateResponse": {"container_responses": 1},
    "v1beta1.ContainerAllocateResponse": {"envs": 1, "mounts": 2, "devices": 3, "annotations": 4, "cdi_devices": 5},
    "v1beta1.Mount": {"container_path": 1, "host_path": 2, "read_only": 3},
    "v1beta1.DeviceSpec": {"container_path": 1, "host_path": 2, "permissions": 3},
    "v1beta1.CDIDevice": {"name": 1},
    "v1beta1.ContainerPreferredAllocationRequest": {
        "available_deviceIDs": 1,
        "must_include_deviceIDs": 2,
        "allocation_size": 3,
    },
    "pluginregistration.PluginInfo": {"type": 1, "name": 2, "endpoint": 3, "supported_versions": 4},
    "pluginregistration.RegistrationStatus": {"plugin_registered": 1, "error": 2},
    "v1.ContainerResources": {"name": 1, "devices": 2, "cpu_ids": 3, "memory": 4, "dynamic_resources": 5},
    "v1.ContainerDevices": {"resource_name": 1, "device_ids": 2, "topology": 3},
    "v1.DynamicResource": {"claim_name": 2, "claim_namespace": 3, "claim_resources": 4},
    "csi.v1.GetPluginInfoResponse": {"name": 1, "vendor_version": 2, "manifest": 3},
    "csi.v1.CreateVolumeRequest": {
        "name": 1,
        "capacity_range": 2,
        "volume_capabilities": 3,
        "parameters": 4,
        "secrets": 5,
        "volume_content_source": 6,
        "accessibility_requirements": 7,
        "mutable_parameters": 8,
    },
    "csi.v1.Volume": {
        "capacity_bytes": 1,
        "volume_id": 2,
        "volume_context": 3,
        "content_source": 4,
        "accessible_topology": 5,
    },
    "csi.v1.CapacityRange": {"required_bytes": 1, "limit_bytes": 2},
    "csi.v1.VolumeCapability": {"block": 1, "mount": 2, "access_mode": 3},
    "csi.v1.VolumeCapability.MountVolume": {"fs_type": 1, "mount_flags": 2, "volume_mount_group": 3},
    "csi.v1.NodeStageVolumeRequest": {
        "volume_id": 1,
        "publish_context": 2,
        "staging_target_path": 3,
        "volume_capability": 4,
        "secrets": 5,
        "volume_context": 6,
    },
    "csi.v1.NodePublishVolumeRequest": {
        "volume_id": 1,
        "publish_context": 2,
        "staging_target_path": 3,
        "target_path": 4,
        "volume_capability": 5,
        "readonly": 6,
        "secrets": 7,
        "volume_context": 8,
    },
    "csi.v1.NodeGetInfoResponse": {"node_id": 1, "max_volumes_per_node": 2, "accessible_topology": 3},
    "csi.v1.NodeExpandVolumeRequest": {
        "volume_id": 1,
        "volume_path": 2,
        "capacity_range": 3,
        "staging_target_path": 4,
        "volume_capability": 5,
        "secrets": 6,
    },
    "csi.v1.Snapshot": {
        "size_bytes": 1,
        "snapshot_id": 2,
        "source_volume_id": 3,
        "creation_time": 4,
        "ready_to_use": 5,
        "group_snapshot_id": 6,
    },
    "csi.v1.ControllerModifyVolumeRequest": {"volume_id": 1, "secrets": 2, "mutable_parameters": 3},
    **{
        f"k8s.io.kubelet.pkg.apis.dra.{version}.{message}": fields
        for version in ("v1beta1", "v1")
        for message, fields in _DRA_FIELDS.items()
    },
}

# Enum values the peers depend on: enum full name -> {value: number}.
ENUMS: dict[str, dict[str, int]] = {
    "csi.v1.PluginCapability.Service.Type": {
        "UNKNOWN": 0,
        "CONTROLLER_SERVICE": 1,
        "VOLUME_ACCESSIBILITY_CONSTRAINTS": 2,
        "GROUP_CONTROLLER_SERVICE": 3,
        "SNAPSHOT_METADATA_SERVICE": 4,
    },
    "csi.v1.VolumeCapability.AccessMode.Mode": {
        "UNKNOWN": 0,
        "SINGLE_NODE_WRITER": 1,
        "SINGLE_NODE_READER_ONLY": 2,
        "MULTI_NODE_READER_ONLY": 3,
        "MULTI_NODE_SINGLE_WRITER": 4,
        "MULTI_NODE_MULTI_WRITER": 5,
        "SINGLE_NODE_SINGLE_WRITER": 6,
        "SINGLE_NODE_MULTI_WRITER": 7,
    },
    "csi.v1.NodeServiceCapability.RPC.Type": {
        "UNKNOWN": 0,
        "STAGE_UNSTAGE_VOLUME": 1,
        "GET_VOLUME_STATS": 2,
        "EXPAND_VOLUME": 3,
        "VOLUME_CONDITION": 4,
        "SINGLE_NODE_MULTI_WRITER": 5,
        "VOLUME_MOUNT_GROUP": 6,
    },
    "csi.v1.ControllerServiceCapability.RPC.Type": {
        "CREATE_DELETE_VOLUME": 1,
        "CREATE_DELETE_SNAPSHOT": 5,
        "EXPAND_VOLUME": 9,
        "MODIFY_VOLUME": 14,
        "GET_SNAPSHOT": 15,
    },
}


def test_method_paths_from_descriptors() -> None:
    seen: dict[str, tuple[bool, bool]] = {}
    for fd in FILES:
        for svc in fd.services_by_name.values():
            for m in svc.methods:
                seen[f"/{svc.full_name}/{m.name}"] = (m.client_streaming, m.server_streaming)
    assert seen == METHODS


class _RecordingChannel:
    """Stands in for a grpc.Channel: records the method path each stub constructor asks for."""

    def __init__(self) -> None:
        self.paths: dict[str, tuple[bool, bool]] = {}

    def _rec(self, cs: bool, ss: bool) -> Any:
        def make(path: str, *args: Any, **kwargs: Any) -> object:
            self.paths[path] = (cs, ss)
            return object()

        return make

    def __getattr__(self, name: str) -> Any:
        kinds = {
            "unary_unary": (False, False),
            "unary_stream": (False, True),
            "stream_unary": (True, False),
            "stream_stream": (True, True),
        }
        if name not in kinds:
            raise AttributeError(name)
        return self._rec(*kinds[name])


def test_method_paths_from_generated_stubs() -> None:
    channel = _RecordingChannel()
    for mod in GRPC_MODULES:
        for name in dir(mod):
            if name.endswith("Stub"):
                getattr(mod, name)(channel)
    assert channel.paths == METHODS


@pytest.mark.parametrize("message", sorted(FIELDS))
def test_field_numbers(message: str) -> None:
    desc = _message(message)
    got = {name: desc.fields_by_name[name].number for name in FIELDS[message] if name in desc.fields_by_name}
    assert got == FIELDS[message]


@pytest.mark.parametrize("enum", sorted(ENUMS))
def test_enum_values(enum: str) -> None:
    desc = csi_pb2.DESCRIPTOR.pool.FindEnumTypeByName(enum)
    got = {name: desc.values_by_name[name].number for name in ENUMS[enum] if name in desc.values_by_name}
    assert got == ENUMS[enum]


def test_csi_custom_options_kept() -> None:
    pool = csi_pb2.DESCRIPTOR.pool
    secrets = pool.FindMessageTypeByName("csi.v1.NodePublishVolumeRequest").fields_by_name["secrets"]
    assert secrets.GetOptions().Extensions[csi_pb2.csi_secret] is True
    method = pool.FindMethodByName("csi.v1.Controller.ControllerGetVolume")
    assert method.GetOptions().Extensions[csi_pb2.alpha_method] is True
    svc = pool.FindServiceByName("csi.v1.SnapshotMetadata")
    assert svc.GetOptions().Extensions[csi_pb2.alpha_service] is True
    assert {e.number for e in csi_pb2.DESCRIPTOR.extensions_by_name.values()} == {1059, 1060}


def _message(full_name: str) -> Any:
    for fd in FILES:
        try:
            return fd.pool.FindMessageTypeByName(full_name)
        except KeyError:
            continue
    raise AssertionError(f"no message {full_name}")
