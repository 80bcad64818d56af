"""The driver's side: the `DistModel` a user holds, and its one path to the ranks.

Nothing here imports `raydist.worker` (a test checks it); what the driver may
ask of a rank is `raydist.protocol.RankActor`'s endpoints.
"""
