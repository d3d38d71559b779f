"""A shard node: its sequence slots (``leases``), the pure scheduler, the batcher that owns
the engine, route sessions and how they end, and the node that admits them (``core``)."""
