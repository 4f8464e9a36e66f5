"""deploy/kubernetes: what can be checked without a cluster. The manifests parse, carry the fields their APIs
require, and agree with each other and with `sluice serve` (flags, port, probe routes)."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
import yaml

from sluice.app.serve import add_arguments, env_name
from sluice.app.server import ROUTES

DEPLOY = Path(__file__).parents[1] / "deploy" / "kubernetes"


@pytest.fixture(scope="module")
def objects() -> dict[str, dict]:
    docs = [doc for name in ("sluice.yaml", "inferencepool.yaml")
            for doc in yaml.safe_load_all((DEPLOY / name).read_text()) if doc]
    return {doc["kind"]: doc for doc in docs}


def test_the_manifests_hold_a_deployment_a_service_and_an_inference_pool(objects):
    assert set(objects) == {"Deployment", "Service", "InferencePool"}
    assert objects["InferencePool"]["apiVersion"] == "inference.networking.k8s.io/v1"
    pool = objects["InferencePool"]["spec"]
    assert {"selector", "targetPorts", "endpointPickerRef"} <= set(pool)  # the fields v1 requires
    ports = [p["number"] for p in pool["targetPorts"]]
    assert len(ports) == len(set(ports)) <= 8
    assert pool["endpointPickerRef"]["name"] and pool["endpointPickerRef"]["port"]["number"]
    assert pool["endpointPickerRef"]["failureMode"] in ("FailOpen", "FailClose")


def test_selectors_ports_and_probes_agree_with_each_other_and_the_server(objects):
    deployment = objects["Deployment"]["spec"]
    labels = deployment["template"]["metadata"]["labels"]
    assert deployment["selector"]["matchLabels"] == labels
    assert objects["Service"]["spec"]["selector"] == labels
    assert objects["InferencePool"]["spec"]["selector"]["matchLabels"] == labels
    (container,) = deployment["template"]["spec"]["containers"]
    env = {e["name"]: e["value"] for e in container["env"]}
    port = int(env["SLUICE_PORT"])
    assert [p["containerPort"] for p in container["ports"]] == [port]
    assert [p["number"] for p in objects["InferencePool"]["spec"]["targetPorts"]] == [port]
    routes = {op.path for _, op in ROUTES}
    for probe in ("readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"]["path"] in routes
    assert int(deployment["template"]["spec"]["terminationGracePeriodSeconds"]) > float(env["SLUICE_DRAIN_TIMEOUT"])


def test_every_environment_variable_is_a_sluice_serve_flag(objects):
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    flags = {env_name(flag) for action in parser._actions for flag in action.option_strings if flag.startswith("--")}
    (container,) = objects["Deployment"]["spec"]["template"]["spec"]["containers"]
    assert container["command"] == ["sluice", "serve"]
    assert {e["name"] for e in container["env"]} <= flags
