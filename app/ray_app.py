"""`sluice serve --replicas N`: Sluice replicas as a Ray Serve application, behind one OpenAI-compatible ingress.

The application has two deployments: `SluiceReplica` (`app/replicas.py`), N engine replicas, each with its own
devices (T GPUs at `--tp T` on a cluster with GPUs, else one CPU), and `SluiceIngress` (`app/ingress.py`),
which Ray Serve's HTTP proxy serves at `--host`/`--port` and which calls the replicas through a handle whose
request router (`--routing`, `app/prefix_router.py`) picks the replica. Ray Serve restarts a replica that
dies, and with `--max-replicas` scales their number on the requests each has ongoing (queued or running);
a replica scaled down or replaced finishes its requests in flight first (`--drain-timeout`).

Without `--ray-address` this process starts a local Ray cluster and stops it on exit; with one, it deploys the
application to that cluster and deletes it on exit (and stops Ray Serve there if it started it; a Ray Serve
already running there keeps the HTTP address it started with, so another --host/--port is an error, as is an
application of another command's there, which it would replace). A replica that
fails to start (its engine does not load, each time Ray Serve tries) ends the command with its error. The first
SIGTERM/SIGINT makes the ingress answer new requests 503 and waits for its requests in flight to finish (at most
`--drain-timeout`, after which it ends those left), then deletes the application, whose replicas are idle by then;
or it stops a start-up still loading. A second exits at once.
"""

from __future__ import annotations

import sys
import threading
from dataclasses import replace

import ray
from ray import serve
from ray.serve.config import RequestRouterConfig
from ray.serve.schema import ApplicationStatus, DeploymentStatus, ReplicaState

from sluice.app.addresses import host_port, http_url
from sluice.app.ingress import LAST_WORD_S, SluiceIngress
from sluice.app.prefix_router import PowerOfTwoRouter, PrefixAffinityRouter, RoundRobinRouter
from sluice.app.ray_cluster import connect, disconnect, stop_on_signal
from sluice.app.replicas import ReplicaConfig, SluiceReplica
from sluice.app.scale_out import ScaleOutConfig

APP_NAME = "sluice"
INGRESS = "SluiceIngress"  # the ingress's deployment
ROUTERS = {"prefix": PrefixAffinityRouter, "round-robin": RoundRobinRouter, "pow2": PowerOfTwoRouter}
# Requests the ingress may have open at once: beyond it Ray's proxy queues them. The replicas' own limit
# (`max_ongoing_requests`) is what bounds the work.
INGRESS_MAX_ONGOING = 8192
DRAIN_CALL_MARGIN_S = 10.0  # past the ingress's own drain, for the call to reach it and return
# How often a replica that is stopping (scaled down, replaced, deleted) looks whether its requests have ended: Ray
# Serve's 2 s would add up to 2 s to every stop and scale-down, for a count that costs nothing to read.
SHUTDOWN_POLL_S = 0.2


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
        "graceful_shutdown_wait_loop_s": SHUTDOWN_POLL_S,
    }
    if (autoscaling := scale.autoscaling()) is not None:
        options["autoscaling_config"] = autoscaling
    else:
        options["num_replicas"] = scale.replicas
    options["request_router_config"] = _router(scale)
    replicas = serve.deployment(SluiceReplica, name="SluiceReplica", **options).bind(replica)
    ingress = serve.deployment(SluiceIngress, name=INGRESS, num_replicas=1,
                               ray_actor_options={"num_cpus": 0}, max_ongoing_requests=INGRESS_MAX_ONGOING,
                               graceful_shutdown_wait_loop_s=SHUTDOWN_POLL_S,
                               # It relays the replicas' streams: it stops after them (Ray Serve stops both at
                               # once), with time to end a stream its replica did not finish with an error event.
                               graceful_shutdown_timeout_s=scale.graceful_shutdown_timeout_s + LAST_WORD_S)
    return ingress.bind(replicas, replica.settings)


def serve_replicas(replica: ReplicaConfig, scale: ScaleOutConfig) -> int:
    """Starts (or joins) Ray, runs the application until a signal, then deletes it (and stops Ray Serve if this
    started it and no other application is left on it); the exit status."""
    cluster = connect(scale.ray_address, scale.max_replicas or scale.replicas)
    try:
        with stop_on_signal() as stop:
            error = _serve(stop, replica, scale)
    finally:
        disconnect(cluster)  # a local cluster stops; a joined one stops sending its logs, so the error below comes last
    if error is not None:
        print(f"sluice serve: error: {error}", file=sys.stderr)
        return 1
    return 0


