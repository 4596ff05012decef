"""The protocol between the scheduler and the workers, by concern; both sides import it, and nothing else
builds a Redis key, names a hash field or defines a message type that crosses a process boundary.

    keys       the Redis key schema, the hash field names, ids, retention limits, Ray actor names
    states     the state vocabularies (WorkerState, Phase, LeaseState, JobState)
    messages   every message that crosses a process boundary (validated JSON, workers.message)
    client     the Redis client every process makes (connect; patient=True retries through an outage)
"""
