"""A private redis-server for the data-plane tests (never the machine's 6379), flushed per test."""

from __future__ import annotations

import pytest

from workers.redis_server import PrivateRedis


@pytest.fixture(scope="session")
def private_redis():
    with PrivateRedis() as server:
        yield server


@pytest.fixture
def redis_client(private_redis):
    client = private_redis.client()
    client.flushall()
    yield client
    client.close()
