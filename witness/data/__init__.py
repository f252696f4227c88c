"""Sample canonicalisation, dataset commitments and the seed-derived data order (no torch)."""
