from __future__ import annotations

import os

import pytest

# Every test lowers its captures afresh, so that a test of lowering (or of a failure
# inside it) runs it whatever the tests before it captured; the child processes
# tests start inherit this. tests/lowering/test_lowering_cache.py turns it back on.
os.environ["PRECOMPILE_GEN_LOWERING_CACHE"] = "0"


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--update-goldens",
        action="store_true",
        help="rewrite tests/golden/ from the current templates instead of comparing",
    )


@pytest.fixture
def update_goldens(request: pytest.FixtureRequest) -> bool:
    return bool(request.config.getoption("--update-goldens"))
