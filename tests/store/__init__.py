"""The store and its layers: residency, the manifest, rows, faults and security."""
