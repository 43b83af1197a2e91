"""The command line: a typer app (``app``) whose commands parse options, call the library and render the results."""
