"""`sluice serve --replicas`'s flags and its stop, without a Ray cluster: Ray stays an optional import, a bad
scale-out flag or a missing extra is a one-line error, and the stop's drain is bounded (against stand-ins for Ray
Serve). Apart from tests/test_ray_cli.py, whose clusters run alone: these run beside other modules."""

from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace

import pytest

from test_api_e2e import ROOT

from sluice.app.addresses import host_port
from sluice.app.scale_out import ScaleOutConfig

# Runs the CLI in a fresh interpreter; `block_ray` makes `import ray` fail as if the extra were not installed.
_RUN = """
import sys
if {block_ray}:
    sys.modules["ray"] = None
from sluice.app.cli import main
code = main(sys.argv[1:])
print("ray imported:", "ray" in sys.modules and sys.modules["ray"] is not None)
sys.exit(code)
"""


def sluice(*argv: str, block_ray: bool = False, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", _RUN.format(block_ray=block_ray), *argv], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)


def test_without_ray_replicas_says_how_to_install_it():
    result = sluice("serve", "--replicas", "2", block_ray=True)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1] == (
        "sluice serve: error: --replicas needs Ray Serve: pip install -e '.[ray]' in Sluice's checkout")


def test_the_serve_flags_parse_without_importing_ray():
    check = ("import sys; from sluice.app.cli import build_parser; "
             "args = build_parser().parse_args(['serve', '--replicas', '2', '--routing', 'round-robin']); "
             "print(args.replicas, args.routing, 'ray' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", check], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.stdout.split() == ["2", "round-robin", "False"], result.stderr


def test_a_bad_scale_out_flag_is_a_one_line_error_before_ray_starts():
    for flags, message in (
        (["--replicas", "0"], "--replicas must be at least 1, got 0"),
        (["--replicas", "2", "--min-replicas", "1"],
         "--min-replicas tunes autoscaling, which is off: add --max-replicas N"),
        (["--replicas", "2", "--routing", "pow2", "--imbalanced-threshold", "8"],
         "--imbalanced-threshold tunes prefix-aware routing, which is off: add --routing prefix"),
        (["--replicas", "3", "--max-replicas", "2"], "need --min-replicas <= --replicas <= --max-replicas, got 1 <= 3 <= 2"),
    ):
        result = sluice("serve", *flags)
        assert result.returncode == 2
        assert result.stderr.strip().splitlines() == [f"sluice serve: error: {message}"]
        assert "ray imported: False" in result.stdout

def test_scale_out_thresholds_left_unset_follow_a_replicas_batch():
    scale = ScaleOutConfig(replicas=2, max_ongoing_requests=10).with_batch(256)
    assert (scale.imbalanced_threshold, scale.max_ongoing_requests, scale.target_ongoing_requests) == (256, 10, 256)
    assert ScaleOutConfig(replicas=1).with_batch(64).max_ongoing_requests == 128


@pytest.mark.parametrize(("status", "replicas", "drained"), [
    ("HEALTHY", {"RUNNING": 1}, True),
    ("UNHEALTHY", {"RUNNING": 1}, True),  # its replica failed a health check a moment ago: it may still drain
    ("UPDATING", {"RUNNING": 1}, True),
    ("UPDATING", {"STARTING": 1}, False),  # no replica to take the call: it would wait for one
    ("DEPLOY_FAILED", {}, False),
])
def test_a_stop_drains_the_ingress_whenever_it_has_a_replica_running_whatever_its_deployments_status(
        monkeypatch, status, replicas, drained):
    """A stand-in for `serve.status()`: the drain is a call to the ingress's replica, not to its status."""
    ray_app = pytest.importorskip("sluice.app.ray_app")
    from ray.serve.schema import DeploymentStatus, ReplicaState

    ingress = SimpleNamespace(status=DeploymentStatus(status),
                              replica_states={ReplicaState(state): n for state, n in replicas.items()})
    application = SimpleNamespace(deployments={ray_app.INGRESS: ingress})
    monkeypatch.setattr(ray_app.serve, "status", lambda: SimpleNamespace(applications={ray_app.APP_NAME: application}))
    assert ray_app._ingress_running() is drained


def test_a_stop_waits_for_the_ingresss_drain_a_bounded_time(monkeypatch, capsys):
    """A stand-in for the ingress's handle whose drain never answers (its replica died after it was seen running):
    the stop goes on once the drain and a margin have passed."""
    ray_app = pytest.importorskip("sluice.app.ray_app")
    waited = []

    def never_answered(timeout_s: float) -> None:
        waited.append(timeout_s)
        raise TimeoutError

    drain = SimpleNamespace(remote=lambda timeout_s: SimpleNamespace(result=never_answered))
    monkeypatch.setattr(ray_app.serve, "get_app_handle", lambda name: SimpleNamespace(drain=drain))
    ray_app._drain_ingress(30.0)
    assert waited == [30.0 + ray_app.LAST_WORD_S + ray_app.DRAIN_CALL_MARGIN_S]
    assert "did not answer its drain within 45 s" in capsys.readouterr().err


def test_an_ipv6_address_is_written_in_brackets_beside_its_port():
    """A coordinator address (`--hosts`) or URL with `::1:8000` in it reads as an address alone."""
    assert host_port("::1", 8000) == "[::1]:8000"
    assert host_port("10.0.0.7", 8000) == "10.0.0.7:8000"
