"""systemd's watchdog (WatchdogSec=): ping WATCHDOG=1 at half the interval while the whole pipeline
answers, so a hung frontend, scheduler or worker gets the service restarted.

The probe is GET /v1/stats: a frontend answers it with the scheduler's figures, and the scheduler
reports how long its current step has been running on the worker; a step older than the watchdog
interval means the worker is stuck. No ping is sent while the probe fails.
"""

from __future__ import annotations

import http.client
import json
import logging
import os
import time

from crane_mp.config import ServerConfig
from crane_mp.systemd import notify

log = logging.getLogger("crane_mp.launch")
_LOOPBACK = {"0.0.0.0": "127.0.0.1", "": "127.0.0.1", "::": "::1"}


class Watchdog:
    def __init__(self, config: ServerConfig, interval: float) -> None:
        self.interval = interval  # systemd's WatchdogSec
        self.host = _LOOPBACK.get(config.host, config.host)
        self.port = config.port
        self.headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
        self.last_ping = 0.0

    @classmethod
    def from_environment(cls, config: ServerConfig) -> Watchdog | None:
        """Armed when systemd set WATCHDOG_USEC for this process."""
        usec = os.environ.get("WATCHDOG_USEC", "")
        pid = os.environ.get("WATCHDOG_PID", "")
        if not usec.isdigit() or int(usec) == 0 or (pid and pid != str(os.getpid())):
            return None
        return cls(config, int(usec) / 1e6)

    def tick(self) -> None:
        """Called from the supervision loop; probes and pings once half the interval has passed."""
        now = time.monotonic()
        if now - self.last_ping < self.interval / 2:
            return
        problem = self.probe()
        if problem is None:
            notify("WATCHDOG=1")
            self.last_ping = now
        else:
            log.warning("watchdog: not pinging systemd: %s", problem)
            self.last_ping = now - self.interval / 4  # probe again soon

    def probe(self) -> str | None:
        """None when the pipeline answers, else what is wrong."""
        conn = http.client.HTTPConnection(self.host, self.port, timeout=min(5.0, self.interval / 4))
        try:
            conn.request("GET", "/v1/stats", headers=self.headers)
            response = conn.getresponse()
            body = response.read()
            if response.status != 200:
                return f"/v1/stats answered {response.status}"
            step_age = json.loads(body).get("step_age", 0.0)
        except Exception as err:  # whatever the probe hit, the launcher must go on supervising
            return f"/v1/stats did not answer: {err!r}"
        finally:
            conn.close()
        if step_age > self.interval:
            return f"the worker has been running one step for {step_age:.0f} s"
        return None
