"""Prefect's temporary API server, started in its own session so that a terminal's Ctrl-C reaches
the driver only.

With no ``PREFECT_API_URL``, Prefect starts a temporary server (uvicorn in a subprocess) on first
use. That subprocess shares the driver's process group, so Ctrl-C in a terminal (SIGINT to the whole
foreground group) stops the server at the same instant as it interrupts the driver: the driver's
attempt to record the flow run as crashed then fails with a connection error, and at exit Prefect
waits for its event and log queues to drain to a server that is gone, so the driver hangs. Started
here first, in a new session, the server keeps running until the driver's own exit handler stops it
(Prefect registers ``SubprocessASGIServer.stop`` with ``atexit``), and Prefect's clients reuse it:
``SubprocessASGIServer()`` returns one instance per port, the same one here and in Prefect.
"""

from __future__ import annotations

import subprocess

__all__ = ["start_temporary_server"]


def start_temporary_server() -> str | None:
    """Start Prefect's temporary server in a new session unless an API is configured or it is running.

    Returns:
        The server's API URL, or None when ``PREFECT_API_URL`` is set (a real server: nothing to start).
    """
    from prefect.server.api.server import SubprocessASGIServer
    from prefect.settings import PREFECT_API_URL

    if PREFECT_API_URL.value():
        return None
    server = SubprocessASGIServer()
    if not server.running:
        popen = subprocess.Popen

        def detached(*args, **kwargs):
            kwargs.setdefault("start_new_session", True)
            return popen(*args, **kwargs)

        # Prefect builds the server's command line and environment; only the session is ours to set.
        subprocess.Popen = detached
        try:
            server.start()
        finally:
            subprocess.Popen = popen
    return server.api_url
