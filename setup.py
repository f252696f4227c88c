"""Only the native part of the build; everything else is in pyproject.toml.

``witness.commit._native`` batches SHA-256 (OpenSSL's) for the data commitments. It is optional:
where it cannot be built (no compiler, no OpenSSL headers), ``witness.commit.batch`` computes the
same bytes in Python, only slower.

``witness.commit._blake3`` is BLAKE3 with its chaining values (the state hash's digest and the paths that
open it); where it cannot be built, ``witness.commit.blake3tree`` computes the same bytes with numpy.
"""

from setuptools import Extension, setup

setup(ext_modules=[Extension("witness.commit._native", ["witness/commit/_native.c"], libraries=["crypto"],
                             extra_compile_args=["-O2", "-Wall"], optional=True),
                   Extension("witness.commit._blake3", ["witness/commit/_blake3.c"],
                             extra_compile_args=["-O3", "-Wall", "-Wno-psabi"], optional=True)])
