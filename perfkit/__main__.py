"""`python -m perfkit`: the CLI."""

from perfkit.cli import app

app()
