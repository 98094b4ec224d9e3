"""DEL's deletion of a veth pair, answered as soon as the kernel has taken the pair out of use.

Deleting a link is one netlink request, but the kernel answers it late: under the RTNL lock it unregisters both
ends (their names are free, their addresses and routes gone, the bridge port detached, ``RTM_DELLINK`` sent to
listeners) in well under a millisecond; then, with the lock released, it waits for an RCU barrier and for the last
references before it frees the devices, about 20 ms on a 2-core node, all inside the ``sendmsg`` of the request.
Nothing a runtime can see depends on that second part.

:func:`delete_pair` sends the request from a thread of its own and returns when the ``RTM_DELLINK`` of the host end
arrives on a socket subscribed to link events beforehand (or when the request itself failed or ended). The kernel
finishes the rest whatever happens to this process: a ``kill -9`` arriving in between only ends the process once the
system call it is in has returned, and the pair is already unregistered by then. So a DEL answered early keeps the
contract: the address is out of use (its lease is released after this returns), the names are free for the next ADD
of the same container, and nothing is left behind. The thread is not a daemon, so a process that exits normally
waits for it; the standalone entry point ends with ``os._exit`` (:mod:`cni.entry`), which does not wait: the thread
ends once its system call returns, the kernel completing the deletion either way.
"""

from __future__ import annotations

import contextlib
import errno
import os
import select
import socket
import struct
import threading
import time

from cni.dataplane import sockfilter
from cni.dataplane.nl import delete_link, host_socket, nl_error
from cni.dataplane.nlwire import NLMSGHDR, messages
from cni.dataplane.rtnl import RTM_DELLINK, TIMEOUT, NetlinkError

RTMGRP_LINK = 1
_IFINDEX = struct.Struct("=i")
_IFINDEX_OFFSET = NLMSGHDR.size + 4  # nlmsghdr, then ifinfomsg's family, pad and type


def _only_the_deletion_of(index: int) -> list[sockfilter.Insn]:
    """A socket filter: of the node's link events, only link ``index``'s RTM_DELLINK wakes the thread waiting on it
    (every DEL in flight has such a socket, and each ADD and DEL sends several link events: an unfiltered one saw 40
    while 20 pairs were deleted one after another, the filtered one the 1 it waits for)."""
    return [
        (sockfilter.LDH, 0, 0, sockfilter.TYPE_OFFSET),
        (sockfilter.JEQ, 0, 3, sockfilter.host_u16(RTM_DELLINK)),  # not a deletion: on to DROP
        (sockfilter.LDW, 0, 0, _IFINDEX_OFFSET),
        (sockfilter.JEQ, 0, 1, sockfilter.host_u32(index, signed=True)),
        sockfilter.KEEP,
        sockfilter.DROP,
    ]


def delete_pair(name: str, index: int) -> bool:
    """Delete link ``name`` (index ``index``, in the calling thread's netns) and its peer; True once the kernel has
    unregistered it, False when there was no such link. CniError when the kernel refuses."""
    watch = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW | socket.SOCK_CLOEXEC, socket.NETLINK_ROUTE)
    done_r, done_w = os.pipe2(os.O_CLOEXEC)
    outcome: list[BaseException | None] = []

    def run() -> None:  # started from the calling thread, so in its netns
        try:
            with host_socket() as nl:
                delete_link(nl, name)
            outcome.append(None)
        except BaseException as e:
            outcome.append(e)  # for the caller, or dropped once it has answered
        finally:
            with contextlib.suppress(OSError):
                os.write(done_w, b"x")  # the caller may be gone (EPIPE): the pipe only wakes it
            os.close(done_w)

    started = False
    try:
        sockfilter.attach(watch, _only_the_deletion_of(index))  # before it joins the group
        watch.bind((0, RTMGRP_LINK))
        threading.Thread(target=run, name=f"nodeplug-cni-unlink-{name}").start()
        started = True
    finally:
        if not started:
            watch.close()
            os.close(done_r)
            os.close(done_w)
    try:
        if _unregistered(watch, done_r, index):
            return True
        error = outcome[0] if outcome else None
        if isinstance(error, NetlinkError) and error.code == errno.ENODEV:
            return False
        if error is not None:
            raise nl_error(f"delete host interface {name}", error) from None
        return True
    finally:
        watch.close()
        os.close(done_r)


def _unregistered(watch: socket.socket, done: int, index: int) -> bool:
    """Wait for link ``index``'s RTM_DELLINK on ``watch``: True when it came, False when the request ended first (its
    outcome says how) or the events were lost (the socket overran)."""
    deadline = time.monotonic() + TIMEOUT
    while (left := deadline - time.monotonic()) > 0:
        ready, _, _ = select.select([watch.fileno(), done], [], [], left)
        if watch.fileno() in ready:
            try:
                data = watch.recv(1 << 16)
            except OSError:  # ENOBUFS: events were dropped; the request's end is the answer
                return _ended(done, deadline)
            for msg_type, _, _, msg in messages(data):
                if msg_type == RTM_DELLINK and _IFINDEX.unpack_from(msg, _IFINDEX_OFFSET)[0] == index:
                    return True
        elif done in ready:
            return False
    raise nl_error("delete a host interface", NetlinkError(errno.ETIMEDOUT, f"no answer within {TIMEOUT:g}s"))


def _ended(done: int, deadline: float) -> bool:
    select.select([done], [], [], max(0.0, deadline - time.monotonic()))
    return False
