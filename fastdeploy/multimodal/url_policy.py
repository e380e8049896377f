"""Which http(s):// feature URLs the server may fetch, and the address it connects to for each.

A request's feature URL makes the server open a connection, so without a check
a client could make it fetch from inside its network (server-side request
forgery): a loopback admin port, the cloud metadata service at 169.254.169.254,
a private object store. :class:`MediaUrlPolicy` refuses, by default, every
address that is not globally routable, *after* DNS resolution: every address a
name resolves to must pass, and the fetch then connects to the checked address
(:meth:`MediaUrlPolicy.pin`), so DNS rebinding cannot swap it between the check
and the connection. :mod:`fastdeploy.multimodal.sources` applies the policy
again at every redirect hop.
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address

_NAT64 = (ipaddress.ip_network("64:ff9b::/96"), ipaddress.ip_network("64:ff9b:1::/48"))


class MediaUrlRefused(Exception):
    """A URL (or a redirect hop) the policy refuses; the text is for the server log only."""


def system_resolve(host: str, port: int) -> list[str]:
    """Every address ``host`` resolves to (``getaddrinfo``, TCP), in the resolver's order, without repeats."""
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return list(dict.fromkeys(str(info[4][0]) for info in infos))


def _embedded_ipv4(ip: ipaddress.IPv6Address) -> ipaddress.IPv4Address | None:
    """The IPv4 address an IPv6 one stands for: IPv4-mapped, 6to4 or NAT64; else None."""
    if ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    if ip.sixtofour is not None:
        return ip.sixtofour
    if any(ip in net for net in _NAT64):
        return ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
    return None


def is_public_address(ip: IPAddress) -> bool:
    """Whether ``ip`` is a globally routable unicast address (IPv4 or IPv6).

    Refused: loopback, private (RFC 1918, unique local), shared (100.64/10),
    link-local, multicast, unspecified and reserved addresses, and IPv6
    addresses that embed a refused IPv4 one (``::ffff:127.0.0.1``, 6to4, NAT64).
    Teredo is refused outright.
    """
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.teredo is not None:
            return False
        embedded = _embedded_ipv4(ip)
        if embedded is not None:
            return is_public_address(embedded)
    special = (
        ip.is_loopback,
        ip.is_private,
        ip.is_link_local,
        ip.is_multicast,
        ip.is_unspecified,
        ip.is_reserved,
    )
    return ip.is_global and not any(special)


def _ip_literal(host: str) -> IPAddress | None:
    try:
        return ipaddress.ip_address(host)
    except ValueError:
        return None


def _normal_domain(name: str) -> str:
    """A host name of ``--allowed-media-domains`` as URLs carry it: lower case, IDNA, no outer dots."""
    name = name.strip().lower().removeprefix("*.").strip(".")
    try:
        return name.encode("idna").decode("ascii")
    except UnicodeError:
        raise ValueError(f"--allowed-media-domains: {name!r} is not a valid host name") from None


@dataclass(frozen=True)
class MediaUrlPolicy:
    """What http(s):// feature URLs may reach: allowed host names and whether private addresses are.

    Built once per server from ``--allowed-media-domains`` and
    ``--allow-private-media-urls`` (:meth:`from_config`). ``resolve`` and
    ``address_allowed`` are injectable so tests can simulate DNS.
    """

    allowed_domains: tuple[str, ...] = ()
    """Host names (normalized) a URL may name; a name also admits its subdomains. Empty: any host."""
    allow_private: bool = False
    """Skip the address check (loopback, private, link-local... allowed)."""
    max_redirects: int = 5
    """Redirects followed per URL; each hop is checked like the first."""
    resolve: Callable[[str, int], Sequence[str]] = field(default=system_resolve, repr=False)
    """``(host, port) -> addresses``; called once per hop."""
    address_allowed: Callable[[IPAddress], bool] = field(default=is_public_address, repr=False)
    """The address check applied to every resolved address unless ``allow_private``."""

    @classmethod
    def from_config(cls, allowed_media_domains: str | None, allow_private_media_urls: bool) -> MediaUrlPolicy:
        """The policy of the ``ModelConfig`` fields of the same names (comma-separated domains)."""
        names = (allowed_media_domains or "").split(",")
        domains = tuple(dict.fromkeys(_normal_domain(n) for n in names if n.strip(" .*")))
        return cls(allowed_domains=domains, allow_private=bool(allow_private_media_urls))

    def host_allowed(self, host: str) -> bool:
        """Whether the allow-list admits ``host`` (itself or, for a name, a subdomain of a listed one)."""
        if not self.allowed_domains:
            return True
        host = host.lower().rstrip(".")
        if _ip_literal(host) is not None:
            return host in self.allowed_domains
        return any(host == d or host.endswith("." + d) for d in self.allowed_domains)

    def pin(self, host: str, port: int) -> str:
        """The address to connect to for ``host``: resolved once here, every answer checked.

        An IP literal is not resolved. Raises :class:`MediaUrlRefused` when the
        allow-list refuses ``host`` or any of its addresses is refused, and
        ``OSError`` when it does not resolve. The caller must connect to the
        returned address (not resolve ``host`` again), which is what stops DNS
        rebinding.
        """
        if not host:
            raise MediaUrlRefused("the URL names no host")
        if not self.host_allowed(host):
            raise MediaUrlRefused(f"host {host!r} is not in --allowed-media-domains")
        literal = _ip_literal(host)
        addresses = [host] if literal is not None else list(self.resolve(host, port))
        if not addresses:
            raise OSError(f"{host!r} resolved to no address")
        if not self.allow_private:
            for address in addresses:
                ip = ipaddress.ip_address(address.split("%", 1)[0])
                if not self.address_allowed(ip):
                    raise MediaUrlRefused(
                        f"host {host!r} has the non-public address {address} (see --allow-private-media-urls)"
                    )
        return addresses[0]
