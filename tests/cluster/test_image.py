"""The image daemonset/Dockerfile builds, as the node runs it (cluster-up builds it on a Debian base through the
PYTHON_IMAGE build argument, and the DaemonSet runs it): its command is the agent's, the CNI bundle is where
install-cni looks and answers, the node tools the plugins run are there, and no build tool is."""

from __future__ import annotations

import json
import subprocess
from typing import TYPE_CHECKING

from cni.install import bundle
from nodeplug import cli

if TYPE_CHECKING:
    from support.localcluster import Cluster  # the fixture's type

IMAGE = "localhost/nodeplug-test/nodeplug:1"
# mkfs.ext4/resize2fs, mkfs.xfs/xfs_growfs, btrfs, losetup/mount, ip, nft: what the CSI and CNI plugins run.
NODE_TOOLS = ["mkfs.ext4", "resize2fs", "mkfs.xfs", "xfs_growfs", "btrfs", "losetup", "mount", "umount", "ip", "nft"]


def test_the_image_runs_the_agent_with_the_bundle_where_install_cni_looks(cluster: Cluster) -> None:
    out = subprocess.run([cluster.crictl, f"--runtime-endpoint=unix://{cluster.containerd_socket}", "inspecti", "-o",
                          "json", IMAGE], capture_output=True, text=True, timeout=30, check=True).stdout  # fmt: skip
    config = json.loads(out)["info"]["imageSpec"]["config"]
    args = cli.build_parser().parse_args(config["Cmd"][1:])
    assert config["Cmd"][0] == "nodeplug" and args.command == "agent"
    assert str(args.config) == "/etc/nodeplug/agent.yaml"
    assert f"NODEPLUG_CNI_BUNDLE={bundle.DEFAULT_BUNDLE}" in config["Env"]


def test_the_image_holds_the_node_tools_and_no_build_tools(cluster: Cluster, ns: str) -> None:
    script = (
        f"for t in {' '.join(NODE_TOOLS)}; do command -v $t >/dev/null || echo missing $t; done; "
        "for t in gcc cc ld pyinstaller; do command -v $t >/dev/null && echo build-tool $t; done; "
        "python -c 'import PyInstaller' 2>/dev/null && echo build-tool PyInstaller; "
        'echo \'{"cniVersion":"1.0.0"}\' | env -i CNI_COMMAND=VERSION "$NODEPLUG_CNI_BUNDLE/nodeplug"; echo; '
        "nodeplug version"
    )
    pod = cluster.pod("image", "sh", "-c", script, restartPolicy="Never")
    pod["spec"]["containers"][0]["image"] = IMAGE
    cluster.apply(ns, pod)
    cluster.wait("the check pod done", lambda: cluster.get("-n", ns, "pod", "image")["status"].get("phase")
                 in ("Succeeded", "Failed"), 120)  # fmt: skip
    lines = cluster.kubectl("-n", ns, "logs", "image").splitlines()
    assert not [ln for ln in lines if ln.startswith(("missing", "build-tool"))], lines
    version = json.loads(next(ln for ln in lines if ln.startswith("{")))
    assert "1.0.0" in version["supportedVersions"]
    assert lines[-1].strip(), "nodeplug version printed nothing"
