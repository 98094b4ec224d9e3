"""The end-of-run line of tests/support/skipsummary.py: a run in which tests skip because KUBE_ASSETS lacks a
binary (the tests' own helper, kube_tool, on an empty folder) says once how many, where the binaries were looked for
and where to read how to get them; skips for other reasons are not counted, and a run without such skips prints
nothing."""

from __future__ import annotations

import lzma
import os
from pathlib import Path

import pytest

from support.host import REPO

TESTS = """
import pytest
from support.kubeassets import kube_tool

@pytest.fixture
def kubelet():
    return kube_tool("kubelet")

def test_needs_kubectl():
    kube_tool("kubectl")

@pytest.mark.parametrize("n", [1, 2])
def test_needs_kubelet(kubelet, n):
    pass

@pytest.mark.skipif(True, reason="needs root: makes loop devices")
def test_needs_root():
    pass

def test_runs():
    pass
"""


def run(pytester: pytest.Pytester, assets: Path, monkeypatch: pytest.MonkeyPatch) -> pytest.RunResult:
    monkeypatch.setenv("KUBE_ASSETS", str(assets))
    # the run sees the tests' helpers and scripts/lab as this one does (pyproject's pythonpath)
    path = [str(REPO / "tests"), str(REPO / "scripts"), os.environ.get("PYTHONPATH", "")]
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in path if p))
    pytester.makepyfile(test_sample=TESTS)
    return pytester.runpytest_subprocess("-p", "support.skipsummary", "-p", "no:cacheprovider")


def test_the_skips_for_absent_binaries_are_counted_once(
    pytester: pytest.Pytester, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    empty = tmp_path / "no-kube"
    empty.mkdir()
    result = run(pytester, empty, monkeypatch)
    result.assert_outcomes(passed=1, skipped=4)
    lines = [x for x in result.outlines if "for lack of the Kubernetes binaries" in x]
    assert lines == [
        f"3 tests skipped for lack of the Kubernetes binaries in {empty} (KUBE_ASSETS): see README.md, "
        "'The Kubernetes binaries (KUBE_ASSETS)'"
    ]


def test_nothing_is_said_when_the_binaries_are_there(
    pytester: pytest.Pytester, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assets = tmp_path / "kube"
    assets.mkdir()
    for name in ("kubectl", "kubelet"):  # stand-ins: the sample tests only ask for them
        (assets / f"{name}.xz").write_bytes(lzma.compress(b"#!/bin/sh\n"))
    monkeypatch.setenv("NODEPLUG_CLUSTER_CACHE", str(tmp_path / "cache"))  # unpacked there, not in build/
    result = run(pytester, assets, monkeypatch)
    result.assert_outcomes(passed=4, skipped=1)
    assert not [x for x in result.outlines if "Kubernetes binaries" in x]
