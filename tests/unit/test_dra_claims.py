"""The parsers of what the API server and kubelet send the DRA driver: claims, names, published slices."""

from __future__ import annotations

import uuid
from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from lightkube.resources import resource_v1, resource_v1beta1

from deviceplugin.dra import names, slices
from deviceplugin.dra.claims import AllocatedDevice, ClaimAllocation, ClaimError, parse_claim

DRIVER = "devices.nodeplug.io"
UID = "0f6a3c52-9d0e-4a51-8d1e-0c7a2b9d4e11"


def claim(results: list[dict[str, Any]] | None = None, **meta: Any) -> dict[str, Any]:
    obj: dict[str, Any] = {
        "apiVersion": "resource.k8s.io/v1beta1",
        "kind": "ResourceClaim",
        "metadata": {"namespace": "ns", "name": "c", "uid": UID, **meta},
        "spec": {"devices": {"requests": [{"name": "dev", "deviceClassName": "fuse.devices.nodeplug.io"}]}},
    }
    if results is not None:
        obj["status"] = {"allocation": {"devices": {"results": results}}}
    return obj


def parse(obj: dict[str, Any], version: str = "v1beta1") -> ClaimAllocation:
    """The claim as the driver gets it: decoded into the version's model (checked against its schema, as the
    client does at the edge), then parsed."""
    kind = resource_v1.ResourceClaim if version == "v1" else resource_v1beta1.ResourceClaim
    return parse_claim(kind.from_dict(obj), namespace="ns", name="c", uid=UID, driver=DRIVER)


@pytest.mark.parametrize("version", ["v1beta1", "v1"])
def test_this_drivers_results_only(version: str) -> None:
    got = parse(
        claim(
            [
                {"request": "dev", "driver": DRIVER, "pool": "node-1", "device": "fuse-fuse"},
                {"request": "gpu", "driver": "gpu.example.com", "pool": "node-1", "device": "gpu-0"},
                {"request": "dev", "driver": DRIVER, "pool": "node-1", "device": "tun-net-tun", "adminAccess": True},
            ]
        ),
        version,
    )
    assert got.devices == (
        AllocatedDevice("dev", "node-1", "fuse-fuse"),
        AllocatedDevice("dev", "node-1", "tun-net-tun", True),
    )


@pytest.mark.parametrize(
    "mutate, problem",
    [
        (lambda o: o["metadata"].update(uid=str(uuid.uuid4())), "deleted and made again"),
        (lambda o: o["metadata"].update(name="other"), "metadata.name"),
        (lambda o: o["metadata"].update(namespace="other"), "metadata.namespace"),
        (lambda o: o.pop("status"), "not allocated"),
        (lambda o: o["status"]["allocation"]["devices"]["results"][0].update(device="../etc"), "device name"),
        (lambda o: o["status"]["allocation"]["devices"]["results"][0].update(pool="A B"), "pool name"),
        (lambda o: o["status"]["allocation"]["devices"]["results"][0].update(request=""), "request name"),
        (lambda o: o["status"]["allocation"]["devices"]["results"].append(
            {"request": "b", "driver": DRIVER, "pool": "node-1", "device": "fuse-fuse"}), "allocated twice"),
        (lambda o: o["status"]["allocation"]["devices"].update(
            config=[{"source": "FromClass", "requests": ["dev"], "opaque": {"driver": DRIVER, "parameters": {}}}]),
         "no opaque"),
    ],
)  # fmt: skip
def test_refusals_name_the_problem(mutate: Any, problem: str) -> None:
    obj = claim([{"request": "dev", "driver": DRIVER, "pool": "node-1", "device": "fuse-fuse"}])
    mutate(obj)
    with pytest.raises(ClaimError, match=problem) as e:
        parse(obj)
    assert "ns/c" in str(e.value)


# Any JSON the API server might be made to send.
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=12), children, max_size=5),
    max_leaves=30,
)


def check_success(got: ClaimAllocation) -> None:
    """What any claim the parser accepts must satisfy: kubelet's claim, this driver's devices, well-formed, each
    device once (admin access aside)."""
    assert (got.namespace, got.name, got.uid) == ("ns", "c", UID)
    plain = [(d.pool, d.device) for d in got.devices if not d.admin_access]
    assert len(plain) == len(set(plain))
    for d in got.devices:
        assert names.is_dns_label(d.device)
        assert names.check_pool(d.pool) == d.pool and names.check_request(d.request) == d.request


