"""The Kubernetes project's own suites judge nodeplug on the tier's cluster: ``scripts/conformance`` (e2e.test of
KUBE_ASSETS, the locally built agnhost and busybox images) run on it, as anyone runs it by hand, with a pinned subset
of each suite; any spec failing, or skipping itself, fails the test.

The storage subset (External Storage, driver local.csi.nodeplug.io with the shipped nodeplug-local and
nodeplug-snapshot classes) takes one spec per thing the driver claims, on the patterns users meet most:

- provisioning: a dynamically provisioned filesystem volume and a block volume store data across pods;
- snapshots: a snapshot's fields, a restore after the source changed, deletion of snapshot and content; the same
  for a pre-provisioned snapshot (a VolumeSnapshotContent made by hand naming an existing snapshot, which the node
  holding it adopts; retain policy, so the snapshot outlives its API objects); a claim restored from a snapshot;
- clones: a claim from a claim, filesystem and block;
- expansion: a block volume grown while no pod uses it, and one grown while its pod runs (filesystem growth is the
  tier's own test_volumes: growing a mounted ext4 needs CAP_SYS_RESOURCE, which some machines' root lacks);
- capacity: CSIStorageCapacity objects published for the class; topology: a WaitForFirstConsumer claim with
  allowedTopologies provisioned on the node and its pod scheduled there.

The Netpol subset (``[sig-network] Netpol``, the probes exec'ing ``agnhost connect`` in pods of three namespaces
and going through each server pod's Service, so kube-proxy's DNAT comes before the policy's forward hook) takes one
spec per thing NetworkPolicy enforcement offers:

- isolation: a policy of both types selecting every pod of a namespace ('default-deny-all': ingress and egress);
- ingress peers: by pod label, by namespace label (another namespace only), and by both in one peer;
- ports: a numeric port (TCP; the others of the same pod stay closed), a named container port on egress (resolved on
  each destination pod), and UDP; ``endPort`` has no probing spec upstream (only the API one), the node tier's
  tests/node/test_policy_kernel.py sends packets through a range;
- ``ipBlock`` with ``except`` (egress to the server's /24 less the server's own address);
- a policy updated while its pods run ("should enforce updated policy": the new rules reach existing pods).

Each spec makes its 9 pods and 9 Services anew and probes all 81 pairs (twice when the first try is wrong): the 9
took 136 s on 2 cores.

The whole suites (``scripts/conformance networking|storage|netpol``) are run by hand; the README keeps their tally.
"""

from __future__ import annotations

import re
import subprocess
from typing import TYPE_CHECKING

import pytest

from support import kubeassets
from support.host import REPO

if TYPE_CHECKING:
    from support.localcluster import Cluster  # the fixture's type

CONFORMANCE = REPO / "scripts" / "conformance"

STORAGE_SUBSET = [
    "[Testpattern: Dynamic PV (default fs)] volumes should store data",
    "[Testpattern: Dynamic PV (block volmode)] volumes should store data",
    "[Testpattern: Dynamic Snapshot (delete policy)] snapshottable [Feature:VolumeSnapshotDataSource] volume snapshot "
    "controller  should check snapshot fields, check restore correctly works after modifying source data, check "
    "deletion (persistent)",
    "[Testpattern: Pre-provisioned Snapshot (retain policy)] snapshottable [Feature:VolumeSnapshotDataSource] volume "
    "snapshot controller  should check snapshot fields, check restore correctly works after modifying source data, "
    "check deletion (persistent)",
    "[Testpattern: Dynamic PV (default fs)] provisioning should provision storage with snapshot data source "
    "[Feature:VolumeSnapshotDataSource]",
    "[Testpattern: Dynamic PV (default fs)] provisioning should provision storage with pvc data source",
    "[Testpattern: Dynamic PV (block volmode)] provisioning should provision storage with pvc data source",
    "[Testpattern: Dynamic PV (block volmode)(allowExpansion)] volume-expand Verify if offline PVC expansion works",
    "[Testpattern: Dynamic PV (block volmode)(allowExpansion)] volume-expand should resize volume when PVC is "
    "edited while pod is using it",
    "[Testpattern: Dynamic PV (default fs)] capacity provides storage capacity information",
    "[Testpattern: Dynamic PV (delayed binding)] topology should provision a volume and schedule a pod with "
    "AllowedTopologies",
]

