"""What runs inside a rank's process only: joining Paddle's process group, the model, the data.

The driver never imports this package (a test checks it): the rank actors'
endpoints (`raydist.protocol`) import it inside the rank, after the
environment Paddle reads at import is set.
"""
