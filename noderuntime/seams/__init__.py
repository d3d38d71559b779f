"""Seams above the transports: one session's seam connection (the protocol's codec and state
machine over a frame stream), reaching the next hop, and the client end of a route."""
