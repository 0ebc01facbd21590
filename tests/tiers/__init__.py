"""The tiers: the conformance suite every tier passes, the nvme tier's extents, reads and paths."""
