"""Missing prerequisites fail under CI=true and skip (saying why) elsewhere."""

from __future__ import annotations

import os

import pytest


def require(condition: object, why: str) -> None:
    if condition:
        return
    if os.environ.get("CI") == "true":
        pytest.fail(f"prerequisite missing under CI: {why}")
    pytest.skip(why)
