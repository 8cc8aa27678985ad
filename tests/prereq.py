"""A missing prerequisite fails the test under CI=true and skips it, saying why, elsewhere."""

from __future__ import annotations

import os

import pytest


def in_ci() -> bool:
    return os.environ.get("CI", "").lower() == "true"


def require(condition: object, why: str) -> None:
    """Fail (CI) or skip (locally) with `why` unless `condition` holds."""
    if condition:
        return
    if in_ci():
        pytest.fail(f"prerequisite missing under CI=true: {why}")
    pytest.skip(why)
