"""Isolating it: the processes that run a submission's code (ranks, forked from a confined fork
server), their uid, namespaces, cgroups and storage, what crosses back (wire), and what is
scrubbed between tests.
"""
