"""Harnesses that tests and benchmarks share, shipped as trio ships ``trio.testing``.

:mod:`noderuntime.testing.clusters` starts real node and relay processes; a
:mod:`noderuntime.testing.seams` seam is a fresh pair of frame streams over memory,
gRPC or the relay; :mod:`noderuntime.testing.audits` runs a swarm whose gateway audits,
for cheaters to join; :mod:`noderuntime.testing.usage` signs the usage record of a small
session, for a test or benchmark that plays a node's or an auditor's part.
"""
