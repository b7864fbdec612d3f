"""The pool, on the callers' loops: several ``AsyncEngine``s behind one API, routing, failover.

Runs on the callers' loops (routing) and, for failover, on a dying member's worker thread.
"""
