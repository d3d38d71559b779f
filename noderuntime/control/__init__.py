"""The control plane beside the tracker: capability admission (measurements, known-answer
probes) and the usage ledger."""
