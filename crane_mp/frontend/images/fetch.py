"""An image URL of a chat request fetched from a host --allowed-media-domains names, without letting the
request reach what the server can reach and the client cannot (server-side request forgery):

- the URL is parsed once, by yarl, as aiohttp will read it (two parsers could see two hosts);
- only ports --allowed-media-ports names (80 and 443 by default);
- the name is resolved once and every address it resolves to must be public: loopback, private,
  link-local (cloud metadata at 169.254.169.254, fd00:ec2::254), shared, multicast and reserved
  addresses are refused unless --allow-private-media-addresses;
- the connection goes to the addresses checked (a resolver that answers only them), so a second lookup
  cannot return another one (DNS rebinding); the URL keeps the name, for Host, SNI and the certificate;
- the body is read chunk by chunk up to the request's byte limit;
- the remote's status and errors are logged, never answered: they would make the server a probe.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket

import aiohttp
from aiohttp.abc import AbstractResolver, ResolveResult
from yarl import URL

from crane_mp.config import ServerConfig
from crane_mp.frontend.web.errors import ApiError

log = logging.getLogger("crane_mp.frontend")

FETCH_SECONDS = 10.0  # resolving, connecting and reading, together
_PARAM = "messages"
_CHUNK = 1 << 16
# Not reachable from the internet, yet some Python versions call them global: IETF protocol assignments
# (Oracle Cloud's metadata service is 192.0.0.192) and NAT64's local-use prefix.
_NOT_PUBLIC = (ipaddress.ip_network("192.0.0.0/24"), ipaddress.ip_network("64:ff9b:1::/48"))
_NAT64 = ipaddress.ip_network("64:ff9b::/96")


async def fetch_image(config: ServerConfig, where: str, url: str, limit: int) -> bytes:
    """The body of the http(s) image `url` (at most `limit` bytes); every refusal is a 400 naming `where`."""
    target = _checked_url(config, where, url)
    try:
        async with asyncio.timeout(FETCH_SECONDS):
            addresses = await _resolve(target)
            if not config.allow_private_media_addresses:
                _check_public(where, target.raw_host, addresses)
            return await _get(target, addresses, where, limit)
    except (aiohttp.ClientError, OSError, ValueError, TimeoutError) as err:  # socket.gaierror is an OSError
        log.info("the image at %s (host %s) could not be fetched: %r", where, target.raw_host, err)
        raise _unfetched(where) from err


def _checked_url(config: ServerConfig, where: str, url: str) -> URL:
    try:
        target = URL(url)
        host, port = target.host, target.port  # an out-of-range port or a bad IDNA name raise here
    except ValueError as err:  # UnicodeError too
        raise ApiError(400, f"{where}: the image URL is malformed ({err})", _PARAM) from None
    if target.scheme not in ("http", "https") or not host:
        raise ApiError(400, f"{where}: an image URL must be a data: URL or http(s)", _PARAM)
    if not _allowed(host, config.allowed_media_domains):
        raise ApiError(400, f"{where}: images are not fetched from {host!r}; send a data: URL, or start the "
                            "server with --allowed-media-domains naming the host", _PARAM)
    if port not in config.allowed_media_ports:
        ports = ", ".join(map(str, config.allowed_media_ports))
        raise ApiError(400, f"{where}: images are fetched from ports {ports} only (--allowed-media-ports), "
                            f"not {port}", _PARAM)
    return target


def _allowed(host: str, domains: tuple[str, ...]) -> bool:
    host = host.lower().rstrip(".")
    return any(host == d or host.endswith("." + d) for d in (d.lower().strip(".") for d in domains))


async def _resolve(target: URL) -> list[tuple[int, str]]:
    """(family, address) of each address the name resolves to, in the resolver's order, once each."""
    infos = await asyncio.get_running_loop().getaddrinfo(target.raw_host, target.port, type=socket.SOCK_STREAM)
    return list(dict.fromkeys((family, sockaddr[0]) for family, _, _, _, sockaddr in infos))


def _check_public(where: str, host: str, addresses: list[tuple[int, str]]) -> None:
    """A 400 when any address is not public: the operator allowed a name, not whatever it resolves to."""
    private = [address for _, address in addresses if not is_public_address(address)]
    if private:
        log.info("the image at %s is not fetched: host %s resolves to %s, not a public address "
                 "(--allow-private-media-addresses)", where, host, ", ".join(private))
        raise _unfetched(where)


def is_public_address(text: str) -> bool:
    """The address is one the internet routes to, and so is any IPv4 address inside it (mapped, 6to4,
    NAT64): a client could already reach it, so fetching it reaches nothing the client could not."""
    ip = ipaddress.ip_address(text)
    if not ip.is_global or ip.is_multicast or any(ip in network for network in _NOT_PUBLIC
                                                   if network.version == ip.version):
        return False
    inner = _embedded_ipv4(ip) if ip.version == 6 else None
    return inner is None or is_public_address(str(inner))


def _embedded_ipv4(ip: ipaddress.IPv6Address) -> ipaddress.IPv4Address | None:
    if ip in _NAT64:
        return ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
    return ip.ipv4_mapped or ip.sixtofour


class _PinnedResolver(AbstractResolver):
    """Answers aiohttp's lookup with the addresses already resolved and checked, and nothing else."""

    def __init__(self, addresses: list[tuple[int, str]]) -> None:
        self.addresses = addresses

    async def resolve(self, host: str, port: int = 0,
                      family: socket.AddressFamily = socket.AF_INET) -> list[ResolveResult]:
        return [ResolveResult(hostname=host, host=address, port=port, family=address_family, proto=0,
                              flags=socket.AI_NUMERICHOST | socket.AI_NUMERICSERV)
                for address_family, address in self.addresses]

    async def close(self) -> None:
        pass


async def _get(target: URL, addresses: list[tuple[int, str]], where: str, limit: int) -> bytes:
    connector = aiohttp.TCPConnector(resolver=_PinnedResolver(addresses), use_dns_cache=False)
    async with aiohttp.ClientSession(connector=connector) as session:
        async with session.get(target, allow_redirects=False) as response:  # a redirect could lead anywhere
            if response.status != 200:
                log.info("the image at %s (host %s) answered HTTP %d", where, target.raw_host, response.status)
                raise _unfetched(where)
            return await _read_within(response, where, limit)


async def _read_within(response: aiohttp.ClientResponse, where: str, limit: int) -> bytes:
    """The whole body, chunk by chunk as it arrives; a 400 as soon as it passes `limit` bytes."""
    data = bytearray()
    async for chunk in response.content.iter_chunked(_CHUNK):
        data += chunk
        if len(data) > limit:
            raise ApiError(400, f"{where}: the image is larger than {limit} bytes", _PARAM)
    return bytes(data)


def _unfetched(where: str) -> ApiError:
    return ApiError(400, f"could not fetch the image at {where}", _PARAM)
