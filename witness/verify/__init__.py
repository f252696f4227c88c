"""Verification: full cheap checks, challenge drawing, replay, verdicts and bounds."""

from .audit import verify_bundle
from .verdict import Verdict

__all__ = ["Verdict", "verify_bundle"]
