"""The agent config: defaults, and one field-named line for each kind of mistake."""

from __future__ import annotations

from pathlib import Path

import pytest

from nodeplug.config import AgentConfig, ConfigError, load, parse


def problems(data: object) -> list[str]:
    with pytest.raises(ConfigError) as exc:
        parse(data)
    return exc.value.problems


def test_defaults_enable_every_plugin() -> None:
    cfg = load(None)
    assert isinstance(cfg, AgentConfig)
    assert cfg.root == Path("/")
    assert cfg.http.address == "127.0.0.1:9450"
    assert cfg.deviceplugin.enabled and cfg.csi.enabled and cfg.cni.enabled


def test_root_flag_overrides_file(tmp_path: Path) -> None:
    f = tmp_path / "c.yaml"
    f.write_text("root: /srv/x\n")
    assert load(f).root == Path("/srv/x")
    assert load(f, tmp_path).root == tmp_path


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        ({"bogus": 1}, "bogus: unknown key"),
        ({"csi": {"enabeld": True}}, "csi.enabeld: unknown key"),
        ({"csi": {"enabled": "maybe"}}, "csi.enabled: input should be a valid boolean"),
        ({"root": "relative/dir"}, "root: expected an absolute path, got 'relative/dir'"),
        ({"log_level": "loud"}, "log_level: input should be 'debug', 'info', 'warning' or 'error', got 'loud'"),
        ({"http": {"address": "9450"}}, "http.address: expected HOST:PORT"),
        ({"http": {"address": "127.0.0.1:99999"}}, "http.address: expected HOST:PORT with a port from 0 to 65535"),
        ({"http": {"address": "example.com:80"}}, "http.address: expected an IP address or localhost"),
        ({"http": "127.0.0.1:9450"}, "http: input should be a valid dictionary"),
        ({"shutdown_grace_seconds": -1}, "shutdown_grace_seconds: input should be greater than or equal to 0"),
        ({"shutdown_grace_seconds": "soon"}, "shutdown_grace_seconds: input should be a valid number"),
        ({"deviceplugin": []}, "deviceplugin: input should be a valid dictionary"),
        ({"cni": {"enabled": None}}, "cni.enabled: input should be a valid boolean, got None"),
        ({"cni": {"socket": "run/cni.sock"}}, "cni.socket: expected an absolute path, got 'run/cni.sock'"),
        ({"cluster_network": {"subnets_file": "s.json"}}, "cluster_network.subnets_file: expected an absolute path"),
        (
            {"cluster_network": {"subnets_file": "/var/lib/../../etc/x"}},
            "cluster_network.subnets_file: expected a path without '..' or NUL",
        ),
        (
            {"cni": {"cluster": {"mode": "direct"}}, "cluster_network": {"mode": "vxlan"}},
            "cni.cluster: moved to cluster_network, which is also given",
        ),
    ],
)
def test_each_mistake_names_its_field(data: object, expected: str) -> None:
    lines = problems(data)
    assert any(line.startswith(expected) for line in lines), lines


def test_every_problem_is_reported_at_once() -> None:
    lines = problems({"bogus": 1, "root": "x", "csi": {"enabled": "maybe"}})
    assert len(lines) == 3
    assert [line.split(":")[0] for line in lines] == ["root", "csi.enabled", "bogus"]


def test_top_level_must_be_a_mapping() -> None:
    assert problems(["a", "b"]) == ["(top level): expected a mapping of sections, got list"]


def test_empty_file_means_defaults(tmp_path: Path) -> None:
    f = tmp_path / "empty.yaml"
    f.write_text("")
    assert load(f) == load(None)


def test_invalid_yaml_names_line_and_column(tmp_path: Path) -> None:
    f = tmp_path / "bad.yaml"
    f.write_text("csi:\n  enabled: [true\n")
    with pytest.raises(ConfigError) as exc:
        load(f)
    assert exc.value.problems[0].startswith("line 3, column 1: not valid YAML")


def test_unreadable_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as exc:
        load(tmp_path / "missing.yaml")
    assert exc.value.problems == ["cannot read the config file: No such file or directory"]
