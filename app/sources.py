"""A request's source address, for the per-address job cap (max_queued_jobs_per_address, app/jobs.py): a client id
(X-Attnlab-Client, the attnlab_client cookie) costs nothing to mint, an address does.

The source is the socket peer, unless the peer is one of `trusted_proxies` (addresses or networks): then it is the
rightmost address of X-Forwarded-For that is not itself a trusted proxy (each proxy appends the address it was
reached from, so the addresses left of the last untrusted one are the client's own claims). A forwarding replica
(app/fleet.py) appends its own peer in the same way.
"""
from __future__ import annotations

import ipaddress
from functools import lru_cache

Network = ipaddress.IPv4Network | ipaddress.IPv6Network


@lru_cache(maxsize=16)
def trusted_networks(entries: tuple[str, ...]) -> tuple[Network, ...]:
    """The trusted_proxies setting as networks ("10.0.0.7" is 10.0.0.7/32); ValueError naming a bad entry."""
    networks = []
    for entry in entries:
        try:
            networks.append(ipaddress.ip_network(entry.strip(), strict=False))
        except ValueError:
            raise ValueError(f"trusted_proxies: {entry!r} is not an IP address or network (e.g. 10.0.0.0/8)") from None
    return tuple(networks)


def _trusted(address: str, networks: tuple[Network, ...]) -> bool:
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return False
    return any(ip in network for network in networks)


def source_address(headers: list[tuple[bytes, bytes]], peer: tuple[str, int] | None,
                   trusted: list[str] | tuple[str, ...]) -> str:
    """The request's source address: the peer's, or what trusted proxies forwarded (see the module doc)."""
    address = peer[0] if peer else "?"
    networks = trusted_networks(tuple(trusted)) if trusted else ()
    if not networks or not _trusted(address, networks):
        return address
    hops = [part.strip() for key, value in headers if key == b"x-forwarded-for"
            for part in value.decode("latin-1").split(",")]
    for hop in reversed(hops):
        if not hop:
            continue
        if not _trusted(hop, networks):
            return _plain(hop)
    return address  # every hop a trusted proxy (or no header): the request began inside


def _plain(hop: str) -> str:
    """An X-Forwarded-For entry as an address: a valid IP as written by ipaddress, anything else kept short."""
    try:
        return str(ipaddress.ip_address(hop))
    except ValueError:
        return hop[:64]
