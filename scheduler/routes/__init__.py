"""The API's routers, one per resource: jobs, workers, drafts, and ops (metrics, health)."""