@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow])
@given(json_values, st.sampled_from(["v1beta1", "v1"]))
def test_any_json_is_refused_at_the_edge_or_by_the_parser(obj: Any, version: str) -> None:
    """Not of the schema: the edge refuses it (msgspec, as the client does). Of the schema: ClaimError naming the
    claim, or an allocation that keeps the parser's promises."""
    try:
        got = parse(obj if isinstance(obj, dict) else {"metadata": obj}, version)
    except msgspec.ValidationError:
        return
    except ClaimError as e:
        assert str(e).startswith("ResourceClaim ns/c")
        return
    check_success(got)


result_fields = st.fixed_dictionaries(
    {
        "request": st.text(max_size=70) | st.sampled_from(["dev", "a/b", "DEV", "x" * 64]),
        "driver": st.sampled_from([DRIVER, "other.io"]),
        "pool": st.text(max_size=300) | st.sampled_from(["node-1", "a/b", "", "a" * 300]),
        "device": st.text(max_size=70) | st.sampled_from(["fuse-fuse", "-x", "a" * 64, "a.b"]),
    },
    optional={"adminAccess": st.booleans()},
)
configs = st.lists(
    st.fixed_dictionaries({"source": st.sampled_from(["FromClass", "FromClaim"])}, optional={
        "opaque": st.fixed_dictionaries({"driver": st.sampled_from([DRIVER, "other.io"]), "parameters": st.just({})})
    }),
    max_size=3,
)  # fmt: skip


@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(result_fields, max_size=6), configs)
def test_hostile_results(results: list[dict[str, Any]], config: list[dict[str, Any]]) -> None:
    """Results of the schema with hostile values: ClaimError naming the claim, or an allocation of exactly this
    driver's results, each well-formed."""
    obj = claim(results)
    obj["status"]["allocation"]["devices"]["config"] = config
    try:
        got = parse(obj)
    except ClaimError as e:
        assert str(e).startswith("ResourceClaim ns/c")
        return
    check_success(got)
    ours = [r for r in results if r["driver"] == DRIVER]
    assert [(d.request, d.pool, d.device, d.admin_access) for d in got.devices] == [
        (r["request"], r["pool"], r["device"], r.get("adminAccess", False)) for r in ours
    ]
    assert not any(c.get("opaque", {}).get("driver") == DRIVER for c in config)


@given(st.text(max_size=70))
def test_name_checks_never_accept_bad_names(text: str) -> None:
    for check, ok in ((names.check_namespace, names.is_dns_label), (names.check_device, names.is_dns_label)):
        try:
            check(text)
        except names.NameError_:
            assert not ok(text)
        else:
            assert ok(text) and len(text) <= 63 and "/" not in text and ".." not in text


def test_uid_check() -> None:
    assert names.check_uid(UID) == UID
    for bad in ("", UID.upper(), UID + "0", "../" + UID[3:], None, 7):
        with pytest.raises(names.NameError_, match="uid"):
            names.check_uid(bad)


@given(st.lists(st.tuples(st.sampled_from(["fuse", "tun", "vfio-nic"]), st.text(min_size=1, max_size=90)), max_size=20))
def test_device_names_are_unique_dns_labels(pairs: list[tuple[str, str]]) -> None:
    got = names.device_names(list(dict.fromkeys(pairs)))
    assert all(names.is_dns_label(n) for n in got.values())
    assert len(set(got.values())) == len(got)


def test_device_names_readable() -> None:
    got = names.device_names([("fuse", "fuse"), ("vfio-nic", "0000:3b:00.0"), ("serial", "1-1.2")])
    assert got == {
        ("fuse", "fuse"): "fuse-fuse",
        ("vfio-nic", "0000:3b:00.0"): "vfio-nic-0000-3b-00-0",
        ("serial", "1-1.2"): "serial-1-1-2",
    }
    clash = names.device_names([("r", "a_b"), ("r", "a.b")])
    assert len(set(clash.values())) == 2 and all(n.startswith("r-a-b-") for n in clash.values())


# ---------------------------------------------------------------- published slices, read back


def _slice(version: str, devices: list[slices.SliceDevice], gen: int = 3) -> slices.Slice:
    obj = slices.slice_object(
        version=version, driver=DRIVER, node="n1", node_uid="u", generation=gen, count=1, devices=devices, name="s"
    )
    assert obj.metadata is not None
    obj.metadata.resourceVersion = "17"
    return obj


