"""nodeplug.keyedlocks: one lock per key, forgotten once nobody holds or waits for it (the CNI server's containers,
the DRA preparer's claims), whatever way the holder leaves: done, raising or cancelled."""

from __future__ import annotations

import asyncio
import threading

import pytest

from nodeplug.keyedlocks import KeyedLocks, ThreadKeyedLocks


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


def test_threads_one_key_at_a_time_other_keys_beside_it_and_nothing_kept() -> None:
    locks = ThreadKeyedLocks()
    order: list[str] = []
    a_held, release_a, second_waiting = threading.Event(), threading.Event(), threading.Event()

    def first_a() -> None:
        with locks.hold("a"):
            order.append("a1 in")
            a_held.set()
            assert release_a.wait(30)
            order.append("a1 out")

    def second_a() -> None:
        second_waiting.set()
        with locks.hold("a"):
            order.append("a in")

    t1 = threading.Thread(target=first_a)
    t1.start()
    assert a_held.wait(30)
    t2 = threading.Thread(target=second_a)
    t2.start()
    assert second_waiting.wait(30)
    with locks.hold("b"):  # another key: not behind "a"
        order.append("b in")
    with pytest.raises(RuntimeError), locks.hold("c"):
        raise RuntimeError("boom")
    release_a.set()
    t1.join(30)
    t2.join(30)
    assert order[:2] == ["a1 in", "b in"] and order[2:] == ["a1 out", "a in"]
    assert len(locks) == 0
