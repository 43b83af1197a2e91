"""``serve``: the HTTP service over an index (the ``[server]`` extra)."""

from __future__ import annotations

import logging
import signal
from pathlib import Path
from typing import Annotated, Any

import typer

from retrieval.cli import home
from retrieval.cli.options import adds_options
from retrieval.cli.shell import err, safe, user_errors
from retrieval.errors import ConfigError, RetrievalError
from retrieval.serve.service import ServeOptions


def _threads_option(value: str, name: str) -> int | str:
    """auto, or a whole number (range checked by ServeOptions)."""
    value = value.strip().lower()
    if value == "auto":
        return value
    try:
        return int(value)
    except ValueError:
        raise ConfigError(f"`{name}` must be auto or a positive integer (got {value!r})", name) from None


@user_errors
@adds_options(ServeOptions)
def serve(
    index_dir: Annotated[Path | None, typer.Argument(help="Index directory \\[default: the last built].")] = None,
    host: Annotated[str, typer.Option(help="Address to bind (loopback by default).")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="TCP port.")] = 8000,
    api_key: Annotated[
        str | None,
        typer.Option(
            envvar="RETRIEVAL_API_KEY",
            show_default=False,
            help="Require `Authorization: Bearer KEY` on every API route but /health; the page, /docs and "
            "/openapi.json stay open (or set RETRIEVAL_API_KEY).",
        ),
    ] = None,
    shutdown_timeout: Annotated[int, typer.Option(help="On SIGTERM, seconds to let requests in flight finish.")] = 30,
    **served: Any,
) -> None:
    """Serve an index over HTTP (FastAPI): /search, /embed, /info, /health, /ready, /metrics, a page at /."""
    from retrieval.indexdir import IndexDir

    try:
        from retrieval.serve import app as server
    except ImportError as exc:
        raise RetrievalError(
            f"the server needs its extra ({exc.name} is missing): pip install 'retrieval[server]' "
            "(from a checkout: pip install -e '.[server]')"
        ) from exc
    if not 0 <= port <= 65535:
        raise ConfigError(f"`port` must be between 0 and 65535 (got {port})", "port")
    if shutdown_timeout < 0:
        raise ConfigError(f"`shutdown_timeout` must be 0 or more seconds (got {shutdown_timeout})", "shutdown_timeout")
    served["torch_threads"] = _threads_option(served["torch_threads"], "torch_threads")
    options = ServeOptions(**served)
    options.check()
    server.check_api_key(api_key)
    directory = index_dir or home.default_index("name it: `retrieval serve DIR`")
    IndexDir(directory).manifest()  # a missing or foreign directory fails here, in one line, not in the server

    def announce(url: str) -> None:  # once the port is bound (the one it got, for --port 0), before the model loads
        err.print(f"serving {safe(str(directory))} on {url} (docs at /docs)", markup=False)

    # A server reports its normal events (each version it loads) at INFO, as uvicorn does beside it
    logging.getLogger("retrieval").setLevel(min(logging.getLogger("retrieval").getEffectiveLevel(), logging.INFO))
    try:
        server.run(directory, options, host=host, port=port, api_key=api_key, shutdown_timeout=shutdown_timeout,
                   announce=announce)  # fmt: skip
    finally:  # served: what remains is the interpreter's teardown (1-2 s of torch's exit hooks), and a Ctrl-C
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # there died by the signal or printed an exit hook's traceback
