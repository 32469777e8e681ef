"""What the registry must be told so that it holds exactly the Ready pods (pure).

The discovery is one producer of leases among others (operators' ``cortex workers add``,
static seeds, the gateways' probes re-asserting what they reach). It only ever touches
workers it registered (labelled ``discovered-by`` with its own name), and it respects an
operator's removal: a tombstone it did not write keeps the pod out until the operator
registers the worker again.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass

from cortex.registry.base import Listing
from cortex.registry.spec import WorkerSpec

__all__ = ["REMOVAL_REASON", "Plan", "plan"]

REMOVAL_REASON = "kubernetes: pod gone or not ready"
"""The reason of the tombstones the discovery writes; any other is an operator's."""


@dataclass(frozen=True, slots=True)
class Plan:
    """``register``: new or changed workers (written over what is there); ``renew``:
    unchanged workers whose lease is extended; ``remove``: ids of workers this discovery
    registered whose pod is gone or not ready (tombstoned, so a gateway that still reaches
    the old address does not bring it back); ``held``: ids an operator removed."""

    register: tuple[WorkerSpec, ...] = ()
    renew: tuple[WorkerSpec, ...] = ()
    remove: tuple[str, ...] = ()
    held: tuple[str, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.register or self.remove)

    def __repr__(self) -> str:
        return (f"Plan(register={[s.id for s in self.register]}, renew={len(self.renew)}, "
                f"remove={list(self.remove)}, held={list(self.held)})")


def plan(desired: Mapping[str, WorkerSpec], listing: Listing, discovered_by: str,
         previous: Collection[str] = ()) -> Plan:
    """Compare the Ready pods' specs with the registry as listed. ``previous``: the ids
    desired last time; one that left is tombstoned even when its lease already lapsed (a
    gateway remembers a lapsed worker and would bring it back if its address answered)."""
    register: list[WorkerSpec] = []
    renew: list[WorkerSpec] = []
    held: list[str] = []
    for worker_id, spec in sorted(desired.items()):
        current = listing.workers.get(worker_id)
        stone = listing.tombstones.get(worker_id)
        if current == spec:
            renew.append(spec)
        elif current is None and stone is not None and stone.reason != REMOVAL_REASON:
            held.append(worker_id)
        else:
            register.append(spec)
    ours = {worker_id for worker_id, spec in listing.workers.items()
            if spec.labels.get("discovered-by") == discovered_by}
    left = {worker_id for worker_id in previous if worker_id not in listing.tombstones}
    remove = sorted((ours | left) - desired.keys())
    return Plan(tuple(register), tuple(renew), tuple(remove), tuple(held))
