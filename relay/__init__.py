"""The public relay: pairs nodes behind NAT with their peers and forwards sealed bytes (:mod:`relay.server`)."""
