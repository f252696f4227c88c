"""Evaluation and contamination certificates, and the identity of a released model."""
