"""A Ray on this host, started by the library for a build: listening on the loopback only, its output kept off
standard output, the CLI's SIGTERM handler kept, and its start tried again on a slow host. ``distributed`` uses
these around ``ray.init``.
"""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

log = logging.getLogger(__name__)

LOCAL_RAY_ENV = {
    "RAY_USAGE_STATS_ENABLED": "0",  # no usage report
    "RAY_AUTH_MODE": "disabled",  # no ~/.ray/auth_token
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",  # a one-node Ray: every listener on 127.0.0.1 (see on_loopback)
}


@contextmanager
def on_loopback() -> Iterator[None]:
    """Within the block, a Ray started by this process listens on 127.0.0.1 only, not on the machine's external
    address (its GCS, raylet and workers accept tasks: code execution for anyone who can reach them).

    Ray reads RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER once, when it is imported, into a constant that decides both the
    node's address and where its servers bind (Ray 2.60: ``ray._private.ray_constants.ENABLE_RAY_CLUSTER``); a
    process that imported ray before setting the variable (any caller of the library) gets every listener on
    all interfaces. So the constant itself is set for the start and restored after it: a cluster joined later
    by the same process is reached by its real address."""
    from ray._private import ray_constants

    saved = ray_constants.ENABLE_RAY_CLUSTER
    ray_constants.ENABLE_RAY_CLUSTER = False
    try:
        yield
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = saved


def ray_output_to_stderr() -> Callable[..., None]:
    """Send what Ray prints on the driver for its workers and its raylet ("worker died ... will be retried",
    a worker's own output) to standard error; returns the printer it replaced, to put back.

    Ray prints those lines on standard output (Ray 2.60: ``ray._private.worker.print_to_stdstream``, which the
    raylet's error listener calls, and which ``ray.init`` binds as the printer of workers' lines): ahead of
    what a script reads from a command's standard output. ``log_to_driver=False`` would hide the workers' lines
    and still print the raylet's; marked as error output, both go to standard error, deduplicated as Ray does."""
    from ray._private import worker

    printer: Callable[..., None] = worker.print_to_stdstream

    def to_stderr(data: dict[str, Any], ignore_prefix: bool) -> None:
        printer({**data, "is_err": True}, ignore_prefix)

    worker.print_to_stdstream = to_stderr
    return printer


def init_local(ray: Any, attempts: int = 2, **options: Any) -> Any:
    """``ray.init(**options)`` for a Ray on this host, tried again when it gives up waiting for its own
    raylet: Ray allows a fixed 30 s for the raylet to register with the GCS, which a loaded machine (a CI box
    running other jobs) can exceed while nothing is wrong."""
    for attempt in range(1, attempts + 1):
        try:
            return ray.init(**options)
        except Exception as err:  # Ray raises a bare Exception for this one
            if attempt == attempts or "timed out during startup" not in str(err):
                raise
            log.warning("Ray's node did not start in time (%s); starting it again", err)
            ray.shutdown()
    raise AssertionError("unreachable")


@contextmanager
def keep_sigterm_handler() -> Iterator[None]:
    """Put back the SIGTERM handler ``ray.init`` replaces with its own (and ``ray.shutdown`` with the default,
    beneath Python, which still reports its own): the CLI's (``error: terminated``, exit 143, a build's parts
    kept for --resume) became Ray's, and a SIGTERM during a Ray build aborted the process with a C++ stack dump
    (exit -6)."""
    if threading.current_thread() is not threading.main_thread():  # handlers belong to the main thread
        yield
        return
    handler = signal.getsignal(signal.SIGTERM)
    try:
        yield
    finally:
        if handler is not None:  # None: one installed outside Python, which Python cannot put back
            signal.signal(signal.SIGTERM, handler)
