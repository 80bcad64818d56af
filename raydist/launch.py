"""``python -m raydist.launch ...``: the same as ``raydist launch ...`` (`raydist.integrations.launch`)."""

from .integrations.launch import launch, main

__all__ = ["launch", "main"]

if __name__ == "__main__":
    raise SystemExit(main())
