"""nodeplug.keyedlocks: one lock per key, forgotten once nobody holds or waits for it (the CNI server's containers,
the DRA preparer's claims), whatever way the holder leaves: done, raising or cancelled."""

from __future__ import annotations

import asyncio

import pytest

from nodeplug.keyedlocks import KeyedLocks


async def test_one_key_at_a_time_other_keys_beside_it() -> None:
    locks = KeyedLocks()
    order: list[str] = []
    a_held, release_a = asyncio.Event(), asyncio.Event()

    async def first_a() -> None:
        async with locks.hold("a"):
            order.append("a1 in")
            a_held.set()
            await release_a.wait()
            order.append("a1 out")

    async def second(key: str) -> None:
        async with locks.hold(key):
            order.append(f"{key} in")

    t1 = asyncio.create_task(first_a())
    await a_held.wait()
    t2 = asyncio.create_task(second("a"))
    await asyncio.wait_for(second("b"), 30)  # another key: not behind "a"
    assert order == ["a1 in", "b in"] and len(locks) == 1  # "a" is held and waited for
    release_a.set()
    await asyncio.wait_for(asyncio.gather(t1, t2), 30)
    assert order == ["a1 in", "b in", "a1 out", "a in"]
    assert len(locks) == 0


async def test_nothing_is_kept_after_a_raise_or_a_cancel() -> None:
    locks = KeyedLocks()
    with pytest.raises(RuntimeError):
        async with locks.hold("k"):
            raise RuntimeError("boom")
    assert len(locks) == 0
    held = asyncio.Event()

    async def holder() -> None:
        async with locks.hold("k"):
            held.set()
            await asyncio.Event().wait()

    h = asyncio.create_task(holder())
    await held.wait()
    waiter = asyncio.create_task(locks.hold("k").__aenter__())
    await asyncio.sleep(0)  # the waiter queues on the lock
    assert len(locks) == 1
    waiter.cancel()
    h.cancel()
    await asyncio.gather(h, waiter, return_exceptions=True)
    assert len(locks) == 0
    async with locks.hold(""):  # an empty key locks nothing and keeps nothing
        assert len(locks) == 0
