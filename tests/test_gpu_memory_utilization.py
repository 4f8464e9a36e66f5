"""`--gpu-memory-utilization`, vLLM's share of each GPU the server may use in all: jax's allocator is given it before
its backend starts, the default KV pool is sized under that allocator's limit, and a CPU ignores it."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys

import jax.numpy as jnp
import pytest

from sluice.app.arguments import claim_gpu_memory
from sluice.app.cli import build_parser
from sluice.batching.config import LARGE_ACCELERATOR_BATCH, MEMORY_FRACTION_VARIABLES, EngineConfig, \
    InvalidEngineConfig, default_batch, device_memory_bytes
from sluice.batching.kv_pool import CPU_KV_CACHE_BYTES, accelerator_kv_bytes, kv_page_bytes, num_pool_pages
from sluice.model.config import ModelConfig

GB = 10**9
# `sluice serve ARGS` up to its engine's settings: what it has set for jax by then, whether jax has started, and the
# share the engine is given.
SERVE_UNTIL_RUN = """
import json, os, sys
from jax._src import xla_bridge
from sluice.app import cli, serve

def engine_config(**settings):
    print(json.dumps({name: os.environ.get(name) for name in ("XLA_CLIENT_MEM_FRACTION",
                                                              "XLA_PYTHON_CLIENT_MEM_FRACTION")}
                     | {"jax started": xla_bridge.backends_are_initialized(),
                        "engine's share": settings["gpu_memory_utilization"]}))
    sys.exit(0)

serve.EngineConfig = engine_config
sys.exit(cli.main(["serve", *sys.argv[1:]]))
"""


def serve_until_run(*args: str, env: dict[str, str]) -> tuple[dict, list[str]]:
    clean = {name: value for name, value in os.environ.items()
             if name not in MEMORY_FRACTION_VARIABLES and name != "SLUICE_GPU_MEMORY_UTILIZATION"}
    result = subprocess.run([sys.executable, "-c", SERVE_UNTIL_RUN, *args], capture_output=True, text=True,
                            timeout=300, env=clean | env)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout), result.stderr.strip().splitlines()


def test_the_flag_is_jax_allocators_share_set_before_jax_starts():
    seen, errors = serve_until_run("--gpu-memory-utilization", "0.95", env={})
    assert seen == {"XLA_CLIENT_MEM_FRACTION": "0.95", "XLA_PYTHON_CLIENT_MEM_FRACTION": None, "jax started": False,
                    "engine's share": 0.95}
    assert errors == []


def test_a_share_the_user_gave_jax_wins_and_says_so_in_one_line():
    """Under the deprecated name too, which jax still reads, and refuses to start beside the current one."""
    seen, errors = serve_until_run("--gpu-memory-utilization", "0.95",
                                   env={"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.5"})
    assert seen == {"XLA_CLIENT_MEM_FRACTION": None, "XLA_PYTHON_CLIENT_MEM_FRACTION": "0.5", "jax started": False,
                    "engine's share": 0.95}
    assert errors == ["sluice serve: --gpu-memory-utilization 0.95 is ignored: XLA_PYTHON_CLIENT_MEM_FRACTION=0.5 "
                      "gives jax's share of each GPU"]


@pytest.mark.parametrize(("utilization", "environ", "after", "said"), [
    (None, {}, {}, None),
    (0.9, {}, {"XLA_CLIENT_MEM_FRACTION": "0.9"}, None),
    (0.9, {"XLA_CLIENT_MEM_FRACTION": ""}, {"XLA_CLIENT_MEM_FRACTION": "0.9"}, None),  # empty: unset, to jax
    (0.9, {"XLA_CLIENT_MEM_FRACTION": "0.6"}, {"XLA_CLIENT_MEM_FRACTION": "0.6"}, "XLA_CLIENT_MEM_FRACTION=0.6"),
    (0.9, {"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.6"}, {"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.6"},
     "XLA_PYTHON_CLIENT_MEM_FRACTION=0.6"),
    (0.9, {"XLA_CLIENT_MEM_FRACTION": "0.90"}, {"XLA_CLIENT_MEM_FRACTION": "0.90"}, None),  # the share it gives
    (0.9, {"XLA_CLIENT_MEM_FRACTION": "most"}, {"XLA_CLIENT_MEM_FRACTION": "most"}, "XLA_CLIENT_MEM_FRACTION=most"),
])
def test_the_environment_gets_the_share_unless_it_gives_one(utilization, environ, after, said):
    returned = claim_gpu_memory(utilization, environ)
    assert environ == after
    assert (returned is None) if said is None else said in returned


def test_the_flag_and_its_environment_variable_parse(monkeypatch):
    assert build_parser().parse_args(["serve"]).gpu_memory_utilization is None
    assert build_parser().parse_args(["serve", "--gpu-memory-utilization", "0.95"]).gpu_memory_utilization == 0.95
    monkeypatch.setenv("SLUICE_GPU_MEMORY_UTILIZATION", "1")
    assert build_parser().parse_args(["serve"]).gpu_memory_utilization == 1.0


def test_an_environment_value_out_of_range_is_refused_in_one_line_naming_it(monkeypatch, capsys):
    monkeypatch.setenv("SLUICE_GPU_MEMORY_UTILIZATION", "95")
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve"])
    assert capsys.readouterr().err.strip() == (
        "sluice serve: error: argument --gpu-memory-utilization: must be a number greater than 0 and at most 1, got 95 "
        "(set by SLUICE_GPU_MEMORY_UTILIZATION) (see sluice serve --help)")


@pytest.mark.parametrize("utilization", [0.0, -0.5, 1.01])
def test_the_engine_config_refuses_a_share_out_of_range(utilization):
    with pytest.raises(InvalidEngineConfig, match="gpu_memory_utilization must be greater than 0 and at most 1"):
        EngineConfig(gpu_memory_utilization=utilization)


def test_an_h200_at_090_with_16_gb_of_weights_keeps_80_percent_of_the_rest_for_the_pool():
    """jax's allocator may hold 0.9 of 141 GB, 126.9 GB; the weights take 16 of it, and the pool 80% of the 110.9
    left (88.72 GB), the other 20% kept for the steps' activations."""
    stats = {"bytes_limit": int(141 * GB * 0.9), "bytes_in_use": 16 * GB}
    assert accelerator_kv_bytes([stats]) == pytest.approx(88.72 * GB, abs=1)


