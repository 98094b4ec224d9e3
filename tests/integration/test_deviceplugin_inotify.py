"""The inotify wrapper on real inotify in a temporary directory."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

from deviceplugin.inotify import IN_CREATE, IN_DELETE, IN_IGNORED, Inotify


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
