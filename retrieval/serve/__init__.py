"""The HTTP service: what the ``[server]`` extra needs (the FastAPI app, the serving engine, micro-batching,
telemetry, the search page). Importing this package imports nothing else: ``service`` needs no FastAPI."""
