"""crane-launch with several models: the router on the public port, each model's own processes behind it.

Start-up: the port is bound first (503 while loading), the models loaded at start (pinned ones, or all
without --load-on-demand) load one after another, then one line per model and systemd's READY=1.
A pinned model (or, without --load-on-demand, any model) whose processes die stops the server, exit 1,
so systemd restarts it; another model's death unloads it, and the next request for it loads it again.
SIGTERM/SIGINT drain: the models' own frontends let in-flight requests finish within --shutdown-grace.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import signal
import tempfile
import time
from typing import Callable

import aiohttp
from aiohttp import web

from crane_mp.router.app import create_router_app
from crane_mp.router.command import ModelSet
from crane_mp.router.group import GroupFailed
from crane_mp.router.manager import ModelManager, ModelUnavailable
from crane_mp.systemd import notify
from crane_mp.watchdog import Watchdog

log = logging.getLogger("crane_mp.router")

_ACCEPT_BACKLOG = 4096
_WATCH_SECONDS = 0.2


def run_router(models: ModelSet, target: Callable) -> int:
    """`target`: each model's process (launch.model_group_main)."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(_serve(models, target))
    return uvloop.run(_serve(models, target))


async def _serve(models: ModelSet, target: Callable) -> int:
    loop = asyncio.get_running_loop()
    run_dir = tempfile.mkdtemp(prefix="crane-mp-")  # mode 0700: only we reach the models' sockets
    manager = ModelManager(models, run_dir, target)
    public = models.public
    runner = web.AppRunner(create_router_app(manager), handler_cancellation=True, access_log=None,
                           keepalive_timeout=public.read_timeout)
    await runner.setup()
    await web.TCPSite(runner, public.host, public.port, reuse_address=True, backlog=_ACCEPT_BACKLOG).start()
    stop = asyncio.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    code = 1
    try:
        starting = asyncio.create_task(manager.start())
        await asyncio.wait([starting, asyncio.create_task(stop.wait())], return_when=asyncio.FIRST_COMPLETED)
        if stop.is_set():
            starting.cancel()
            return 0
        starting.result()
        for slot in manager.slots.values():
            log.info("model %s: task=%s path=%s state=%s%s", slot.name, slot.task, slot.spec.config.engine.model_path,
                     slot.state, " pinned" if slot.spec.pinned else "")
        log.info("ready: %d models (%s loaded), budget %s, load_on_demand=%s, listening on http://%s:%d",
                 len(manager.slots), sum(s.state == "loaded" for s in manager.slots.values()),
                 "none" if manager.budget is None else f"{manager.budget / (1 << 30):.2f} GiB",
                 "on" if models.load_on_demand else "off", public.host, public.port)
        notify("READY=1\nSTATUS=serving " + ", ".join(manager.slots))
        code = await _supervise(manager, stop)
    except (GroupFailed, ModelUnavailable) as err:
        log.error("start-up failed: %s", err)
    finally:
        notify("STOPPING=1")
        await manager.stop(public.shutdown_grace)
        await runner.cleanup()
        shutil.rmtree(run_dir, ignore_errors=True)
        log.info("stopped (exit code %d)", code)
    return code


async def _supervise(manager: ModelManager, stop: asyncio.Event) -> int:
    """Until a stop signal (0) or the death of a model the server cannot do without (1). Under systemd's
    watchdog, WATCHDOG=1 at half its interval while every loaded model's pipeline answers."""
    watchdog = Watchdog.from_environment(manager.models.public)
    last_ping = 0.0
    while not stop.is_set():
        try:
            await asyncio.wait_for(stop.wait(), _WATCH_SECONDS)
        except TimeoutError:
            pass
        now = time.monotonic()
        if watchdog is not None and now - last_ping >= watchdog.interval / 2:
            problem = await _probe_models(manager, watchdog.interval)
            if problem is None:
                notify("WATCHDOG=1")
                last_ping = now
            else:
                log.warning("watchdog: not pinging systemd: %s", problem)
                last_ping = now - watchdog.interval / 4  # probe again soon
        for slot in list(manager.slots.values()):
            if slot.state != "loaded" or slot.group is None or slot.group.alive:
                continue
            await manager.lost(slot)
            if slot.spec.pinned or not manager.models.load_on_demand:
                log.error("model %s cannot be kept serving; stopping the server", slot.name)
                return 1
    log.info("draining: finishing in-flight requests (up to %.0f s)", manager.models.public.shutdown_grace)
    return 0


async def _probe_models(manager: ModelManager, interval: float) -> str | None:
    """None when every loaded model's /v1/stats answers and no step of its has run past `interval`."""
    for slot in list(manager.slots.values()):
        if slot.state != "loaded" or slot.session is None:
            continue
        try:
            async with slot.session.get("http://model/v1/stats", timeout=min(5.0, interval / 4)) as response:
                if response.status != 200:
                    return f"model {slot.name}: /v1/stats answered {response.status}"
                step_age = (await response.json()).get("step_age", 0.0)
        except (aiohttp.ClientError, TimeoutError, ValueError) as err:
            return f"model {slot.name}: /v1/stats did not answer: {err!r}"
        if step_age > interval:
            return f"model {slot.name}: its worker has been running one step for {step_age:.0f} s"
    return None
