"""Run a function in a named netns with a netlink socket of it, on a thread that stays there for it."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from typing import Any

from cni.dataplane.netns import entered
from cni.dataplane.rtnl import Rtnl


def inside(ns: str, fn: Callable[[Rtnl], Any]) -> Any:
    """``fn(nl)`` in netns ``ns`` (``/run/netns/<ns>``); its result, or its exception raised here."""
    out: list[Any] = []
    err: list[BaseException] = []

    def run() -> None:
        fd = os.open(f"/run/netns/{ns}", os.O_RDONLY)
        try:
            with entered(fd):
                nl = Rtnl()
                try:
                    out.append(fn(nl))
                finally:
                    nl.close()
        except BaseException as e:
            err.append(e)
        finally:
            os.close(fd)

    t = threading.Thread(target=run)
    t.start()
    t.join()
    if err:
        raise err[0]
    return out[0]
