"""``nodeplug doctor`` checks for the CNI plugin.

- the kernel makes network namespaces, veth pairs and bridges (in a throw-away namespace), and ``ip`` and ``nft``
  are on PATH;
- the entry point installed in the CNI bin dir answers VERSION (and how long it takes);
- when the agent serves its CNI socket: STATUS on a throw-away network, then a real attachment acting as the runtime
  (ADD into a temporary netns, ping the gateway from it, DEL) and the lease freed afterwards. On the routed datapath,
  whose link-local gateway no address answers, a second pod is attached and the first pings it through the node's
  routing table. The throw-away network has the config's ``datapath`` and uses the ``doctor_bridge`` and
  ``doctor_subnet`` of the config and its own IPAM data directory
  (``/var/lib/nodeplug/doctor-ipam``); the netns, the bridge and the lease are removed whatever happens. Without
  the agent these are skipped.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import json
import os
import secrets
import sqlite3
import time
from pathlib import Path
from typing import Any

from cni import thick
from cni.config import Config
from cni.ipam.sqlite import db_path
from nodeplug.checks import Check, CheckFailed, CheckSkipped, tool_check
from nodeplug.commands import CommandError, arun
from nodeplug.paths import CNI_BIN_DIR, STATE_DIR
from nodeplug.plugin import AgentContext

NETWORK = "nodeplug-doctor"


def _netconf(section: Config, sock: Path, data_dir: str) -> dict[str, Any]:
    return {
        "cniVersion": "1.1.0",
        "name": NETWORK,
        "type": "nodeplug",
        "bridge": section.doctor_bridge,
        "datapath": section.datapath,
        "isGateway": True,
        "socket": str(sock),
        "ipam": {"type": "nodeplug", "ranges": [[{"subnet": section.doctor_subnet}]], "dataDir": data_dir},
    }


async def _call(sock: Path, env: dict[str, str], conf: dict[str, Any]) -> Any:
    try:
        answer = await asyncio.to_thread(thick.call, str(sock), env, json.dumps(conf).encode())
    except thick.AgentLost as e:
        raise CheckFailed(str(e)) from None
    if answer is None:
        raise CheckFailed(f"{sock} exists but the agent does not answer: is it running and healthy?")
    code, out = answer
    if code != 0:
        raise CheckFailed(f"{env['CNI_COMMAND']} failed: {out.decode(errors='replace')}")
    return json.loads(out) if out else None


def checks(section: Config, ctx: AgentContext) -> list[Check]:
    sock = ctx.root(section.socket)

    async def entry_version() -> str:
        exe = ctx.root(CNI_BIN_DIR) / "nodeplug"
        if not exe.exists():
            raise CheckSkipped(f"{exe} is not installed (run nodeplug install-cni)")
        t0 = time.monotonic()
        proc = await asyncio.create_subprocess_exec(
            str(exe),
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env={"CNI_COMMAND": "VERSION"},
        )
        try:
            out, err = await asyncio.wait_for(proc.communicate(b'{"cniVersion": "1.1.0"}'), 10)
        finally:
            if proc.returncode is None:  # timed out or the check was cancelled: leave no entry point running
                proc.kill()
                await proc.wait()
        ms = (time.monotonic() - t0) * 1000
        if proc.returncode != 0:
            raise CheckFailed(f"{exe} VERSION exited {proc.returncode}: {err.decode(errors='replace')[:300]}")
        versions = json.loads(out).get("supportedVersions", [])
        return f"{exe} speaks {', '.join(versions)} ({ms:.0f} ms)"

    async def status() -> str:
        if not sock.is_socket():
            raise CheckSkipped(f"the agent is not serving {sock}")
        data_dir = str(ctx.root(STATE_DIR) / "doctor-ipam")
        await _call(
            sock, {"CNI_COMMAND": "STATUS", "CNI_PATH": str(ctx.root(CNI_BIN_DIR))}, _netconf(section, sock, data_dir)
        )
        return "the agent can service ADD"

    async def attach() -> str:
        if not sock.is_socket():
            raise CheckSkipped(f"the agent is not serving {sock}")
        if await _bridge_exists(section.doctor_bridge):
            raise CheckFailed(f"bridge {section.doctor_bridge} already exists: set cni.doctor_bridge to an unused name")
        tag = secrets.token_hex(4)
        pods = [f"npdoctor-{tag}", f"npdoctor-{tag}-b"][: 2 if section.datapath == "routed" else 1]
        data_dir = str(ctx.root(STATE_DIR) / "doctor-ipam")  # one place, so the agent keeps one store open for it
        conf = _netconf(section, sock, data_dir)

        def env(ns: str) -> dict[str, str]:
            return {
                "CNI_CONTAINERID": "nodeplug-doctor-" + ns.removeprefix("npdoctor-"),
                "CNI_NETNS": f"/run/netns/{ns}",
                "CNI_IFNAME": "eth0",
                "CNI_PATH": str(ctx.root(CNI_BIN_DIR)),
            }

        try:
            results = []
            for ns in pods:
                await arun(["ip", "netns", "add", ns], timeout=10)
                t0 = time.monotonic()
                results.append(await _call(sock, {**env(ns), "CNI_COMMAND": "ADD"}, conf))
                add_ms = (time.monotonic() - t0) * 1000
            address = results[0]["ips"][0]["address"]
            target = results[0]["ips"][0]["gateway"]
            what = "its gateway"
            if len(results) > 1:  # routed: the other pod, through the node
                target, what = results[1]["ips"][0]["address"].split("/")[0], "another pod"
            try:
                await arun(["ip", "netns", "exec", pods[0], "ping", "-c", "1", "-W", "2", target], timeout=10)
            except CommandError as e:
                raise CheckFailed(f"pod address {address} cannot reach {what} {target}: {e}") from None
            for ns, result in zip(pods, results, strict=True):
                await _call(sock, {**env(ns), "CNI_COMMAND": "DEL"}, {**conf, "prevResult": result})
            left = await asyncio.to_thread(_leases, data_dir)  # sqlite: off the event loop
            if left:
                raise CheckFailed(f"DEL left leases behind: {left}")
            return f"{section.datapath}: ADD {address} ({add_ms:.0f} ms), ping {what} {target}, DEL, lease freed"
        finally:
            for ns in pods:
                with contextlib.suppress(Exception):
                    await _call(sock, {**env(ns), "CNI_COMMAND": "DEL"}, conf)
                with contextlib.suppress(CommandError):
                    await arun(["ip", "netns", "delete", ns], timeout=10)
            with contextlib.suppress(CommandError):
                await arun(["ip", "link", "delete", section.doctor_bridge], timeout=10)

    return [
        Check("kernel", "network namespaces, veth, bridge", _netkernel),
        tool_check("tools", "ip"),
        tool_check("tools", "nft"),
        Check("cni", "entry point VERSION", entry_version),
        Check("cni", "STATUS via the agent", status),
        Check("cni", f"ADD/ping/DEL on {ipaddress.ip_network(section.doctor_subnet)} via the agent", attach),
    ]


async def _netkernel() -> str:
    if os.geteuid() != 0:
        raise CheckSkipped("needs root")
    ns = f"npdoc-{secrets.token_hex(4)}"
    await arun(["ip", "netns", "add", ns], timeout=10)
    try:
        await arun(["ip", "-n", ns, "link", "add", "npdoc0", "type", "veth", "peer", "name", "npdoc1"], timeout=10)
        await arun(["ip", "-n", ns, "link", "add", "npdocbr", "type", "bridge"], timeout=10)
        await arun(["ip", "-n", ns, "link", "set", "npdoc0", "master", "npdocbr"], timeout=10)
    finally:
        await arun(["ip", "netns", "delete", ns], timeout=10)
    return "created and removed a netns with a veth pair on a bridge"


async def _bridge_exists(name: str) -> bool:
    try:
        await arun(["ip", "link", "show", "dev", name], timeout=10)
    except CommandError:
        return False
    return True


def _leases(data_dir: str) -> list[str]:
    db = db_path(data_dir, NETWORK)
    if not os.path.exists(db):
        return []
    with contextlib.closing(sqlite3.connect(db)) as c:
        return [f"{cid} {ip}" for cid, ip in c.execute("SELECT container_id, ip FROM leases")]
