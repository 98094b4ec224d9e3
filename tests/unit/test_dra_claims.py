"""The parsers of what the API server and kubelet send the DRA driver: claims, names, published slices."""

from __future__ import annotations

import contextlib
import copy
import uuid
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from deviceplugin.dra import names, slices
from deviceplugin.dra.claims import AllocatedDevice, ClaimError, parse_claim

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


def parse(obj: object) -> Any:
    return parse_claim(obj, namespace="ns", name="c", uid=UID, driver=DRIVER)


def test_this_drivers_results_only() -> None:
    got = parse(
        claim(
            [
                {"request": "dev", "driver": DRIVER, "pool": "node-1", "device": "fuse-fuse"},
                {"request": "gpu", "driver": "gpu.example.com", "pool": "node-1", "device": "gpu-0"},
                {"request": "dev", "driver": DRIVER, "pool": "node-1", "device": "tun-net-tun", "adminAccess": True},
            ]
        )
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
        (lambda o: o["status"]["allocation"]["devices"].update(results="x"), "expected list"),
        (lambda o: o["status"]["allocation"]["devices"]["results"][0].update(device="../etc"), "device name"),
        (lambda o: o["status"]["allocation"]["devices"]["results"][0].update(pool="A B"), "pool name"),
        (lambda o: o["status"]["allocation"]["devices"]["results"][0].update(request=""), "request name"),
        (lambda o: o["status"]["allocation"]["devices"]["results"][0].update(adminAccess="yes"), "expected bool"),
        (lambda o: o["status"]["allocation"]["devices"]["results"].append(
            {"request": "b", "driver": DRIVER, "pool": "node-1", "device": "fuse-fuse"}), "allocated twice"),
        (lambda o: o["status"]["allocation"]["devices"].update(
            config=[{"requests": ["dev"], "opaque": {"driver": DRIVER, "parameters": {}}}]), "no opaque"),
    ],
)  # fmt: skip
def test_refusals_name_the_problem(mutate: Any, problem: str) -> None:
    obj = claim([{"request": "dev", "driver": DRIVER, "pool": "node-1", "device": "fuse-fuse"}])
    mutate(obj)
    with pytest.raises(ClaimError, match=problem) as e:
        parse(obj)
    assert "ns/c" in str(e.value)


# Any JSON the API server might be made to send: the parser answers or raises ClaimError, nothing else.
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=12), children, max_size=5),
    max_leaves=30,
)


@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow])
@given(json_values)
def test_any_json_is_refused_cleanly(obj: Any) -> None:
    with contextlib.suppress(ClaimError):
        parse(obj)


result_fields = st.fixed_dictionaries(
    {},
    optional={
        "request": json_values | st.sampled_from(["dev", "a/b", "DEV", "x" * 64]),
        "driver": st.sampled_from([DRIVER, "other.io", 3, None]),
        "pool": json_values | st.sampled_from(["node-1", "a/b", "", "a" * 300]),
        "device": json_values | st.sampled_from(["fuse-fuse", "-x", "a" * 64, "a.b"]),
        "adminAccess": json_values,
    },
)


@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(result_fields, max_size=6), json_values)
def test_hostile_results(results: list[dict[str, Any]], config: Any) -> None:
    obj = claim(results)
    obj["status"]["allocation"]["devices"]["config"] = config
    try:
        got = parse(obj)
    except ClaimError:
        return
    for d in got.devices:  # whatever passes is well-formed
        assert names.is_dns_label(d.device)
        names.check_pool(d.pool)
        names.check_request(d.request)


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


def _slice(version: str, devices: list[slices.SliceDevice], gen: int = 3) -> dict[str, Any]:
    obj = slices.slice_object(
        version=version, driver=DRIVER, node="n1", node_uid="u", generation=gen, count=1, devices=devices, name="s"
    )
    obj["metadata"]["resourceVersion"] = "17"
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
    if version == "v1beta1":
        assert obj["spec"]["devices"][0]["basic"]["attributes"]["numaNode"] == {"int": 0}
    else:
        assert obj["spec"]["devices"][1]["attributes"]["pciAddress"] == {"string": "0000:3b:00.0"}
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


@settings(max_examples=300)
@given(json_values)
def test_observe_survives_any_object(spec: Any) -> None:
    obj = {"metadata": {"name": "s", "resourceVersion": "1"}, "spec": spec}
    for version in ("v1beta1", "v1"):
        got = slices.observe(obj, version=version, driver=DRIVER, node="n1")
        if got is not None:  # a slice that is there but unreadable is never "up to date"
            assert not slices.up_to_date([got], [])
            assert got.devices is None or all(isinstance(d, slices.SliceDevice) for d in got.devices)


@settings(max_examples=200)
@given(st.lists(json_values, max_size=4), st.sampled_from(["v1beta1", "v1"]))
def test_observed_devices_hostile(devices: list[Any], version: str) -> None:
    got = slices.observed_devices(copy.deepcopy(devices), version)
    assert got is None or all(isinstance(d, slices.SliceDevice) for d in got)
