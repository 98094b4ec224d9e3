"""``nodeplug doctor``: checks a node before and after deploying.

The agent's HTTP endpoint is checked here; each enabled plugin of :mod:`nodeplug.plugins` adds its own checks
(its spec's ``checks``): prerequisites (kernel features, tools, kubelet's directories), and an end-to-end round trip
acting as the plugin's real caller when the agent is running. Every check prints one table row; any failure makes
the exit status non-zero. Kernel checks work inside a throw-away network namespace and leave nothing behind.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import urllib.error
import urllib.request
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, TextIO

from nodeplug import paths
from nodeplug.checks import Check, CheckFailed, CheckResult, CheckSkipped, CheckWarning
from nodeplug.commands import CommandError
from nodeplug.config import AgentConfig
from nodeplug.plugin import AgentContext
from nodeplug.plugins import PLUGINS

if TYPE_CHECKING:
    from nodeplug.kube import KubeSource

CHECK_TIMEOUT = 120.0


def _check(group: str, name: str) -> Callable[[Callable[[], Awaitable[str]]], Check]:
    def wrap(fn: Callable[[], Awaitable[str]]) -> Check:
        return Check(group, name, fn)

    return wrap


def node_checks(cfg: AgentConfig, ctx: AgentContext) -> list[Check]:
    """What the node needs whatever runs on it: the agent answering its health endpoint. Each plugin's own
    prerequisites (kernel features, tools, kubelet's directories) are among its checks."""
    checks: list[Check] = []

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


def all_checks(cfg: AgentConfig, ctx: AgentContext) -> list[Check]:
    checks = node_checks(cfg, ctx)
    for spec in PLUGINS:
        if not spec.enabled(cfg) or spec.needs_off(cfg):  # what the agent would not run is not checked
            continue
        checks.extend(spec.doctor_checks(cfg, ctx))
    return checks


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
