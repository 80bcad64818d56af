"""``python -m raydist.launch ...``: the same as ``raydist launch ...`` (`raydist.integrations.launch`)."""

from .integrations.launch import cli, launch, main

__all__ = ["cli", "launch", "main"]

if __name__ == "__main__":
    raise SystemExit(main())
