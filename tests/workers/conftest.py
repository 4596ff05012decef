"""A private redis-server for the data-plane tests (never the machine's 6379), flushed per test.

Clients decode responses (str values), as workers.protocol.connect makes them. redis is imported by the fixtures
only: the device-parametrized modules here (tests/cuda_tests.txt) are collected on GPU nodes without it.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    import redis as redis_lib

    from workers.redis_server import PrivateRedis


@pytest.fixture(scope="session")
def private_redis() -> Iterator[PrivateRedis]:
    from workers.redis_server import PrivateRedis

    with PrivateRedis() as server:
        yield server


@pytest.fixture
def redis_client(private_redis: PrivateRedis) -> Iterator[redis_lib.Redis]:
    client = private_redis.client()
    client.flushall()
    yield client
    client.close()
