"""Fixtures for the docs/, deploy/ and notebooks/ tests."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def deploy_dir(repo_root: Path) -> Path:
    return repo_root / "deploy"


@pytest.fixture(scope="session")
def docs_dir(repo_root: Path) -> Path:
    return repo_root / "docs"
