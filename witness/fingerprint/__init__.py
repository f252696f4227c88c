"""Behavioral fingerprints (outputs on committed probes) and linear parameter sketches."""
