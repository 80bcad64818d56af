"""``python -m raydist launch ...``: the ``raydist`` command."""

from .integrations.launch import cli

cli()
