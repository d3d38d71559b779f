"""Operating processes: metrics and session-tagged logs, timelines, the small HTTP surface, ``noderuntime status``."""
