"""Paddle's callback list for the driver's `fit` and `evaluate` (all devices). Not a defect:
the driver's one use of a Paddle internal, kept here with its guard.

``Model.fit`` builds its callbacks with ``paddle.hapi.callbacks.config_callbacks``: it adds
Paddle's defaults (``ProgBarLogger``, ``ModelCheckpoint``, ``LRScheduler``) and hands each
callback the run's parameters (``params``: batch size, epochs, steps, verbose, metrics). It is
not in Paddle's documented API and nothing public does the same, so raydist calls it through
`configured`, which checks first that it still builds a ``CallbackList`` from those arguments.
"""

from __future__ import annotations

from typing import Any

from . import expect_source


def configured(callbacks: list, **params: Any):
    """Paddle's ``CallbackList`` of ``callbacks`` and its defaults, configured as ``Model.fit`` does."""
    from paddle.hapi.callbacks import config_callbacks

    expect_source(config_callbacks, "cbk_list = CallbackList(cbks)", "cbk_list.set_params(params)",
                  fix="callbacks")  # fmt: skip
    return config_callbacks(callbacks, **params)
