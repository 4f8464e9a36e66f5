"""How `sluice serve --replicas N` scales out: the replicas' number, autoscaling and routing (no Ray import, so
that the flags and their checks work without Ray installed)."""

from __future__ import annotations

from dataclasses import dataclass, replace

# prefix: app/prefix_router.py's affinity router; round-robin and pow2 (Ray Serve's default policy): baselines.
ROUTINGS = ("prefix", "round-robin", "pow2")
# The response header in which the ingress names the replica that answered.
REPLICA_HEADER = "x-sluice-replica"


@dataclass(frozen=True)
class ScaleOutConfig:
    """How many replicas and how requests reach them.

    `replicas`: the number to start (and keep, without `max_replicas`). With `max_replicas`, Ray Serve scales
    between `min_replicas` and `max_replicas` to keep about `target_ongoing_requests` per replica, waiting
    `upscale_delay_s` / `downscale_delay_s` of sustained load first. `max_ongoing_requests`: most requests a
    replica is sent at once (more wait in the router). `routing`: one of `ROUTINGS`; `imbalanced_threshold`:
    how many more ongoing requests than the least loaded replica make a prefix's replica overloaded. Those three
    left None follow a replica's batch (`with_batch`), known once Ray says which devices the replicas get.
    """

    replicas: int
    host: str = "127.0.0.1"
    port: int = 8000
    ray_address: str | None = None
    routing: str = "prefix"
    imbalanced_threshold: int | None = None
    max_ongoing_requests: int | None = None
    min_replicas: int | None = None
    max_replicas: int | None = None
    target_ongoing_requests: float | None = None
    upscale_delay_s: float = 30.0
    downscale_delay_s: float = 600.0
    graceful_shutdown_timeout_s: float = 30.0

    def __post_init__(self) -> None:
        if self.replicas < 1:
            raise ValueError(f"--replicas must be at least 1, got {self.replicas}")
        if self.routing not in ROUTINGS:
            raise ValueError(f"--routing must be one of {', '.join(ROUTINGS)}, got {self.routing!r}")
        if self.max_replicas is not None and not (self.lowest <= self.replicas <= self.max_replicas):
            raise ValueError(f"need --min-replicas <= --replicas <= --max-replicas, got "
                             f"{self.lowest} <= {self.replicas} <= {self.max_replicas}")
        if any(x is not None and x <= 0 for x in (self.max_ongoing_requests, self.target_ongoing_requests,
                                                  self.imbalanced_threshold)):
            raise ValueError("--max-ongoing-requests, --target-ongoing-requests and --imbalanced-threshold must be "
                             "positive")

    def with_batch(self, max_num_seqs: int) -> ScaleOutConfig:
        """The thresholds left unset, from a replica's `max_num_seqs`: overloaded a batch beyond the least loaded
        replica, sent at most two batches, a batch per replica for the autoscaler."""
        return replace(self, imbalanced_threshold=self.imbalanced_threshold or max_num_seqs,
                       max_ongoing_requests=self.max_ongoing_requests or 2 * max_num_seqs,
                       target_ongoing_requests=self.target_ongoing_requests or max_num_seqs)

    @property
    def lowest(self) -> int:
        return 1 if self.min_replicas is None else self.min_replicas

    def autoscaling(self) -> dict | None:
        if self.max_replicas is None:
            return None
        return {"min_replicas": self.lowest, "initial_replicas": self.replicas, "max_replicas": self.max_replicas,
                "target_ongoing_requests": self.target_ongoing_requests, "upscale_delay_s": self.upscale_delay_s,
                "downscale_delay_s": self.downscale_delay_s}
