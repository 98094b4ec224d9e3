"""The alerts of daemonset/monitoring/ in a real Prometheus (Debian's ``prometheus``) scraping the deployed agent: the
PrometheusRule's rule groups loaded as the Operator would hand them over, the agent scraped on the node's network
namespace (it uses the host network there), and ``NodeplugDevicePluginNotRegistered`` seen firing while kubelet's
device-plugin registration socket is gone and resolved once it is back. Waits are on Prometheus's /api/v1/alerts;
their bounds only break a hang."""

from __future__ import annotations

import contextlib
import json
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import yaml

from support.host import REPO

if TYPE_CHECKING:
    from support.localcluster import Cluster  # the fixture's type

PROMETHEUS = shutil.which("prometheus")
PORT = 19090  # inside the node's network namespace only
KUBELET_SOCK = Path("/var/lib/kubelet/device-plugins/kubelet.sock")
ALERT = "NodeplugDevicePluginNotRegistered"

pytestmark = pytest.mark.skipif(PROMETHEUS is None, reason="prometheus is not installed (Debian's prometheus)")


@pytest.fixture
def prometheus(cluster: Cluster) -> Iterator[str]:
    """Prometheus in the node's netns, scraping the agent as the shipped PodMonitor does (job nodeplug, the node's
    name as ``node``) every 5 s and evaluating the shipped rules every 5 s; yields the netns to query it from."""
    assert PROMETHEUS is not None
    work = Path(tempfile.mkdtemp(prefix="npprom-", dir="/var/tmp"))
    rule = yaml.safe_load((REPO / "daemonset/monitoring/prometheusrule.yaml").read_text())
    (work / "rules.yaml").write_text(yaml.safe_dump(rule["spec"]))
    labels = {"node": cluster.node, "pod": cluster.agent_pod()}
    (work / "prometheus.yml").write_text(yaml.safe_dump({
        "global": {"scrape_interval": "5s", "evaluation_interval": "5s"},
        "rule_files": [str(work / "rules.yaml")],
        "scrape_configs": [{"job_name": "nodeplug", "static_configs": [{"targets": ["127.0.0.1:9450"],
                                                                         "labels": labels}]}],
    }))  # fmt: skip
    argv = ["ip", "netns", "exec", cluster.netns, PROMETHEUS, f"--config.file={work / 'prometheus.yml'}",
            f"--storage.tsdb.path={work / 'data'}", f"--web.listen-address=127.0.0.1:{PORT}"]  # fmt: skip
    with open(work / "prometheus.log", "wb") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
    try:
        cluster.wait("Prometheus scraping the agent", lambda: _up(cluster.netns), 120,
                     explain=(work / "prometheus.log").read_text()[-2000:])  # fmt: skip
        yield cluster.netns
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(30)
        shutil.rmtree(work, ignore_errors=True)


def _api(netns: str, path: str) -> Any:
    p = subprocess.run(["ip", "netns", "exec", netns, "curl", "-sf", f"http://127.0.0.1:{PORT}{path}"],
                       capture_output=True, text=True, timeout=30, check=False)  # fmt: skip
    return json.loads(p.stdout) if p.returncode == 0 and p.stdout else None


def _up(netns: str) -> bool:
    doc = _api(netns, "/api/v1/query?query=up%7Bjob%3D%22nodeplug%22%7D")
    return bool(doc and any(r["value"][1] == "1" for r in doc["data"]["result"]))


def alerts(netns: str, name: str) -> list[dict[str, Any]]:
    doc = _api(netns, "/api/v1/alerts")
    return [a for a in (doc or {}).get("data", {}).get("alerts", []) if a["labels"]["alertname"] == name]


def test_an_alert_fires_while_kubelets_registration_socket_is_gone_and_resolves(
    cluster: Cluster, prometheus: str
) -> None:
    assert not alerts(prometheus, ALERT)
    away = KUBELET_SOCK.with_name("kubelet.sock.away")
    KUBELET_SOCK.rename(away)
    try:
        # the agent sees kubelet's socket go (its registration is with a kubelet no longer there): 0 at once,
        # pending, then firing after the rule's 2 minutes
        cluster.wait(f"{ALERT} firing", lambda: any(a["state"] == "firing" and a["labels"].get("resource") == "fuse"
                                                    for a in alerts(prometheus, ALERT)), 300)  # fmt: skip
        (fuse,) = [a for a in alerts(prometheus, ALERT) if a["labels"]["resource"] == "fuse"]
        assert fuse["labels"]["node"] == cluster.node and fuse["labels"]["severity"] == "warning"
        assert "nodeplug.io/fuse" in fuse["annotations"]["summary"]
    finally:
        with contextlib.suppress(FileNotFoundError):
            away.rename(KUBELET_SOCK)
    # back: the agent registers with it again, the series goes to 1, the alert resolves
    cluster.wait(f"{ALERT} resolved", lambda: not alerts(prometheus, ALERT), 180)
    cluster.wait("fuse allocatable again", lambda: cluster.get("node", cluster.node)["status"]["allocatable"]
                 .get("nodeplug.io/fuse", "0") != "0", 60)  # fmt: skip
