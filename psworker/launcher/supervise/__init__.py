"""Supervision: the run loop (`supervisor`) and what it decides and does to its tasks: the run policy as pure
functions (`run_policy`), restarts (`attempts`), faults and stalls (`watch`), stacks, rollbacks, the
controls by hand and how the run ended (`outcome`)."""
