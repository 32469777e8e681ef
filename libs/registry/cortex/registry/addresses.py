"""Which addresses a worker may have: the rule every service applies to a spec before it
connects to the worker's URL or its event endpoints (pure).

Anyone who can write a worker spec (the admin API, a discovery seed, the registry's Redis)
chooses where the gateway sends requests and where ingest subscribes. By default the
cloud metadata services and link-local ranges are refused (169.254.0.0/16 holds the
metadata address of most clouds; fe80::/10; fd00:ec2::254 on AWS; 100.100.100.200 on
Alibaba; ``metadata.google.internal`` by name). ``allowed`` non-empty: every address must
also be in one of its networks. Literal addresses are checked; a host *name* only by the
names denied, not by what it resolves to (a name that resolves into a denied range is the
DNS operator's doing, and checking at resolution time belongs to the connection).
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable
from dataclasses import dataclass

from cortex.registry.endpoint import Transport, parse_endpoint
from cortex.registry.errors import SpecError
from cortex.registry.spec import WorkerSpec

__all__ = ["DEFAULT_DENIED", "AddressPolicy"]

DEFAULT_DENIED: tuple[str, ...] = ("169.254.0.0/16", "fe80::/10", "fd00:ec2::254/128",
                                   "100.100.100.200/32", "metadata.google.internal",
                                   "metadata")
"""Networks (CIDR) and host names refused by default."""

Network = ipaddress.IPv4Network | ipaddress.IPv6Network


@dataclass(frozen=True, slots=True)
class AddressPolicy:
    """``denied`` / ``allowed``: CIDR networks and host names (case-insensitive)."""

    denied_networks: tuple[Network, ...]
    denied_names: frozenset[str]
    allowed_networks: tuple[Network, ...] = ()
    allowed_names: frozenset[str] = frozenset()

    @classmethod
    def of(cls, denied: Iterable[str] = DEFAULT_DENIED, allowed: Iterable[str] = ()
           ) -> AddressPolicy:
        """From CIDRs and names; ``ValueError`` naming an entry that is neither."""
        deny_nets, deny_names = _split(denied)
        allow_nets, allow_names = _split(allowed)
        return cls(deny_nets, deny_names, allow_nets, allow_names)

    def check_host(self, host: str) -> None:
        """:class:`SpecError` when ``host`` (a name or a literal address) is refused."""
        name = host.strip("[]").lower().rstrip(".")
        try:
            address = ipaddress.ip_address(name.split("%", 1)[0])
        except ValueError:
            address = None
        if address is None:
            if name in self.denied_names:
                raise SpecError(f"host {host!r} is denied")
            if (self.allowed_networks or self.allowed_names) and name not in self.allowed_names:
                raise SpecError(f"host {host!r} is not in the allowed worker addresses")
            return
        if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
            address = address.ipv4_mapped
        if any(address in net for net in self.denied_networks):
            raise SpecError(f"address {host!r} is in a denied network")
        if (self.allowed_networks or self.allowed_names) and not any(
                address in net for net in self.allowed_networks):
            raise SpecError(f"address {host!r} is not in the allowed worker networks")

    def check(self, spec: WorkerSpec) -> None:
        """:class:`SpecError` when the worker's URL or one of its TCP event endpoints is on
        a refused host."""
        self.check_host(spec.host)
        for endpoint in (spec.kv_events, spec.replay):
            if endpoint is None:
                continue
            parsed = parse_endpoint(endpoint)
            if parsed.transport is Transport.TCP and not parsed.is_wildcard:
                self.check_host(parsed.host)


def _split(entries: Iterable[str]) -> tuple[tuple[Network, ...], frozenset[str]]:
    networks: list[Network] = []
    names: set[str] = set()
    for entry in entries:
        text = entry.strip()
        if not text:
            continue
        if "/" in text or ":" in text or text.replace(".", "").isdigit():
            try:
                networks.append(ipaddress.ip_network(text, strict=False))
            except ValueError:
                raise ValueError(f"{text!r} is neither a network nor a host name") from None
        else:
            names.add(text.lower().rstrip("."))
    return tuple(networks), frozenset(names)
