"""When the VXLAN device's transmit checksum offload is wanted (cni.cluster.offload; the device itself is tested in
tests/node/test_cluster_kernel.py)."""

from __future__ import annotations

import pytest

from cni.cluster import offload
from cni.cluster.config import ClusterConfig


def test_auto_is_off_before_kernel_5_7_and_true_and_false_say_what_they_mean() -> None:
    cases = {"4.19.0-27-amd64": False, "5.4.0-150-generic": False, "5.6.19": False, "5.7.0": True,
             "5.15.0-91-generic": True, "6.18.1": True, "garbage": False, "": False, "6": False}  # fmt: skip
    assert {release: offload.wanted("auto", release) for release in cases} == cases
    assert offload.wanted(True, "4.19.0") and not offload.wanted(False, "6.18.1")


def test_the_config_takes_auto_or_a_boolean() -> None:
    """As every boolean of the agent config: YAML's true/false, and the words pydantic reads as them (on/off)."""
    assert ClusterConfig().vxlan.tx_checksum_offload == "auto"
    for value, means in (("auto", "auto"), (True, True), (False, False), ("off", False), ("on", True)):
        config = ClusterConfig.model_validate({"vxlan": {"tx_checksum_offload": value}})
        assert config.vxlan.tx_checksum_offload == means
    for bad in ("sometimes", 2, None, [False]):
        with pytest.raises(ValueError):
            ClusterConfig.model_validate({"vxlan": {"tx_checksum_offload": bad}})
