"""The server's access log: one line per request, as aiohttp writes it, except the probes.

A Kubernetes readiness probe asks `/health` every couple of seconds and Prometheus scrapes
`/metrics`: logged at INFO they would bury the requests. As uvicorn users filter them under vLLM,
jpaged writes their lines only when the log level is debug (`--log-level debug`).
"""

import logging

from aiohttp.web_log import AccessLogger

PROBE_PATHS = frozenset({"/health", "/metrics"})
ACCESS_LOGGER = "jpaged.access"


class ProbeQuietAccessLogger(AccessLogger):
    def log(self, request, response, time: float) -> None:
        if request.path in PROBE_PATHS and not self.logger.isEnabledFor(logging.DEBUG):
            return
        super().log(request, response, time)


def access_log_options(log_requests: bool) -> dict:
    """The aiohttp AppRunner keywords for the access log: none with --disable-log-requests."""
    if not log_requests:
        return {"access_log": None}
    return {"access_log": logging.getLogger(ACCESS_LOGGER), "access_log_class": ProbeQuietAccessLogger}
