"""A private redis-server for the data-plane tests (never the machine's 6379), flushed per test.

Clients decode responses (str values), as workers.protocol.connect makes them.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import redis as redis_lib

from workers.redis_server import PrivateRedis


@pytest.fixture(scope="session")
def private_redis() -> Iterator[PrivateRedis]:
    with PrivateRedis() as server:
        yield server


@pytest.fixture
def redis_client(private_redis: PrivateRedis) -> Iterator[redis_lib.Redis]:
    client = private_redis.client()
    client.flushall()
    yield client
    client.close()
