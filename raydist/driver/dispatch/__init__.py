"""Steps to the ranks and results back: the window of steps in flight (`window`), how messages travel
(`transport`: actor calls, a relay tree, a compiled graph), and the client that ties them to a group
(`client`), every driver call to a rank going through it. Imports `cluster` only.
"""
