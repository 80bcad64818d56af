"""``from raydist.train import PaddleConfig``: Ray Train for Paddle (`raydist.integrations.train`)."""

from .integrations.train import PaddleConfig

__all__ = ["PaddleConfig"]
