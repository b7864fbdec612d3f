"""The pool: several ``AsyncEngine``s behind one API, prefix-affine routing and failover.

Runs on the callers' loops (routing) and, for failover, on a dying member's worker thread.
"""
