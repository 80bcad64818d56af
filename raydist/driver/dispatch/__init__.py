"""Steps to the ranks and results back: the window of steps in flight (`window`), how messages travel
(`transport`: actor calls, a relay tree, a compiled graph), hang detection (`hangs`), and the client
that ties them to a group (`client`). Imports `cluster` only.
"""
