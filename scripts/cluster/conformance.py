"""scripts/conformance SUITE: the Kubernetes project's own e2e suites (``e2e.test`` of KUBE_ASSETS) on the local
cluster, with the suite's focus and skips, the repository list that points every image at the locally built ones
(scripts/cluster/e2eimages.py), a report directory, and a tally at the end.

Suites:
- ``networking``: ``[sig-network] Networking ... [Conformance]`` (pod <-> pod and node <-> pod, HTTP and UDP);
- ``storage``: the CSI External Storage suites for local.csi.nodeplug.io (tests/cluster/suites/*.yaml: what the
  driver supports, with the shipped StorageClass and VolumeSnapshotClass);
- ``netpol``: ``[sig-network] Netpol`` (NetworkPolicy; its probes go through Services, i.e. kube-proxy).

Every skip carries its reason (:data:`SUITES`); the README lists them. A skip is either one the specs cannot pass
here whatever is asked (``always``), or one the standard run leaves out (specs upstream marks [Slow] or
[Serial]); ``--focus`` selects among every spec of the suite but the first kind.

Standard library only, like the rest of scripts/cluster.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cluster import down, e2eimages, kubecache, up
from cluster.common import CACHE, KUBE_ASSETS, REPO, ClusterError, State, log
from cluster.nodes import from_state

DRIVERS = REPO / "tests" / "cluster" / "suites"


def _cap_sys_resource() -> bool:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("CapBnd:"):
            return bool(int(line.split()[1], 16) & (1 << 24))
    return False


@dataclass(frozen=True)
class Skip:
    pattern: str  # a Go regular expression on the spec's full text, for --ginkgo.skip
    reason: str
    always: bool = True  # False: left out of the standard run only; a --focus may select these
    applies: bool = True  # False: this machine has what the specs need; not skipped


@dataclass(frozen=True)
class Suite:
    name: str
    focus: str
    skips: tuple[Skip, ...] = ()
    driver: str = ""  # -storage.testdriver file under tests/cluster/suites


STORAGE_SKIPS = (
    Skip(r"\[Feature:Windows\]", "Windows nodes only"),
    Skip(r"\[Feature:SELinux\]", "need SELinux-enforcing nodes; this one has no SELinux"),
    Skip(
        r"\[Feature:VolumeAttributesClass\]",
        "VolumeAttributesClass is off by default in 1.32 and the driver has no ControllerModifyVolume",
    ),
    Skip(
        r"\[Feature:volumegroupsnapshot\]",
        "the shipped csi-snapshotter runs without its CSIVolumeGroupSnapshot feature gate (alpha API)",
    ),
    Skip(r"\[Disruptive\]", "they stop and start kubelet over SSH to the node; this cluster's node has no SSH"),
    Skip(
        r"volumeMode should not mount / map unused volumes in a pod",
        "their hostexec pod enters PID 1's mount namespace (nsenter), which this sandbox refuses",
    ),
    Skip(
        r"\[Testpattern: Dynamic PV \(default fs\)\(allowExpansion\)\] volume-expand|\[Testpattern: Generic "
        r"Ephemeral-volume \(default fs\).*should support expansion of pvcs created for ephemeral pvcs",
        "growing a mounted ext4 is the EXT4_IOC_RESIZE_FS ioctl, which needs CAP_SYS_RESOURCE; this machine's root "
        "lacks it. kubelet calls NodeExpandVolume on a staged (mounted) volume, offline expansion included (xfs and "
        "block volumes grow here)",
        applies=not _cap_sys_resource(),
    ),
    Skip(
        r"\[Serial\]",
        "volumeLimits makes csi.max_volumes_per_node + 1 (1001) volumes, the stress and performance specs hundreds, "
        "and 'any volume data source' needs a volume populator controller, not deployed",
        always=False,
    ),
    Skip(
        r"\[Slow\]",
        "upstream's specs of several minutes each (container restarts with subPath, volumeIO of large files, "
        "multi-pod access): left out to keep the run near 20 minutes on 2 cores",
        always=False,
    ),
)
NETPOL_SKIPS = (
    Skip(r"\[Feature:SCTPConnectivity\]", "this kernel has no SCTP", applies=not Path("/proc/net/sctp").exists()),
)
SUITES = {
    "networking": Suite("networking", r"\[sig-network\] Networking.*\[Conformance\]"),
    "storage": Suite("storage", r"External.Storage", STORAGE_SKIPS, driver="local.csi.nodeplug.io.yaml"),
    "netpol": Suite("netpol", r"\[sig-network\] Netpol\b", NETPOL_SKIPS),
}


def selection(suite: Suite, focus: str | None) -> tuple[str, list[Skip]]:
    """The --ginkgo.focus and the skips for a run: ``focus`` narrows the suite (a spec matches the suite's focus and,
    after it, ``focus``) and lifts the skips that are not ``always``."""
    skips = [s for s in suite.skips if s.applies and (s.always or focus is None)]
    if focus is None:
        return suite.focus, skips
    re.compile(focus)  # Go's syntax is close enough to catch a typo before a cluster is made
    return f"(?:{suite.focus}).*(?:{focus})", skips


# ---------------------------------------------------------------- the report


@dataclass(frozen=True)
class Tally:
    passed: list[str]
    failed: list[tuple[str, str]]  # spec, first line of its failure
    skipped: list[tuple[str, str]]  # spec, why (skipped at run time: the driver's capabilities, one node, ...)
    selected: int  # specs the focus and skips left to run
    seconds: float

    @property
    def ok(self) -> bool:
        return not self.failed and bool(self.passed)


def read_report(path: Path) -> Tally:
    """Ginkgo's JSON report: specs not selected are ``skipped`` without an attempt; specs that skipped themselves at
    run time (``e2eskipper.Skipf``) are ``skipped`` with one, and say why."""
    suites: list[dict[str, Any]] = json.loads(path.read_text())
    passed, failed, skipped, selected, seconds = [], [], [], 0, 0.0
    for suite in suites:
        seconds += suite.get("RunTime", 0) / 1e9
        for spec in suite.get("SpecReports", []):
            if spec.get("LeafNodeType") != "It":
                if spec.get("State") not in ("passed", "skipped"):  # a BeforeSuite failing fails everything
                    failed.append((str(spec.get("LeafNodeType")), _first_line(spec)))
                continue
            if spec.get("NumAttempts", 0) == 0:
                continue
            selected += 1
            text = " ".join([*spec.get("ContainerHierarchyTexts", []), spec.get("LeafNodeText", "")])
            state = spec.get("State")
            if state == "passed":
                passed.append(text)
            elif state == "skipped":
                skipped.append((text, _first_line(spec)))
            else:
                failed.append((text, f"{state}: {_first_line(spec)}"))
    return Tally(passed, failed, skipped, selected, seconds)


def _first_line(spec: dict[str, Any]) -> str:
    message = str((spec.get("Failure") or {}).get("Message", "")).strip()
    return message.splitlines()[0][:300] if message else ""


def summary(suite: Suite, tally: Tally, skips: list[Skip], report_dir: Path) -> str:
    lines = [f"{suite.name}: {len(tally.passed)} passed, {len(tally.failed)} failed, {len(tally.skipped)} skipped "
             f"at run time, of {tally.selected} selected; {tally.seconds:.0f} s"]  # fmt: skip
    for spec, why in tally.failed:
        lines.append(f"  FAILED {spec}\n         {why}")
    reasons = Counter(_reason(why) for _, why in tally.skipped)
    for why, n in reasons.most_common():
        lines.append(f"  skipped at run time ({n}): {why}")
    for s in skips:
        lines.append(f"  not selected: {s.pattern}: {s.reason}")
    lines.append(f"  report: {report_dir}")
    return "\n".join(lines)


def _reason(why: str) -> str:
    """A run-time skip's message without the spec-specific part (for grouping)."""
    return re.sub(r"\s+", " ", why).strip()[:200] or "(no reason given)"


