"""The latest-value broadcast, and parsing inotify events and uevents (real inotify: tests/integration)."""

from __future__ import annotations

import asyncio
import contextlib
import struct

from deviceplugin.broadcast import Broadcast
from deviceplugin.inotify import IN_CREATE, IN_DELETE, parse_events
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
    await asyncio.wait_for(t, 5)
    assert b.subscribers == 0
    assert [v async for v in b.subscribe()] == []  # closed: nothing


async def test_broadcast_subscriber_cancelled_leaves_nothing() -> None:
    b: Broadcast[int] = Broadcast(0)
    first_values: asyncio.Queue[int] = asyncio.Queue()

    async def reader() -> None:
        async with contextlib.aclosing(b.subscribe()) as it:
            async for v in it:
                first_values.put_nowait(v)  # only the current value comes: nothing more is published

    tasks = [asyncio.create_task(reader()) for _ in range(3)]
    assert [await first_values.get() for _ in tasks] == [0, 0, 0]
    assert b.subscribers == 3
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    assert b.subscribers == 0


def test_parse_events() -> None:
    buf = struct.pack("iIII", 1, IN_CREATE, 0, 16) + b"ttyUSB0".ljust(16, b"\0")
    buf += struct.pack("iIII", 2, IN_DELETE, 0, 0)
    assert parse_events(buf) == [(1, IN_CREATE, "ttyUSB0"), (2, IN_DELETE, "")]


def test_parse_uevent() -> None:
    msg = b"add@/devices/pci0000:00/0000:00:14.0/usb1/1-1\0ACTION=add\0DEVPATH=/devices/x\0SUBSYSTEM=usb\0SEQNUM=9\0"
    assert parse(msg) == ("add", {"ACTION": "add", "DEVPATH": "/devices/x", "SUBSYSTEM": "usb", "SEQNUM": "9"})
    assert parse(b"libudev\0\xfe\xed") is None