def test_the_least_free_device_sizes_every_devices_share():
    stats = [{"bytes_limit": 80 * GB, "bytes_in_use": 10 * GB}, {"bytes_limit": 80 * GB, "bytes_in_use": 20 * GB}]
    assert accelerator_kv_bytes(stats) == pytest.approx(48 * GB, abs=1)


def cpu_pool_pages(config: EngineConfig) -> int:
    return num_pool_pages(config, ModelConfig.tiny(), jnp.float32, None, page_size_given=True)


def test_a_cpu_ignores_it_with_one_line_and_keeps_its_fixed_pool(caplog):
    config = EngineConfig(gpu_memory_utilization=0.9, page_size=64)
    with caplog.at_level(logging.INFO, logger="sluice.batching.kv_pool"):
        pages = cpu_pool_pages(config)
    assert pages == CPU_KV_CACHE_BYTES // kv_page_bytes(ModelConfig.tiny(), 64, jnp.float32)
    assert [r.getMessage() for r in caplog.records] == [
        "--gpu-memory-utilization 0.9 is ignored on a CPU: the KV pool is 1024 MiB (--kv-cache-memory sets it)"]


def test_kv_cache_memory_sizes_the_pool_whatever_the_share(caplog):
    """As vLLM's --kv-cache-memory-bytes: the pool is that size; the share still bounds jax's allocator."""
    page = kv_page_bytes(ModelConfig.tiny(), 64, jnp.float32)
    with caplog.at_level(logging.INFO, logger="sluice.batching.kv_pool"):
        pages = cpu_pool_pages(EngineConfig(gpu_memory_utilization=0.5, kv_cache_memory=10 * page, page_size=64))
    assert pages == 10 and caplog.records == []


@pytest.mark.parametrize(("environ", "share"), [({}, 0.75), ({"XLA_CLIENT_MEM_FRACTION": "0.5"}, 0.5),
                                                ({"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.95"}, 0.95)])
def test_the_batch_defaults_read_the_whole_gpu_whatever_share_the_server_was_given(environ, share):
    """An 80 GB H100 is a large accelerator (1,024 sequences, 8,192 tokens a step) at a share of 0.5 too: its
    allocator's limit, 40 GB, is that share of it (at 48 GiB of limit, the defaults dropped to 256 and 2,048)."""
    h100 = 80 * GB
    memory = device_memory_bytes("gpu", int(share * h100), environ)
    assert memory == pytest.approx(h100, abs=2) and default_batch("gpu", memory) == LARGE_ACCELERATOR_BATCH
    assert device_memory_bytes("tpu", 95 * GB, environ) == 95 * GB  # a TPU's limit is its memory
    assert device_memory_bytes("gpu", None, environ) is None