@pytest.mark.parametrize("version", ["v1beta1", "v1"])
def test_slices_read_back_as_written(version: str) -> None:
    devs = [
        slices.SliceDevice("fuse-fuse", slices.attributes("fuse", "node", "/dev/fuse", 0)),
        slices.SliceDevice(
            "nic-0000-3b-00-0", slices.attributes("nic", "pci", "/dev/vfio/7", None, "0000:3b:00.0", "8086", "1572")
        ),
    ]
    obj = _slice(version, devs)
    wire = obj.to_dict()  # as sent to the API server
    assert wire["apiVersion"] == f"resource.k8s.io/{version}" and wire["kind"] == "ResourceSlice"
    if version == "v1beta1":
        assert wire["spec"]["devices"][0]["basic"]["attributes"]["numaNode"] == {"int": 0}
    else:
        assert wire["spec"]["devices"][1]["attributes"]["pciAddress"] == {"string": "0000:3b:00.0"}
    assert wire["metadata"]["ownerReferences"] == [
        {"apiVersion": "v1", "kind": "Node", "name": "n1", "uid": "u", "controller": True}
    ]
    obj = type(obj).from_dict(wire)  # as the API server sends it back
    seen = slices.observe(obj, version=version, driver=DRIVER, node="n1")
    assert seen is not None and seen.generation == 3 and seen.resource_version == "17"
    assert slices.up_to_date([seen], slices.chunks(devs))
    assert not slices.up_to_date([seen], slices.chunks(devs[:1]))
    assert slices.observe(obj, version=version, driver="other.io", node="n1") is None
    assert slices.observe(obj, version=version, driver=DRIVER, node="n2") is None


def test_attribute_values_the_api_refuses_are_left_out() -> None:
    attrs = dict(slices.attributes("serial", "usb", "/dev/ttyUSB0", None, "1-1", "0403", "6001", "S" * 65))
    assert "serial" not in attrs and attrs["vendor"] == "0403"


def test_big_pools_span_slices() -> None:
    devs = [slices.SliceDevice(f"d-{i:04d}", ()) for i in range(300)]
    parts = slices.chunks(devs)
    assert [len(p) for p in parts] == [128, 128, 44]


def slice_of(spec: Any, version: str) -> slices.Slice | None:
    """``spec`` as a slice of the version's model, or None when the edge refuses it (not of the schema)."""
    kind = resource_v1.ResourceSlice if version == "v1" else resource_v1beta1.ResourceSlice
    try:
        return kind.from_dict({"metadata": {"name": "s", "resourceVersion": "1"}, "spec": spec})
    except msgspec.ValidationError:
        return None


hostile_specs = st.fixed_dictionaries(
    {"driver": st.sampled_from([DRIVER, "x.io"]), "pool": st.fixed_dictionaries({
        "name": st.sampled_from(["n1", "n2"]), "generation": st.integers(-3, 3),
        "resourceSliceCount": st.integers(-1, 3)})},
    optional={"nodeName": st.sampled_from(["n1", "n2"]),
              "devices": st.lists(st.fixed_dictionaries({"name": st.text(max_size=8)}, optional={
                  "attributes": json_values, "basic": st.fixed_dictionaries({}, optional={"attributes": json_values})}),
                  max_size=3)},
)  # fmt: skip


@settings(max_examples=300)
@given(st.one_of(json_values, hostile_specs), st.sampled_from(["v1beta1", "v1"]))
def test_observe_survives_any_object(spec: Any, version: str) -> None:
    """Whatever a slice of the schema says: not this driver's node's slice (None), or what it says, read exactly;
    one whose devices cannot be read is never up to date."""
    obj = slice_of(spec, version)
    if obj is None:
        return
    got = slices.observe(obj, version=version, driver=DRIVER, node="n1")
    if got is None:
        assert (obj.spec.driver, obj.spec.nodeName) != (DRIVER, "n1")
        return
    assert (got.name, got.resource_version) == ("s", "1")
    assert (got.generation, got.count) == (obj.spec.pool.generation, obj.spec.pool.resourceSliceCount)
    if got.devices is None:  # unreadable: rewritten, never taken as the desired state
        assert not slices.up_to_date([got], [])
        assert not slices.up_to_date([got], [()])
    else:
        assert [d.name for d in got.devices] == [d.name for d in obj.spec.devices or ()]
        assert all(isinstance(v, str | int | bool) for d in got.devices for _, v in d.attributes)
