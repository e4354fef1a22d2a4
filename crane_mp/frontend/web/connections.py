"""ConnectionGuard: how many connections one frontend holds open, and how long a new one may take to send
its first request's headers.

aiohttp bounds neither (older releases wait for the first request line forever), so a few hundred clients
trickling a byte a second would hold the process's sockets and file descriptors. The guard hooks the two
connection callbacks of aiohttp's low-level `web.Server`: a connection past `--max-connections` is answered
503 and closed before anything is read; one whose headers have not arrived within `--read-timeout` is
answered 408 and closed. Later requests on a kept-alive connection are bounded by the keep-alive timeout
(the same `--read-timeout`), bodies by `routing.read_body`.

A refused connection never reaches the access middleware: the guard counts it (the metric the state hands
it) and writes the access log's line itself, one a second at most under a flood, with the count since the
previous line.
"""

from __future__ import annotations

import asyncio
import logging
import resource
import time
from typing import Callable

from aiohttp import web

log = logging.getLogger("crane_mp.frontend")
access_log = logging.getLogger("crane_mp.access")

# File descriptors the process needs besides its client connections (ZeroMQ sockets, the tokenizer,
# logs, the kernel cache).
_RESERVED_FDS = 256


def _raw_response(status: str, kind: str, message: str) -> bytes:
    body = ('{"error": {"message": "%s", "type": "%s", "param": null, "code": %s}}'
            % (message, kind, status.split()[0])).encode()
    return (b"HTTP/1.1 %s\r\nContent-Type: application/json\r\nContent-Length: %d\r\nRetry-After: 1\r\n"
            b"Connection: close\r\n\r\n%s" % (status.encode(), len(body), body))


_TOO_MANY = _raw_response("503 Service Unavailable", "service_unavailable",
                          "this frontend holds too many open connections; retry")
_TOO_SLOW = _raw_response("408 Request Timeout", "timeout_error",
                          "the request headers did not arrive within --read-timeout")


class RefusalLog:
    """Connections refused past --max-connections, in the access log: the first at once, later ones
    gathered into at most one line per `interval` seconds, so a flood of them cannot flood the log."""

    def __init__(self, max_connections: int, interval: float = 1.0) -> None:
        self.max_connections = max_connections
        self.interval = interval
        self.pending = 0  # refused since the last line
        self._last_line = -interval
        self._flush: asyncio.TimerHandle | None = None

    def add(self) -> None:
        self.pending += 1
        if self._flush is not None:  # a line is already due
            return
        wait = self._last_line + self.interval - time.monotonic()
        if wait <= 0:
            self._write()
        else:
            self._flush = asyncio.get_running_loop().call_later(wait, self._write)

    def _write(self) -> None:
        self._flush = None
        self._last_line = time.monotonic()
        access_log.warning("refused %d connection(s) with 503: --max-connections %d were open", self.pending,
                           self.max_connections, extra={"fields": {"status": 503, "refused": self.pending}})
        self.pending = 0


class ConnectionGuard:
    def __init__(self, max_connections: int, header_timeout: float,
                 count_refusal: Callable[[], None] = lambda: None) -> None:
        self.max_connections = max_connections
        self.header_timeout = header_timeout
        self.open: set[web.RequestHandler] = set()
        self.refused = 0
        self.refusals = RefusalLog(max_connections)
        self._count_refusal = count_refusal  # the exported counter (metrics.py)
        self._deadlines: dict[web.RequestHandler, asyncio.TimerHandle] = {}

    def attach(self, server: web.Server) -> None:
        """Wrap the server's connection callbacks (it calls them for every connection it accepts)."""
        made, lost = server.connection_made, server.connection_lost

        def connection_made(handler: web.RequestHandler, transport: asyncio.Transport) -> None:
            made(handler, transport)
            if len(self.open) >= self.max_connections:
                self.refused += 1
                self._count_refusal()
                self.refusals.add()
                transport.write(_TOO_MANY)
                handler.force_close()  # the transport sends the 503, then closes
                return
            self.open.add(handler)
            loop = asyncio.get_running_loop()
            self._deadlines[handler] = loop.call_later(self.header_timeout, self._expire, handler, transport)

        def connection_lost(handler: web.RequestHandler, exc: BaseException | None = None) -> None:
            self.open.discard(handler)
            self._cancel(handler)
            lost(handler, exc)

        server.connection_made = connection_made
        server.connection_lost = connection_lost

    def request_started(self, handler: web.RequestHandler | None) -> None:
        """A request's headers arrived on this connection: it is no longer racing the header deadline."""
        if handler is not None:
            self._cancel(handler)

    def _cancel(self, handler: web.RequestHandler) -> None:
        deadline = self._deadlines.pop(handler, None)
        if deadline is not None:
            deadline.cancel()

    def _expire(self, handler: web.RequestHandler, transport: asyncio.Transport) -> None:
        self._deadlines.pop(handler, None)
        if not transport.is_closing():
            transport.write(_TOO_SLOW)
        handler.force_close()


def raise_fd_limit(max_connections: int) -> None:
    """Lift this process's soft file-descriptor limit (often 1,024 under systemd) towards what
    --max-connections needs, within the hard limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = max_connections + _RESERVED_FDS
    if hard != resource.RLIM_INFINITY:
        want = min(want, hard)
    if soft != resource.RLIM_INFINITY and soft < want:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
        soft = want
    if soft != resource.RLIM_INFINITY and soft < max_connections + _RESERVED_FDS:
        log.warning("the file-descriptor limit (%d) is below what --max-connections %d needs; raise "
                    "LimitNOFILE (systemd) or `ulimit -n`", soft, max_connections)
