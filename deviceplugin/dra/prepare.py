"""NodePrepareResources and NodeUnprepareResources for one claim at a time: the DRA driver's core.

Prepare (:meth:`Preparer.prepare`):

1. a claim already recorded ``prepared`` answers from the record (kubelet asks again after its own restart, and
   must get the same devices), with no API request;
2. otherwise the ResourceClaim is read from the API server (:class:`ClaimSource`) and checked against kubelet's
   namespace, name and UID (:func:`deviceplugin.dra.claims.parse_claim`);
3. every device allocated to this driver must be in this node's pool, offered through DRA, present and healthy,
   not prepared for another claim and not in use through the device plugin (:class:`Devices` says which). What a
   claim holds is the device's *unit*: the replica of a shared device (``fuse::3`` for the pool's ``fuse-fuse-3``),
   the physical device otherwise; a claim recorded with a physical device holds all its replicas;
4. the claim is recorded ``preparing`` with its devices and spec file, then its CDI spec is written, then the
   resources' reset commands run, then the record becomes ``prepared``. A failure in between removes the spec and
   the record, so nothing stays behind; a kill -9 in between leaves a record that unprepare (or the next prepare)
   finishes.

Unprepare (:meth:`Preparer.unprepare`) needs only the record: it removes the claim's spec file and the record, and
is done at once for a claim it does not know (already unprepared, or never prepared here). It works while the API
server is away.

Both are serialised per claim UID. The checks of step 3 and taking the devices' holds happen with no await between
them, so two claims (or a claim and a device-plugin Allocate, which runs in the same event loop) never take one
device. The database and the spec file are written in a worker thread (``asyncio.to_thread``), never on the event
loop that serves every other claim and the device plugin. Errors are :class:`PrepareError`, whose text goes into the
claim's entry of the response.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from deviceplugin.config import Resource
from deviceplugin.discovery import Device
from deviceplugin.dra import claimcdi
from deviceplugin.dra.claims import Claim, ClaimError, parse_claim
from deviceplugin.dra.names import NameError_, check_name, check_namespace, check_uid
from deviceplugin.dra.store import ClaimStore, PreparedClaim, PreparedDevice
from nodeplug.commands import CommandError
from nodeplug.keyedlocks import KeyedLocks
from nodeplug.log import Logger


class PrepareError(Exception):
    """Preparing or unpreparing one claim failed; the message is what kubelet reports for the claim."""


@dataclass(frozen=True)
class Offered:
    """A device of this node's pool as the driver sees it now."""

    name: str  # its name in the pool
    resource: Resource
    device: Device
    problem: str = ""  # why it cannot be prepared now ("" when it can): unhealthy, gone
    replica: str = ""  # the device plugin's ID of the replica this is ("" or the device's ID: not shared)

    @property
    def unit(self) -> str:
        """What a claim of this device holds, in the device plugin's IDs: the replica, or the whole device."""
        return self.replica or self.device.id


class ClaimSource(Protocol):
    async def get_claim(self, namespace: str, name: str) -> Claim:
        """The ResourceClaim as the API server has it; :class:`ClaimError` when it cannot be had."""


class Devices(Protocol):
    def offered(self, name: str) -> Offered | None:
        """The device of this node's pool named ``name``, if it is one offered through DRA."""

    def in_use_elsewhere(self, resource: str, unit: str) -> str:
        """Why the unit (replica or device, :attr:`Offered.unit`) is in use outside DRA now (through the device
        plugin), or ""."""

    def claims_changed(self) -> None:
        """The set of prepared claims changed: recompute what the device plugin may hand out."""

    async def reset(self, resource: Resource, devices: Sequence[Device]) -> None:
        """Run the resource's reset command for the devices (CommandError on failure)."""


@dataclass(frozen=True)
class ClaimRef:
    namespace: str
    name: str
    uid: str


