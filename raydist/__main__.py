"""``python -m raydist ...``: the ``raydist`` command (`raydist.cli`)."""

from .cli import main

raise SystemExit(main())
