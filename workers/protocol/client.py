"""The Redis client every process makes: values are JSON text (decode_responses=True, so str comes back;
readers also accept bytes, because Ray actors may build plain clients), and a patient variant that retries."""

from __future__ import annotations

import redis as redis_lib

DECODE_RESPONSES = True  # values are JSON text; str in, str out


# a patient client rides out a Redis that blinks (a restart, a failover): each command retries on connection
# errors and timeouts with exponential backoff capped at PATIENT_BACKOFF_CAP_S, about a minute in all. For the
# job's driver and the scheduler's launcher, whose writes must not be lost; never for a worker's decode loop
# (its progress reports are best effort) or the API (it answers 503 at once)
PATIENT_RETRIES = 35
PATIENT_BACKOFF_CAP_S = 2.0


def connect(url: str, patient: bool = False) -> redis_lib.Redis:
    """A client with this protocol's decoding choice; `patient`: one that retries through a Redis outage."""
    if not patient:
        return redis_lib.Redis.from_url(url, decode_responses=DECODE_RESPONSES)
    from redis.backoff import ExponentialBackoff
    from redis.retry import Retry

    retry = Retry(ExponentialBackoff(cap=PATIENT_BACKOFF_CAP_S, base=0.05), PATIENT_RETRIES,
                  supported_errors=(redis_lib.ConnectionError, redis_lib.TimeoutError))
    return redis_lib.Redis.from_url(url, decode_responses=DECODE_RESPONSES, retry=retry,
                                    retry_on_error=[redis_lib.ConnectionError, redis_lib.TimeoutError])


def text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value

