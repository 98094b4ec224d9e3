"""``nodeplug doctor``: checks a node before and after deploying.

Node checks (kernel features, tools the config needs, kubelet's directories, the agent's HTTP endpoint) live here;
each plugin adds its own through ``<pkg>.doctor.checks(section, ctx)`` — prerequisites, and an end-to-end round trip
acting as the plugin's real caller when the agent is running. Every check prints one table row; any failure makes
the exit status non-zero. Kernel checks work inside a throw-away network namespace and leave nothing behind.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import os
import shutil
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, TextIO

from nodeplug import paths
from nodeplug.checks import Check, CheckFailed, CheckResult, CheckSkipped, CheckWarning
from nodeplug.commands import CommandError, arun
from nodeplug.config import AgentConfig
from nodeplug.plugin import AgentContext

if TYPE_CHECKING:
    from nodeplug.kube import KubeSource

CHECK_TIMEOUT = 120.0


def _check(group: str, name: str) -> Callable[[Callable[[], Awaitable[str]]], Check]:
    def wrap(fn: Callable[[], Awaitable[str]]) -> Check:
        return Check(group, name, fn)

    return wrap


def node_checks(cfg: AgentConfig, ctx: AgentContext) -> list[Check]:
    checks: list[Check] = []

    @_check("kernel", "network namespaces, veth, bridge")
    async def netkernel() -> str:
        if os.geteuid() != 0:
            raise CheckSkipped("needs root")
        ns = f"npdoc-{uuid.uuid4().hex[:8]}"
        await arun(["ip", "netns", "add", ns], timeout=10)
        try:
            await arun(["ip", "-n", ns, "link", "add", "npdoc0", "type", "veth", "peer", "name", "npdoc1"], timeout=10)
            await arun(["ip", "-n", ns, "link", "add", "npdocbr", "type", "bridge"], timeout=10)
            await arun(["ip", "-n", ns, "link", "set", "npdoc0", "master", "npdocbr"], timeout=10)
        finally:
            await arun(["ip", "netns", "delete", ns], timeout=10)
        return "created and removed a netns with a veth pair on a bridge"

    checks.append(netkernel)

    @_check("kernel", "filesystems")
    async def filesystems() -> str:
        with open("/proc/filesystems") as f:  # noqa: ASYNC230 (procfs, never blocks)
            have = {line.split()[-1] for line in f if line.strip()}
        want = ["ext4", "xfs"] + (["btrfs"] if _btrfs_enabled(cfg) else [])
        missing = [fs for fs in want if fs not in have]
        if missing:
            # a module may still be loadable on first mount; say so instead of failing outright
            return f"{', '.join(want)} wanted; not yet registered: {', '.join(missing)} (loaded on first mount)"
        return ", ".join(want)

    if cfg.csi.enabled:
        checks.append(filesystems)

    for tool in _tools(cfg):
        checks.append(_tool_check(tool))

    @_check("kubelet", "kubelet directories")
    async def kubelet_dirs() -> str:
        dirs = [paths.DEVICE_PLUGIN_DIR] if cfg.deviceplugin.enabled else []
        dirs += [paths.PLUGINS_DIR, paths.PLUGINS_REGISTRY_DIR] if cfg.csi.enabled else []
        missing = [d for d in dirs if not ctx.root(d).is_dir()]
        if missing:
            raise CheckFailed(f"missing under root {cfg.root}: {', '.join(missing)} (is kubelet installed here?)")
        kubelet = ctx.root(paths.KUBELET_SOCKET)
        note = "kubelet.sock present" if kubelet.exists() else "kubelet.sock absent (kubelet not running)"
        return f"{len(dirs)} present; {note}"

    checks.append(kubelet_dirs)

    @_check("agent", "health endpoint")
    async def health() -> str:
        base = f"http://{cfg.http.address}"
        try:
            await asyncio.to_thread(_get, base + "/healthz")
        except OSError as e:
            raise CheckSkipped(f"agent not answering on {cfg.http.address}: {e}") from None
        try:
            body = await asyncio.to_thread(_get, base + "/readyz")
        except urllib.error.HTTPError as e:
            body = e.read().decode(errors="replace").strip().replace("\n", "; ")
            if not ctx.root(paths.KUBELET_SOCKET).exists():
                raise CheckWarning(
                    f"/readyz {e.code} (no kubelet on this root, nothing to register with): {body}"
                ) from None
            raise CheckFailed(f"/readyz {e.code}: {body}") from None
        return "healthz ok; readyz: " + body.strip().replace("\n", "; ")

    checks.append(health)
    return checks


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=5) as r:
        return str(r.read().decode())


def _btrfs_enabled(cfg: AgentConfig) -> bool:
    btrfs = getattr(cfg.csi, "btrfs", None)
    return bool(cfg.csi.enabled and btrfs is not None and getattr(btrfs, "enabled", False))


def _tools(cfg: AgentConfig) -> list[str]:
    tools: list[str] = []
    if cfg.csi.enabled:
        # csi.doctor checks loop devices, mkfs.ext4 and mkfs.xfs itself
        tools += ["losetup", "mount", "umount", "resize2fs", "xfs_growfs", "fsfreeze"]
        if _btrfs_enabled(cfg):
            tools += ["btrfs"]
    if cfg.cni.enabled:
        tools += ["ip", "nft"]
    return tools


def _tool_check(tool: str) -> Check:
    async def run() -> str:
        found = shutil.which(tool)
        if not found:
            raise CheckFailed(f"{tool} not found on PATH: install it on the node")
        return found

    return Check("tools", tool, run)


def all_checks(cfg: AgentConfig, ctx: AgentContext) -> list[Check]:
    checks = node_checks(cfg, ctx)
    for name in ("deviceplugin", "csi", "cni"):
        section = getattr(cfg, name)
        if not section.enabled:
            continue
        try:
            module = importlib.import_module(f"{name}.doctor")
        except ImportError as e:
            checks.append(Check(name, "doctor checks", _fail(f"cannot load {name}.doctor: {e}")))
            continue
        checks.extend(module.checks(section, ctx))
    return checks


def _fail(msg: str) -> Callable[[], Awaitable[str]]:
    async def run() -> str:
        raise CheckFailed(msg)

    return run


async def run_checks(checks: Sequence[Check], timeout: float = CHECK_TIMEOUT) -> list[CheckResult]:
    results = []
    for c in checks:
        start = time.perf_counter()
        try:
            detail = await asyncio.wait_for(c.run(), timeout)
            status = "ok"
        except CheckSkipped as e:
            status, detail = "skip", str(e)
        except CheckWarning as e:
            status, detail = "warn", str(e)
        except CheckFailed as e:
            status, detail = "fail", str(e)
        except CommandError as e:
            status, detail = "fail", str(e)
        except TimeoutError:
            status, detail = "fail", f"no answer within {timeout:g}s"
        except Exception as e:
            status, detail = "fail", f"{type(e).__name__}: {e}"
        results.append(CheckResult(c.group, c.name, status, detail, time.perf_counter() - start))
    return results


def print_table(results: Sequence[CheckResult], out: TextIO) -> None:
    rows = [("GROUP", "CHECK", "STATUS", "TIME", "DETAIL")]
    rows += [(r.group, r.name, r.status.upper(), f"{r.seconds * 1000:.0f}ms", r.detail) for r in results]
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    for row in rows:
        out.write("  ".join(cell.ljust(widths[i]) for i, cell in enumerate(row[:4])) + "  " + row[4] + "\n")
    failed = sum(r.status == "fail" for r in results)
    skipped = sum(r.status == "skip" for r in results)
    warned = sum(r.status == "warn" for r in results)
    passed = len(results) - failed - skipped - warned
    out.write(f"\n{passed} ok, {warned} warnings, {failed} failed, {skipped} skipped\n")


async def doctor(cfg: AgentConfig, out: TextIO, kube: KubeSource | None = None, node_name: str = "") -> int:
    ctx = AgentContext(root=paths.Root(cfg.root), node_name=node_name)
    if kube is not None:
        from nodeplug.kube import KubeClient

        ctx.kube = KubeClient(kube)
    try:
        results = await run_checks(all_checks(cfg, ctx))
    finally:
        if ctx.kube is not None:
            await ctx.kube.close()
    print_table(results, out)
    with contextlib.suppress(Exception):
        out.flush()
    return 1 if any(r.status == "fail" for r in results) else 0
