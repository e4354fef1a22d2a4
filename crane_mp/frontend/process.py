"""Frontend process: bind HTTP early (503 until the engine is ready), then serve; drain on SIGTERM.

Start-up handshake with the launcher over its pipe: we send b"listening", receive the worker's
WorkerReady once the scheduler is up, connect, and send b"ready". SIGUSR1 from the launcher means
the engine died: every open request is ended with an error at once.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from multiprocessing.connection import Connection
from pathlib import Path

import msgspec
from aiohttp import web

from crane_mp.config import ServerConfig
from crane_mp.frontend.app import create_app
from crane_mp.frontend.responses.store import ResponseStore
from crane_mp.frontend.serving.engine_client import EngineClient
from crane_mp.frontend.serving.tokenizer import TokenizerService
from crane_mp.frontend.state import FrontendState
from crane_mp.frontend.web.access_log import MalformedRequests
from crane_mp.frontend.web.connections import raise_fd_limit
from crane_mp.ipc import Addresses
from crane_mp.logs import configure_logging
from crane_mp.protocol import WorkerReady

_ACCEPT_BACKLOG = 4096  # the kernel caps it at net.core.somaxconn


async def _serve(config: ServerConfig, addresses: Addresses, frontend_id: int, life: int, conn: Connection) -> None:
    loop = asyncio.get_running_loop()
    state = FrontendState(config, TokenizerService(config.engine.model_path, config.engine.model_format))
    # aiohttp's own access log is off: ours (access_log.py) knows tokens, TTFT and the request id.
    # An idle keep-alive connection is closed after --read-timeout (aiohttp's own default is 75 s).
    runner = web.AppRunner(create_app(state), handler_cancellation=True, access_log=None,
                           keepalive_timeout=config.read_timeout)
    await runner.setup()
    state.connections.attach(runner.server)
    raise_fd_limit(config.max_connections)
    # Several frontends share the port; the kernel spreads connections over them. A deep accept queue:
    # with aiohttp's 128, a burst of connections overflows it and clients wait out SYN retries (1 s,
    # 3 s) before even a 429 can reach them.
    shared = config.num_frontends > 1
    if config.unix_socket:  # one model of several: the router reaches it here
        site = web.UnixSite(runner, config.unix_socket, backlog=_ACCEPT_BACKLOG)
    else:
        site = web.TCPSite(runner, config.host, config.port, reuse_address=True, reuse_port=shared or None,
                           backlog=_ACCEPT_BACKLOG)
    await site.start()
    conn.send_bytes(b"listening")

    try:
        info = msgspec.msgpack.decode(await loop.run_in_executor(None, conn.recv_bytes), type=WorkerReady)
    except EOFError:  # the launcher stopped during start-up (a signal, or the worker failed): it says why
        await runner.cleanup()
        return
    state.client = EngineClient(addresses, frontend_id, config.request_timeout, life)
    state.responses = ResponseStore(Path(addresses.run_dir) / "responses")
    state.client.metrics = state.metrics
    state.client.on_adapters = state.set_adapters
    state.client.on_state = state.set_engine_state
    state.client.start()
    state.engine_info = info
    vocabulary = None
    if config.engine.task == "generate":
        vocabulary = asyncio.create_task(state.grammars.load_vocabulary(info.vocab_size, info.eos_token_ids))
    conn.send_bytes(b"ready")

    stop = asyncio.Event()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    loop.add_signal_handler(signal.SIGUSR1, lambda: state.client.fail_all("an engine process died"))
    await stop.wait()

    # Drain: new requests get 503, in-flight ones may finish within the grace period.
    state.draining = True
    deadline = loop.time() + config.shutdown_grace
    while state.client.streams and loop.time() < deadline:
        await asyncio.sleep(0.05)
    state.client.fail_all("the server is shutting down")
    await asyncio.sleep(0.05)  # let handlers write their last bytes
    await runner.cleanup()
    if vocabulary is not None:
        vocabulary.cancel()
    await state.client.close()
    state.grammars.close()
    state.tokenizer.close()


def run_frontend(config: ServerConfig, addresses: Addresses, frontend_id: int, life: int, conn: Connection) -> None:
    configure_logging(config.logs)
    logging.getLogger("aiohttp.server").addFilter(MalformedRequests())
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the launcher decides how Ctrl-C ends the server
    try:
        import uvloop
    except ImportError:
        asyncio.run(_serve(config, addresses, frontend_id, life, conn))
    else:
        uvloop.run(_serve(config, addresses, frontend_id, life, conn))
    # Every socket, file and request is closed: the interpreter's teardown of the tokenizer and the
    # transformers modules (most of a second, every stop and restart) serves nothing.
    logging.shutdown()
    os._exit(0)
