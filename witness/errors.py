"""The one error family that verification raises.

Every check that fails raises; nothing returns a ``False`` that a caller could forget
to look at. ``MalformedInput`` marks input that cannot even be read (exit code 2);
every other ``VerificationError`` is a rejection (exit code 1).
"""

from __future__ import annotations


class VerificationError(Exception):
    """A claim did not verify; the message says which check failed and where."""

    exit_code = 1

    def __init__(self, message: str, *, step: int | None = None, check: str | None = None):
        self.step = step
        self.check = check
        prefix = []
        if step is not None:
            prefix.append(f"step {step}")
        if check is not None:
            prefix.append(check)
        self.diagnosis = message
        super().__init__(f"{': '.join(prefix)}: {message}" if prefix else message)


class MalformedInput(VerificationError):
    """Input that cannot be parsed safely: wrong format, too large, or outside the bundle."""

    exit_code = 2


class RunRejected(VerificationError):
    """A whole audit failed; ``failures`` lists every check that did not hold."""

    def __init__(self, failures: list[str], verdict: object | None = None):
        self.failures = list(failures)
        self.verdict = verdict
        super().__init__("; ".join(self.failures) if self.failures else "run rejected")
