"""Shared fixtures: honest and dishonest runs of the small task."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from helpers import train_tiny

from witness.commit.signing import generate_key


@pytest.fixture(scope="session")
def signing_key():
    """One key for the session's honest runs."""
    return generate_key()


@pytest.fixture(scope="session")
def honest_bundle(tmp_path_factory, signing_key) -> Path:
    """A finished honest tiny run (read-only: copy before tampering)."""
    return train_tiny(tmp_path_factory.mktemp("honest") / "bundle", signing_key)


@pytest.fixture
def bundle_copy(honest_bundle, tmp_path) -> Path:
    """A private copy of the honest run to tamper with."""
    dst = tmp_path / "bundle"
    shutil.copytree(honest_bundle, dst)
    return dst
