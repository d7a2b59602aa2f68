"""Endpoint renewal (``Engine.connect``): a NIC slot whose endpoint has writes the engine gave up on that the
provider never reported (stuck behind them: shm never completes a write into a region its peer closed, nor
any write after it on that endpoint) gets a fresh endpoint on the same domain, completion queue and address
vector, swapped in by the slot's worker itself."""
from __future__ import annotations

import threading

from . import _native, fi
from .nics import NicGroups, NicSet, NicSlot

MAX_RENEWALS = 64  # fresh endpoints per NIC slot: a peer that keeps stalling them cannot exhaust file descriptors


class Renewal:
    """The renewals of one engine's NIC slots: how many each had, why one was not renewed (for ``stats()``),
    and the endpoints replaced, which stay open until the engine closes (late completions, and peers writing
    to their addresses)."""

    def __init__(self, nics: NicSet, groups: NicGroups, native: _native.NativeEngine, park_s: float) -> None:
        self.nics, self.groups, self.native, self.park_s = nics, groups, native, park_s
        self.lock = threading.Lock()  # one revival at a time
        self.renewals = [0] * len(nics.slots)
        self.notes: dict[int, str] = {}
        self.replaced_endpoints: list[fi.Endpoint] = []

    def revive_paths(self) -> None:
        """Every worker forgets the paths it had marked dead; first, NIC slots whose endpoint has writes the
        engine gave up on that the provider never reported get a fresh endpoint, which each worker swaps in
        itself (fl_service_revive: never under a thread that posts)."""
        native = self.native
        with self.lock:
            stuck: dict[int, list[tuple[NicSlot, int]]] = {}  # by worker
            for slot in self.nics.slots:
                unreported = native.unreported_writes(slot.index)
                if not unreported:
                    self.notes.pop(slot.index, None)
                elif not native.renewal_waiting(slot.index):
                    why = self._refused(slot)
                    if why:
                        self._note_stuck(slot, unreported, why)
                    else:
                        stuck.setdefault(self.groups.of_slot[slot.index], []).append((slot, unreported))
            for slots in stuck.values():
                # The slot's worker keeps off its NICs meanwhile: a provider may progress an endpoint bound to
                # a CQ as soon as it is bound (shm does, and crashes on one not enabled yet).
                if not native.park_worker(slots[0][0].index, self.park_s):
                    for slot, unreported in slots:
                        self._note_stuck(slot, unreported, "its worker thread could not be paused to renew it")
                    continue
                try:
                    for slot, unreported in slots:
                        self._renew(slot, unreported)
                finally:
                    native.unpark_worker(slots[0][0].index)
            native.revive()

    def annotate(self, per_nic: list[dict[str, object]]) -> None:
        """Add why a slot was not renewed to its ``"down"`` entry of ``stats()["per_nic"]``."""
        for entry in per_nic:
            note = self.notes.get(int(entry["nic"]))  # type: ignore[call-overload]
            if note:
                entry["down"] = f"{entry['down']}; {note}" if entry["down"] else note

    def _refused(self, slot: NicSlot) -> str | None:
        if slot.info.mr_endpoint:
            return ("the provider binds registrations to endpoints (FI_MR_ENDPOINT), so a fresh endpoint could not "
                    "use the regions")
        if self.renewals[slot.index] >= MAX_RENEWALS:
            return f"this slot had {MAX_RENEWALS} fresh endpoints already (a peer that keeps stalling them?)"
        return None

    def _note_stuck(self, slot: NicSlot, unreported: int, why: str) -> None:
        self.notes[slot.index] = (f"endpoint not renewed although {unreported} write(s) given up on were never "
                                  f"reported on it: {why}")

    def _renew(self, slot: NicSlot, unreported: int) -> None:
        """Open a fresh endpoint for ``slot`` on its domain, bound to its CQ and AV (fi_addrs stay valid, and
        the old endpoint's late completions still arrive), and hand it to the slot's worker, which swaps it in
        at the revival. The worker must be parked."""
        try:
            endpoint = fi.Endpoint(self.nics.domains[slot.domain_name], slot.cq, slot.av)
        except (fi.FabricError, fi.UsageError) as exc:
            self._note_stuck(slot, unreported, f"a fresh endpoint could not be opened ({exc})")
            return
        if not self.native.renew_nic(slot.index, endpoint):
            endpoint.close()  # one is already waiting for the worker
            return
        self.replaced_endpoints.append(slot.ep)
        slot.ep = endpoint  # Engine.address now carries the fresh endpoint's
        self.renewals[slot.index] += 1
        self.notes.pop(slot.index, None)
