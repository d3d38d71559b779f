"""Process assembly: a node, a relay, a tracker, a gateway, the whole local system, and their management."""
