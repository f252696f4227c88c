"""Shared fixtures: honest and dishonest runs of the small task."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
from helpers import train_tiny

from witness.commit.signing import generate_key


@pytest.fixture(autouse=True)
def environment_restored():
    """Every test leaves the process's environment as it found it: a library that sets a variable
    (transformers' TrainingArguments(torch_compile=True) sets ACCELERATE_DYNAMO_BACKEND) would
    otherwise change every later test and every process they start."""
    before = dict(os.environ)
    yield
    for k in set(os.environ) - set(before):
        del os.environ[k]
    for k, v in before.items():
        if os.environ.get(k) != v:
            os.environ[k] = v


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