NETPOL_SUBSET = [
    "NetworkPolicy between server and client should support a 'default-deny-all' policy [Feature:NetworkPolicy]",
    "NetworkPolicy between server and client should enforce policy to allow traffic from pods within server namespace "
    "based on PodSelector [Feature:NetworkPolicy]",
    "NetworkPolicy between server and client should enforce policy to allow traffic only from a different namespace, "
    "based on NamespaceSelector [Feature:NetworkPolicy]",
    "NetworkPolicy between server and client should enforce policy to allow traffic only from a pod in a different "
    "namespace based on PodSelector and NamespaceSelector [Feature:NetworkPolicy]",
    "NetworkPolicy between server and client should enforce policy based on Ports [Feature:NetworkPolicy]",
    "NetworkPolicy between server and client should allow egress access on one named port [Feature:NetworkPolicy]",
    "NetworkPolicy between server and client using UDP should enforce policy based on Ports [Feature:NetworkPolicy]",
    "NetworkPolicy between server and client should enforce except clause while egress access to server in CIDR block "
    "[Feature:NetworkPolicy]",
    "NetworkPolicy between server and client should enforce updated policy [Feature:NetworkPolicy]",
]


def go_literal(text: str) -> str:
    """``text`` as a Go (RE2) regular expression matching it literally (RE2 refuses Python's escaped spaces), any
    run of spaces as one or more (Ginkgo joins a spec's texts with one space, skipping an empty container's)."""
    return re.sub(r" +", " +", re.sub(r"([\\.+*?()|\[\]{}^$])", r"\\\1", text))


def specs(*texts: str) -> str:
    """A --focus matching exactly the specs whose text ends with one of ``texts`` (so "... pvc data source" is not
    also "... pvc data source (ROX mode)")."""
    return "|".join(f"{go_literal(t)}$" for t in texts)


def conformance(cluster: Cluster, suite: str, *args: str, timeout: float) -> str:
    if reason := kubeassets.absent("e2e.test", "agnhost"):
        pytest.skip(reason)
    p = subprocess.run([str(CONFORMANCE), suite, *args, str(cluster.dir)], capture_output=True, text=True,
                       timeout=timeout, check=False)  # fmt: skip
    assert p.returncode == 0, f"scripts/conformance {suite} failed ({p.returncode}):\n{p.stdout}\n{p.stderr[-3000:]}"
    return p.stdout


def tally(out: str, suite: str) -> tuple[int, int, int, int]:
    m = re.search(rf"^{suite}: (\d+) passed, (\d+) failed, (\d+) skipped at run time, of (\d+) selected", out, re.M)
    assert m, out
    passed, failed, skipped, selected = map(int, m.groups())
    return passed, failed, skipped, selected


@pytest.mark.timeout(900)
def test_networking_conformance(cluster: Cluster) -> None:
    """All of [sig-network] Networking's conformance specs: intra-pod and node-pod, HTTP and UDP."""
    out = conformance(cluster, "networking", timeout=840)
    assert tally(out, "networking") == (4, 0, 0, 4), out


@pytest.mark.timeout(1800)
def test_external_storage_subset(cluster: Cluster) -> None:
    out = conformance(cluster, "storage", "--focus", specs(*STORAGE_SUBSET), timeout=1740)
    passed, failed, skipped, selected = tally(out, "storage")
    # Every pinned spec selected once, and run: a spec skipping itself would test nothing.
    assert (passed, failed, skipped, selected) == (len(STORAGE_SUBSET), 0, 0, len(STORAGE_SUBSET)), out


@pytest.mark.timeout(900)
def test_netpol_subset(cluster: Cluster) -> None:
    out = conformance(cluster, "netpol", "--focus", specs(*NETPOL_SUBSET), timeout=840)
    assert tally(out, "netpol") == (len(NETPOL_SUBSET), 0, 0, len(NETPOL_SUBSET)), out
