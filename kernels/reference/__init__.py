"""Readable pure-torch references: token recurrences (ground truth) and the chunkwise ReWY pipeline."""
