"""The benchmark's rows as a ``paddle.io.Dataset`` (for the *loader-paddle* runner).

Its own module, imported by the reader ranks that unpickle it: bench/models.py
imports Paddle only where it is needed.
"""

import numpy as np
import paddle


class Rows(paddle.io.Dataset):
    """Rows ``0..n-1`` of a model kind's data (`bench.models.rows`), made in memory, as native's
    ``paddle.io.TensorDataset`` is."""

    def __init__(self, kind: str, n: int):
        from bench.models import rows

        self.columns = rows(kind, np.arange(n))

    def __len__(self) -> int:
        return len(self.columns["x"])

    def __getitem__(self, i: int) -> dict:
        return {k: v[i] for k, v in self.columns.items()}
