"""The ranks' place on the Ray cluster: the group's configuration and actors (`config`), placing and
starting them (`placement`, `group`), spare ranks (`spares`), how many fit (`sizes`), what a failed
rank reports (`failures`), hung ranks found (`hangs`), connecting to Ray (`connect`), and the
cluster's state that only Ray's private API tells (`state`). Imports nothing else of the driver.
"""
