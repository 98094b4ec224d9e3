"""The latest-value broadcast, the inotify wrapper (real inotify in a temp dir) and uevent parsing."""

from __future__ import annotations

import asyncio
import contextlib
import os
import struct
from pathlib import Path

from deviceplugin.broadcast import Broadcast
from deviceplugin.inotify import IN_CREATE, IN_DELETE, IN_IGNORED, Inotify, parse_events
from deviceplugin.uevent import parse


async def test_broadcast_latest_value_and_clean_end() -> None:
    b: Broadcast[int] = Broadcast(0)
    got: list[int] = []

    async def reader() -> None:
        async with contextlib.aclosing(b.subscribe()) as it:
            async for v in it:
                got.append(v)

    t = asyncio.create_task(reader())
    await asyncio.sleep(0)
    assert b.subscribers == 1 and got == [0]
    b.publish(1)
    b.publish(2)  # the reader had no chance to see 1: it sees only the newest
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    assert got == [0, 2]
    b.close()
    await asyncio.wait_for(t, 1)
    assert b.subscribers == 0
    assert [v async for v in b.subscribe()] == []  # closed: nothing


async def test_broadcast_subscriber_cancelled_leaves_nothing() -> None:
    b: Broadcast[int] = Broadcast(0)

    async def reader() -> None:
        async with contextlib.aclosing(b.subscribe()) as it:
            async for _ in it:
                pass

    tasks = [asyncio.create_task(reader()) for _ in range(3)]
    await asyncio.sleep(0.01)
    assert b.subscribers == 3
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    assert b.subscribers == 0


async def test_inotify_reports_create_delete_and_removed_dir(tmp_path: Path) -> None:
    events: list[tuple[str, str, int]] = []
    seen = asyncio.Event()

    def cb(d: str, name: str, mask: int) -> None:
        events.append((d, name, mask))
        seen.set()

    ino = Inotify(cb)
    try:
        sub = tmp_path / "sub"
        sub.mkdir()
        assert ino.add(str(sub))
        assert not ino.add(str(tmp_path / "missing"))
        (sub / "x").write_text("")
        await asyncio.wait_for(seen.wait(), 2)
        assert any(n == "x" and m & IN_CREATE for _, n, m in events)
        seen.clear()
        os.unlink(sub / "x")
        await asyncio.wait_for(seen.wait(), 2)
        assert any(n == "x" and m & IN_DELETE for _, n, m in events)
        seen.clear()
        sub.rmdir()
        while not any(m & IN_IGNORED for _, _, m in events):
            seen.clear()
            await asyncio.wait_for(seen.wait(), 2)
        assert ino.watched == set()
        ino.set({str(tmp_path)})
        assert ino.watched == {str(tmp_path)}
    finally:
        ino.close()


def test_parse_events() -> None:
    buf = struct.pack("iIII", 1, IN_CREATE, 0, 16) + b"ttyUSB0".ljust(16, b"\0")
    buf += struct.pack("iIII", 2, IN_DELETE, 0, 0)
    assert parse_events(buf) == [(1, IN_CREATE, "ttyUSB0"), (2, IN_DELETE, "")]


def test_parse_uevent() -> None:
    msg = b"add@/devices/pci0000:00/0000:00:14.0/usb1/1-1\0ACTION=add\0DEVPATH=/devices/x\0SUBSYSTEM=usb\0SEQNUM=9\0"
    assert parse(msg) == ("add", {"ACTION": "add", "DEVPATH": "/devices/x", "SUBSYSTEM": "usb", "SEQNUM": "9"})
    assert parse(b"libudev\0\xfe\xed") is None
