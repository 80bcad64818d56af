"""Other ways in: ``raydist launch`` for unmodified SPMD scripts, and Ray Train's `PaddleConfig`."""
