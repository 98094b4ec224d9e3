"""The deviceplugin config section: defaults and field-named errors through the agent's config loader."""

from __future__ import annotations

from typing import Any

import pytest

from deviceplugin.config import Config, Resource
from nodeplug.config import ConfigError, parse


def problems(section: dict[str, Any]) -> list[str]:
    with pytest.raises(ConfigError) as e:
        parse({"deviceplugin": section})
    return e.value.problems


def test_defaults_offer_fuse_and_tun() -> None:
    cfg = Config()
    assert cfg.host_root == "/"
    assert [(r.name, r.devices, r.resource_name, r.socket_name) for r in cfg.resources] == [
        ("fuse", ["/dev/fuse"], "nodeplug.io/fuse", "nodeplug-fuse.sock"),
        ("tun", ["/dev/net/tun"], "nodeplug.io/tun", "nodeplug-tun.sock"),
    ]
    assert parse({}).deviceplugin == cfg


def test_full_resource_parses() -> None:
    cfg = parse(
        {
            "deviceplugin": {
                "host_root": "/host",
                "resources": [
                    {
                        "name": "vfio-nic",
                        "pci": [{"vendor": "8086", "device": "1572", "class_prefix": "0200"}],
                        "nodes": ["/dev/vfio/vfio"],
                        "replicas": 4,
                        "allocation": "pack",
                        "permissions": "rwm",
                        "cdi": True,
                        "mounts": [{"host_path": "/lib/firmware", "container_path": "/lib/firmware"}],
                        "env": {"MODE": "x"},
                        "health": {"command": ["/bin/check", "{address}"], "timeout_seconds": 2},
                        "reset": {"command": ["/bin/reset", "{id}"]},
                    },
                    {"name": "serial", "usb": [{"vendor": "0403", "product": "6001", "serial": "A1"}]},
                ],
            }
        }
    ).deviceplugin
    nic = cfg.resources[0]
    assert nic.pci[0].nodes == ["/dev/vfio/{iommu_group}"]
    assert nic.env_name == "NODEPLUG_VFIO_NIC_DEVICES"
    assert nic.health is not None and nic.health.interval_seconds == 10


@pytest.mark.parametrize(
    ("section", "expected"),
    [
        (
            {"resources": [{"name": "a", "devices": ["/dev/a"]}, {"name": "b", "devices": ["/dev/b"]},
                           {"name": "c", "pci": [{"vendor": "10de0"}]}]},
            "deviceplugin.resources[2].pci[0].vendor: expected 4 hex digits, got '10de0'",
        ),
        ({"resources": [{"name": "A_b", "devices": ["/dev/a"]}]},
         "deviceplugin.resources[0].name: expected a DNS label"),
        ({"resources": [{"name": "a", "devices": ["/dev/a", "dev/b"]}]},
         "deviceplugin.resources[0].devices[1]: expected an absolute path, got 'dev/b'"),
        ({"resources": [{"name": "a", "devices": ["/etc/passwd"]}]},
         "deviceplugin.resources[0].devices[0]: expected a path under /dev/, got '/etc/passwd'"),
        ({"resources": [{"name": "a"}]}, "deviceplugin.resources[0]: expected at least one matcher"),
        ({"resources": [{"name": "a", "pci": [{"nodes": ["/dev/x"]}]}]},
         "deviceplugin.resources[0].pci[0]: expected at least one of vendor, device, class_prefix"),
        ({"resources": [{"name": "a", "usb": [{"vendor": "0403"}]}]},
         "deviceplugin.resources[0].usb[0].product: required field is missing"),
        ({"resources": [{"name": "a", "devices": ["/dev/a"], "replicas": 0}]},
         "deviceplugin.resources[0].replicas: input should be greater than or equal to 1, got 0"),
        ({"resources": [{"name": "a", "devices": ["/dev/a"], "permissions": "r"}]},
         "deviceplugin.resources[0].permissions: input should be 'rw' or 'rwm', got 'r'"),
        ({"resources": [{"name": "a", "devices": ["/dev/a"], "health": {"command": ["x", "{dev}"]}}]},
         "deviceplugin.resources[0].health.command: unknown placeholder {dev}"),
        ({"resources": [{"name": "a", "devices": ["/dev/a"], "colour": "red"}]},
         "deviceplugin.resources[0].colour: unknown key"),
        ({"resources": [{"name": "a", "devices": ["/dev/a"]}, {"name": "a", "devices": ["/dev/b"]}]},
         "deviceplugin.resources: expected unique resource names, 'a' appears twice"),
        ({"host_root": "host"}, "deviceplugin.host_root: expected an absolute path, got 'host'"),
        ({"resources": [{"name": "a", "devices": ["/dev/a"], "env": {"1X": "y"}}]},
         "deviceplugin.resources[0].env: expected environment variable names like FOO_BAR"),
    ],
)  # fmt: skip
def test_errors_name_the_field(section: dict[str, Any], expected: str) -> None:
    got = problems(section)
    assert any(p.startswith(expected) for p in got), got


def test_resource_names() -> None:
    r = Resource(name="usb-serial", devices=["/dev/ttyUSB*"])
    assert (r.resource_name, r.socket_name, r.env_name) == (
        "nodeplug.io/usb-serial",
        "nodeplug-usb-serial.sock",
        "NODEPLUG_USB_SERIAL_DEVICES",
    )