# ---------------------------------------------------------------- running it


def cluster_dir_ready(cluster_dir: Path) -> bool:
    state = cluster_dir / "state.json"
    return state.is_file() and bool(json.loads(state.read_text()).get("ready"))


def driver_file(suite: Suite, state: State, report_dir: Path) -> Path:
    """The suite's driver file; on a cluster of several nodes, a copy naming the node the suite's pods run on
    (``ClientNodeName``, as upstream's own node-local driver, csi-hostpath, pins them to one node): the specs place a
    claim restored from a snapshot, or cloned, with its pod wherever the scheduler likes, and the scheduler knows
    nothing of where the source is; a node-local volume's snapshot or clone can only be made on the source's node."""
    every = from_state(state)
    if len(every) == 1:
        return DRIVERS / suite.driver
    copy = report_dir / suite.driver
    copy.write_text((DRIVERS / suite.driver).read_text() + f"ClientNodeName: {every[0].name}\n")
    return copy


def run_suite(suite: Suite, focus: str | None, cluster_dir: Path) -> Tally:
    """e2e.test against the cluster in ``cluster_dir``; the report in DIR/conformance/SUITE-<time>."""
    state = State(cluster_dir)
    focus_re, skips = selection(suite, focus)
    report_dir = cluster_dir / "conformance" / f"{suite.name}-{time.strftime('%Y%m%dT%H%M%S', time.gmtime())}"
    report_dir.mkdir(parents=True)
    repo_list = report_dir / "repo-list.yaml"
    repo_list.write_text(e2eimages.repo_list())
    e2e = kubecache.unpack(KUBE_ASSETS / "e2e.test.xz", CACHE)
    argv = [
        str(e2e), f"--kubeconfig={cluster_dir / 'kubeconfig'}", f"--kubectl-path={state.data['kubectl']}",
        "--provider=local", f"--report-dir={report_dir}", f"--kube-test-repo-list={repo_list}",
        f"--ginkgo.focus={focus_re}", "--ginkgo.v", "--ginkgo.no-color", "--ginkgo.timeout=6h",
        f"--ginkgo.json-report={report_dir / 'report.json'}",
    ]  # fmt: skip
    argv += [f"--ginkgo.skip={s.pattern}" for s in skips]
    if suite.driver:
        argv.append(f"-storage.testdriver={driver_file(suite, state, report_dir)}")
    (report_dir / "command").write_text(" ".join(argv) + "\n")
    log(f"{suite.name}: e2e.test running (log: {report_dir / 'e2e.log'})")
    with open(report_dir / "e2e.log", "wb") as out:
        p = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                             start_new_session=True, cwd=report_dir)  # fmt: skip
        try:
            p.wait()
        finally:
            if p.poll() is None:  # interrupted: end e2e.test (it deletes its namespaces on SIGTERM)
                os.killpg(p.pid, signal.SIGTERM)
                try:
                    p.wait(60)
                except subprocess.TimeoutExpired:
                    os.killpg(p.pid, signal.SIGKILL)
                    p.wait()
    if not (report_dir / "report.json").is_file():
        raise ClusterError(f"e2e.test exited {p.returncode} without a report; see {report_dir / 'e2e.log'}")
    tally = read_report(report_dir / "report.json")
    text = summary(suite, tally, skips, report_dir)
    (report_dir / "summary.txt").write_text(text + "\n")
    print(text, flush=True)
    return tally


