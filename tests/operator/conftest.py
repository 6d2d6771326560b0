"""Fixtures for the operator tests: the emulated cluster (see pagoda_testkit)."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator

import pytest
import pytest_asyncio
from pagoda_testkit import Cluster, emulated_cluster


@pytest_asyncio.fixture
async def cluster() -> AsyncIterator[Cluster]:
    async with emulated_cluster() as c:
        yield c


@pytest.fixture(autouse=True)
def _quiet_logs(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="aiohttp.access")
