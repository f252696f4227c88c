"""Verification: full cheap checks, challenge drawing, replay, verdicts and bounds.

``Verifier(Trust(...), Policy(...)).verify(bundle, Evidence(...))`` audits one bundle.
"""

from .audit import Verifier
from .policy import Evidence, Policy, Trust
from .verdict import Verdict

__all__ = ["Evidence", "Policy", "Trust", "Verdict", "Verifier"]
