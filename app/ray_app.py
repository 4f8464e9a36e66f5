"""`sluice serve --replicas N`: Sluice replicas as a Ray Serve application, behind one OpenAI-compatible ingress.

The application has two deployments: `SluiceReplica` (`app/replicas.py`), N engine replicas, each with its own
devices (T GPUs at `--tp T` on a cluster with GPUs, else one CPU), and `SluiceIngress` (`app/ingress.py`),
which Ray Serve's HTTP proxy serves at `--host`/`--port` and which calls the replicas through a handle whose
request router (`--routing`, `app/prefix_router.py`) picks the replica. Ray Serve restarts a replica that
dies, and with `--max-replicas` scales their number on the requests each has ongoing (queued or running);
a replica scaled down or replaced finishes its requests in flight first (`--drain-timeout`).

Without `--ray-address` this process starts a local Ray cluster and stops it on exit; with one, it deploys the
application to that cluster and deletes it on exit. The first SIGTERM/SIGINT deletes the application, letting
requests in flight finish; a second exits at once.
"""

from __future__ import annotations

from dataclasses import replace

import ray
from ray import serve
from ray.serve.config import RequestRouterConfig

from sluice.app.addresses import http_url
from sluice.app.ingress import SluiceIngress
from sluice.app.prefix_router import PowerOfTwoRouter, PrefixAffinityRouter, RoundRobinRouter
from sluice.app.ray_cluster import connect, stop_on_signal
from sluice.app.replicas import ReplicaConfig, SluiceReplica
from sluice.app.scale_out import ScaleOutConfig

APP_NAME = "sluice"
ROUTERS = {"prefix": PrefixAffinityRouter, "round-robin": RoundRobinRouter, "pow2": PowerOfTwoRouter}
# Requests the ingress may have open at once: beyond it Ray's proxy queues them. The replicas' own limit
# (`max_ongoing_requests`) is what bounds the work.
INGRESS_MAX_ONGOING = 8192


def _router(scale: ScaleOutConfig) -> RequestRouterConfig:
    kwargs = {"imbalanced_threshold": scale.imbalanced_threshold} if scale.routing == "prefix" else {}
    return RequestRouterConfig(request_router_class=ROUTERS[scale.routing], request_router_kwargs=kwargs)


def build_application(replica: ReplicaConfig, scale: ScaleOutConfig, gpus: bool) -> serve.Application:
    """The two deployments, bound; `gpus`: whether the cluster has GPUs (each replica then takes `tp`)."""
    resources = {"num_gpus": replica.engine.tp, "num_cpus": 1} if gpus else {"num_cpus": 1}
    options: dict = {
        "ray_actor_options": resources,
        "max_ongoing_requests": scale.max_ongoing_requests,
        "graceful_shutdown_timeout_s": scale.graceful_shutdown_timeout_s,
    }
    if (autoscaling := scale.autoscaling()) is not None:
        options["autoscaling_config"] = autoscaling
    else:
        options["num_replicas"] = scale.replicas
    options["request_router_config"] = _router(scale)
    replicas = serve.deployment(SluiceReplica, name="SluiceReplica", **options).bind(replica)
    ingress = serve.deployment(SluiceIngress, name="SluiceIngress", num_replicas=1,
                               ray_actor_options={"num_cpus": 0}, max_ongoing_requests=INGRESS_MAX_ONGOING)
    return ingress.bind(replicas, replica.settings)


def serve_replicas(replica: ReplicaConfig, scale: ScaleOutConfig) -> int:
    """Starts (or joins) Ray, runs the application until a signal, then deletes it; the exit status."""
    local = scale.ray_address is None
    connect(scale.ray_address, scale.max_replicas or scale.replicas)
    try:
        with stop_on_signal() as stop:
            serve.start(http_options={"host": scale.host, "port": scale.port})
            gpus = ray.cluster_resources().get("GPU", 0) > 0
            # The replicas' batch, for the router's thresholds too (a device's size is not known here).
            engine = replica.engine.with_device_defaults("gpu" if gpus else "cpu", None)
            replica = replace(replica, engine=engine)
            serve.run(build_application(replica, scale.with_batch(engine.max_num_seqs), gpus), name=APP_NAME,
                      route_prefix="/")
            print(f"Sluice is ready: {http_url(scale.host, scale.port)}/v1 on {scale.replicas} replicas "
                  f"({scale.routing} routing)", flush=True)
            while not stop.wait(0.5):
                pass
            print("Stopping: replicas finish their requests in flight", flush=True)
            serve.delete(APP_NAME)
            if local:
                serve.shutdown()
    finally:
        if local:
            ray.shutdown()
    return 0
