"""Only the native part of the build; everything else is in pyproject.toml.

``witness.commit._native`` batches SHA-256 (OpenSSL's) for the data commitments. It is optional:
where it cannot be built (no compiler, no OpenSSL headers), ``witness.commit.batch`` computes the
same bytes in Python, only slower.
"""

from setuptools import Extension, setup

setup(ext_modules=[Extension("witness.commit._native", ["witness/commit/_native.c"], libraries=["crypto"],
                             extra_compile_args=["-O2", "-Wall"], optional=True)])