def main(suite_name: str, focus: str | None, cluster_dir: Path | None, nodes: int = 1) -> int:
    """Run ``suite_name`` on the cluster in ``cluster_dir`` (made there first if it holds none, and then removed
    again; with no DIR, in a new directory under /var/tmp); 0 when every selected spec passed or skipped itself."""
    suite = SUITES[suite_name]
    for binary in ("e2e.test.xz", "agnhost.xz"):
        if not (KUBE_ASSETS / binary).is_file():
            raise ClusterError(f"{KUBE_ASSETS / binary}: missing (the upstream suites and their workload)")
    selection(suite, focus)
    if cluster_dir is None:
        cluster_dir = Path(tempfile.mkdtemp(prefix="nodeplug-conformance-", dir="/var/tmp"))
    signal.signal(signal.SIGTERM, _exit_on_signal)  # so that a cluster this made is taken down
    made = not cluster_dir_ready(cluster_dir)
    try:
        started = time.monotonic()
        if made:
            log(f"no cluster in {cluster_dir}: bringing one up (scripts/cluster-up)")
            up.up(cluster_dir, nodes)
        tally = run_suite(suite, focus, cluster_dir)
        print(f"{suite.name}: wall time {time.monotonic() - started:.0f} s (cluster-up included: {made})", flush=True)
        return 0 if tally.ok else 1
    finally:
        if made:
            down.teardown(cluster_dir)


def _exit_on_signal(signum: int, _frame: object) -> None:
    sys.exit(128 + signum)
