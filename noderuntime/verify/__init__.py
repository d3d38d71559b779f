"""Checks of correctness: range parity, process chains, Gate A lanes, signed contracts, agreement with Transformers."""
