"""The gateway's view of the ledger: the in-process replica, the index over gRPC, and what a match
answered.
"""