def _serve(stop: threading.Event, replica: ReplicaConfig, scale: ScaleOutConfig) -> str | None:
    """Runs the application on Ray Serve (started here unless it runs already) until `stop` is set; why not, if it
    did not run."""
    serve_was_running = bool(serve.status().proxies)
    serve.start(http_options={"host": scale.host, "port": scale.port})
    # Ray Serve's proxies keep the address they started with: the application would be served there, not here.
    if serve_was_running and (in_use := _http_address()) != (scale.host, scale.port):
        return (f"Ray Serve already runs on this cluster, serving HTTP at {host_port(*in_use)}: --host and --port "
                "cannot change that (ask for that address, or stop Ray Serve there first)")
    # Deployed again, it would serve this command's model under the other command's URL, until either stops it.
    if APP_NAME in serve.status().applications:
        return (f"an application named {APP_NAME!r} already serves on this cluster (another sluice serve's, or one a "
                f"killed command left): stop that command, or delete it (Ray's serve.delete({APP_NAME!r}))")
    try:
        failure = _serve_until(stop, replica, scale)
    finally:
        _delete_application()
        if not serve_was_running and not serve.status().applications:
            serve.shutdown()
    return None if failure is None else f"the replicas failed to start: {failure}"


def _http_address() -> tuple[str, int]:
    """The host and port of the running Ray Serve's HTTP proxies (its controller's, which `serve.status()` omits)."""
    config = serve.context._get_global_client().http_config
    return config.host, config.port


def _serve_until(stop: threading.Event, replica: ReplicaConfig, scale: ScaleOutConfig) -> str | None:
    """Deploys the application and serves until `stop` is set; why the replicas failed to start, if they did."""
    gpus = ray.cluster_resources().get("GPU", 0) > 0
    # The replicas' batch, for the router's thresholds too (a device's size is not known here).
    engine = replica.engine.with_device_defaults("gpu" if gpus else "cpu", None)
    replica = replace(replica, engine=engine)
    application = build_application(replica, scale.with_batch(engine.max_num_seqs), gpus)
    serve.run_many([serve.RunTarget(application, name=APP_NAME, route_prefix="/")],
                   wait_for_ingress_deployment_creation=False, wait_for_applications_running=False)
    if (failure := _deployment_failure(stop)) is not None:
        return failure
    if not stop.is_set():
        print(f"Sluice is ready: {http_url(scale.host, scale.port)}/v1 on {scale.replicas} replicas "
              f"({scale.routing} routing)", flush=True)
        stop.wait()
    # Before the delete: once it starts, Ray's proxy answers new requests 404 and drops those still waiting at the
    # ingress for a replica. A signal during the start-up drains too where the ingress runs: it answers as soon as a
    # replica does, before Ray Serve calls the application running.
    if _ingress_running():
        print("Stopping: replicas finish their requests in flight", flush=True)
        _drain_ingress(scale.graceful_shutdown_timeout_s)
    return None


def _drain_ingress(timeout_s: float) -> None:
    """Asks the ingress to drain (`SluiceIngress.drain`: `timeout_s`, then its last word), waiting a margin more at
    most: were its replica to die after `_ingress_running` saw it run, the call would wait for Ray Serve to start
    another, which may never come; the application is deleted all the same."""
    try:
        serve.get_app_handle(APP_NAME).drain.remote(timeout_s).result(timeout_s=timeout_s + LAST_WORD_S
                                                                      + DRAIN_CALL_MARGIN_S)
    except TimeoutError:
        print(f"The ingress did not answer its drain within {timeout_s + LAST_WORD_S + DRAIN_CALL_MARGIN_S:.0f} s: "
              "stopping without it", file=sys.stderr, flush=True)


def _ingress_running() -> bool:
    """Whether the ingress has a replica running, to take the drain call: whatever its deployment's status, which
    may be UNHEALTHY (a health check its replica failed a moment ago) or UPDATING while that replica runs. Without
    one the call would wait for a replica to start, which may never come (its deployment failed)."""
    status = serve.status().applications.get(APP_NAME)
    ingress = status.deployments.get(INGRESS) if status is not None else None
    return ingress is not None and ingress.replica_states.get(ReplicaState.RUNNING, 0) > 0


def _delete_application() -> None:
    """Deletes the application once its replicas have drained, however long that takes (`--drain-timeout`): Ray
    Serve's `delete` waits 60 s at most, and is then asked again."""
    while True:
        try:
            serve.delete(APP_NAME)
            return
        except TimeoutError:
            continue


def _deployment_failure(stop: threading.Event) -> str | None:
    """Waits until the application runs (None), fails to deploy (why: the last line of Ray Serve's message, the
    replica's exception where its constructor raised) or `stop` is set (None: a signal may stop a load that takes
    minutes, or replicas waiting for resources the cluster lacks)."""
    while not stop.wait(0.5):
        status = serve.status().applications.get(APP_NAME)
        if status is None or status.status not in (ApplicationStatus.RUNNING, ApplicationStatus.DEPLOY_FAILED):
            continue
        if status.status == ApplicationStatus.RUNNING:
            return None
        messages = [d.message for d in status.deployments.values() if d.status == DeploymentStatus.DEPLOY_FAILED]
        lines = (messages[0] if messages else status.message).strip().splitlines()
        return lines[-1] if lines else "no reason given"
    return None
