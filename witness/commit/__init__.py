"""Commitments: hashing, Merkle trees and proofs, the run log, signatures (no torch)."""