@dataclass(eq=False, kw_only=True)
class Preparer:
    driver: str
    pool: str  # this node's pool (the node name)
    store: ClaimStore
    source: ClaimSource
    devices: Devices
    cdi_dir: Path
    log: Logger
    _locks: KeyedLocks = field(default_factory=KeyedLocks, init=False)  # one coroutine at a time per claim UID
    # (resource, unit) -> uid of the claim that holds it; admin-access preparations hold nothing
    holders: dict[tuple[str, str], str] = field(default_factory=dict, init=False)
    _who: dict[str, str] = field(default_factory=dict, init=False)  # uid -> namespace/name, of claims holding devices

    def __post_init__(self) -> None:
        for c in self.store.all():
            self._hold(c)

    # ------------------------------------------------------------ holds

    def _hold(self, claim: PreparedClaim) -> None:
        for d in claim.devices:
            if not d.admin_access:
                self.holders[(d.resource, d.device_id)] = claim.uid
                self._who[claim.uid] = f"{claim.namespace}/{claim.name}"

    def _release(self, uid: str) -> None:
        for key in [k for k, v in self.holders.items() if v == uid]:
            del self.holders[key]
        self._who.pop(uid, None)

    def held(self) -> dict[str, dict[str, str]]:
        """Per resource: unit (replica id, or physical id for all replicas) -> why the device plugin may not hand it
        out."""
        out: dict[str, dict[str, str]] = {}
        for (res, dev_id), uid in self.holders.items():
            out.setdefault(res, {})[dev_id] = f"prepared for DRA claim {self._who.get(uid, uid)}"
        return out

    # ------------------------------------------------------------ prepare

    @staticmethod
    def check_ref(namespace: str, name: str, uid: str) -> ClaimRef:
        try:
            return ClaimRef(check_namespace(namespace), check_name(name), check_uid(uid))
        except NameError_ as e:
            raise PrepareError(f"claim: {e}") from None

    async def prepare(self, ref: ClaimRef) -> tuple[PreparedDevice, ...]:
        async with self._locks.hold(ref.uid):
            return await self._prepare(ref)

    async def _prepare(self, ref: ClaimRef) -> tuple[PreparedDevice, ...]:
        known = await asyncio.to_thread(self.store.get, ref.uid)
        if known is not None and known.state == "prepared":
            if (known.namespace, known.name) != (ref.namespace, ref.name):
                raise PrepareError(
                    f"claim {ref.uid} was prepared as {known.namespace}/{known.name}, not {ref.namespace}/{ref.name}"
                )
            return known.devices
        if known is not None:  # a preparation that died half-way: start again from nothing
            await self._undo(known)
        try:
            obj = await self.source.get_claim(ref.namespace, ref.name)
            alloc = parse_claim(obj, namespace=ref.namespace, name=ref.name, uid=ref.uid, driver=self.driver)
        except ClaimError as e:
            raise PrepareError(str(e)) from None
        chosen: list[tuple[claimcdi.ClaimDevice, PreparedDevice]] = []
        requests: dict[tuple[str, str], list[str]] = {}
        admin: dict[tuple[str, str], bool] = {}
        for a in alloc.devices:
            requests.setdefault((a.pool, a.device), []).append(a.request)
            admin[(a.pool, a.device)] = admin.get((a.pool, a.device), True) and a.admin_access
        problems: list[str] = []
        for (pool, name), reqs in requests.items():
            if pool != self.pool:
                problems.append(f"device {pool}/{name}: pool {pool!r} is not this node's ({self.pool!r})")
                continue
            o = self.devices.offered(name)
            if o is None:
                problems.append(f"device {pool}/{name}: no such device offered through DRA on this node")
                continue
            if o.problem:
                problems.append(f"device {pool}/{name}: {o.problem}")
                continue
            key = (o.resource.name, o.unit)
            if not admin[(pool, name)]:
                holder = self.holders.get(key) or self.holders.get((o.resource.name, o.device.id))
                if holder is not None and holder != ref.uid:
                    who = self._who.get(holder, holder)
                    problems.append(f"device {pool}/{name}: already prepared for claim {who}")
                    continue
                elsewhere = self.devices.in_use_elsewhere(*key)
                if elsewhere:
                    problems.append(f"device {pool}/{name}: {elsewhere}")
                    continue
            cd = claimcdi.ClaimDevice(name, o.resource, o.device)
            pd = PreparedDevice(
                pool=pool,
                device=name,
                resource=o.resource.name,
                device_id=o.unit,
                requests=tuple(reqs),
                cdi_ids=(claimcdi.qualified(self.driver, ref.uid, name),),
                admin_access=admin[(pool, name)],
            )
            chosen.append((cd, pd))
        if problems:
            raise PrepareError(f"ResourceClaim {ref.namespace}/{ref.name}: " + "; ".join(problems))
        record = PreparedClaim(
            uid=ref.uid,
            namespace=ref.namespace,
            name=ref.name,
            state="preparing",
            spec_file=claimcdi.spec_filename(self.driver, ref.uid),
            devices=tuple(pd for _, pd in chosen),
        )
        self._hold(record)  # at once, with no await since the checks: no other claim or Allocate takes them now
        self.devices.claims_changed()
        try:
            # the record before anything exists on the host: a crash from here on is found again
            await asyncio.to_thread(self.store.begin, record)
        except Exception:  # rolled back: nothing recorded (when cancelled, the thread may still record it: keep)
            self._release(ref.uid)
            self.devices.claims_changed()
            raise
        try:
            if chosen:
                spec = claimcdi.build(self.driver, ref.uid, [cd for cd, _ in chosen])
                await asyncio.to_thread(claimcdi.write, self.cdi_dir, self.driver, ref.uid, spec)
            await self._reset(chosen)
            await asyncio.to_thread(self.store.finish, ref.uid)
        except BaseException as e:
            with contextlib.suppress(Exception):
                await self._undo(record)
            if isinstance(e, CommandError | OSError):
                raise PrepareError(f"ResourceClaim {ref.namespace}/{ref.name}: {e}") from None
            raise
        self.log.info(
            "claim prepared",
            claim=f"{ref.namespace}/{ref.name}",
            claim_uid=ref.uid,
            devices=",".join(pd.device for _, pd in chosen) or None,
        )
        return record.devices

    async def _reset(self, chosen: list[tuple[claimcdi.ClaimDevice, PreparedDevice]]) -> None:
        by_res: dict[str, tuple[Resource, list[Device]]] = {}
        for cd, pd in chosen:
            if cd.resource.reset is not None and not pd.admin_access:
                by_res.setdefault(cd.resource.name, (cd.resource, []))[1].append(cd.device)
        for res, devs in by_res.values():
            await self.devices.reset(res, devs)

    # ------------------------------------------------------------ unprepare

    def _remove(self, claim: PreparedClaim) -> None:
        claimcdi.remove(self.cdi_dir, claim.spec_file)
        self.store.remove(claim.uid)

    async def _undo(self, claim: PreparedClaim) -> None:
        """Remove what ``claim`` made (its spec file), then its record; release its devices."""
        await asyncio.to_thread(self._remove, claim)
        self._release(claim.uid)
        self.devices.claims_changed()

    async def unprepare(self, ref: ClaimRef) -> None:
        """Undo the preparation of the claim ``ref`` names; its namespace and name must be the ones it was prepared
        under (as prepare checks), so a request naming another claim with this UID removes nothing."""
        uid = ref.uid
        async with self._locks.hold(uid):
            claim = await asyncio.to_thread(self.store.get, uid)
            if claim is not None and (claim.namespace, claim.name) != (ref.namespace, ref.name):
                raise PrepareError(
                    f"claim {uid} was prepared as {claim.namespace}/{claim.name}, not {ref.namespace}/{ref.name}: "
                    "not unprepared"
                )
            if claim is None:
                if uid in self._who:  # held by a preparation cancelled before its record was known to be written
                    self._release(uid)
                    self.devices.claims_changed()
                return
            try:
                await self._undo(claim)
            except (OSError, ValueError) as e:
                raise PrepareError(f"claim {claim.namespace}/{claim.name}: {e}") from None
            self.log.info("claim unprepared", claim=f"{claim.namespace}/{claim.name}", claim_uid=uid)
