"""The scheduler process's settings: one place for each of their defaults (the CLI reads them here)."""

from __future__ import annotations

from dataclasses import dataclass, field

from scheduler.budget import JobBudget
from scheduler.policy import PolicySettings

TICK_S = 0.5  # progress arrives at <= 10/s per worker; leases last seconds to minutes


@dataclass
class Settings:
    redis_url: str
    api_token: str | None = None  # when set, mutating routes need "Authorization: Bearer <token>"
    store_dir: str = "/tmp/tlt-drafts"  # draft stores' root, a job's under store_dir/JOB (shared FS on a cluster)
    # the directories a job's paths may name (model and warm_draft; dataset_path); None: the project cache and
    # store_dir (scheduler.paths.default_roots). TLT_MODEL_ROOTS / TLT_DATA_ROOTS set them for `tlt serve`
    model_roots: tuple[str, ...] | None = None
    data_roots: tuple[str, ...] | None = None
    ray_num_gpus: int = 4  # logical GPUs declared when this process starts a local Ray
    start_ray: bool = True
    # the address a private Ray advertises (tlt serve: the host it serves on); None: the node's own address
    ray_node_ip: str | None = "127.0.0.1"
    ray_address: str | None = None  # join this Ray cluster ("auto", "host:port"); jobs then outlive a restart
    policy: PolicySettings = field(default_factory=PolicySettings)
    watch: bool = True  # run the long-tail watcher (grants and preempts drafter-training leases)
    watch_tick_s: float = TICK_S
    budget: JobBudget = field(default_factory=JobBudget)  # a job's size as a whole (scheduler.budget)
    # jobs one API token may have queued or running (429 beyond): a team's queue of experiments is a few dozen; a
    # client submitting in a loop is stopped long before Redis or the queue's readers notice
    max_jobs_per_token: int = 32

    def __post_init__(self) -> None:
        if self.max_jobs_per_token < 1:
            raise ValueError(f"max_jobs_per_token must be >= 1, got {self.max_jobs_per_token}")
