"""The partitioner: plans, resharding, and its distributed runs."""
