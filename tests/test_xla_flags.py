"""The XLA flags Sluice sets where jax may start a CUDA backend: XLA's command buffers off, unless the user's
XLA_FLAGS choose them; nothing where no CUDA backend can start."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

from sluice.batching import xla_flags
from sluice.batching.xla_flags import NO_COMMAND_BUFFERS, cuda_may_start, without_command_buffers


@pytest.fixture
def cuda_plugin(monkeypatch):
    """jax's CUDA 12 plugin, as importlib finds it (the module itself is never imported)."""
    real = importlib.util.find_spec
    monkeypatch.setattr(xla_flags.importlib.util, "find_spec",
                        lambda name, *args: object() if name == "jax_plugins.xla_cuda12" else real(name, *args))


@pytest.mark.parametrize("environ, flags", [
    ({}, NO_COMMAND_BUFFERS),
    ({"XLA_FLAGS": "--xla_gpu_autotune_level=0"}, f"--xla_gpu_autotune_level=0 {NO_COMMAND_BUFFERS}"),
    ({"JAX_PLATFORMS": "cuda,cpu"}, NO_COMMAND_BUFFERS),
    # The user's choice wins, whatever it is.
    ({"XLA_FLAGS": "--xla_gpu_enable_command_buffer=FUSION,WHILE"}, "--xla_gpu_enable_command_buffer=FUSION,WHILE"),
    # A file of flags, which XLA reads where the value does not start with "-": left whole.
    ({"XLA_FLAGS": "/etc/xla.flags"}, "/etc/xla.flags"),
    # jax may not start CUDA: the flags stay as they are.
    ({"JAX_PLATFORMS": "cpu"}, None),
    ({"JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_gpu_autotune_level=0"}, "--xla_gpu_autotune_level=0"),
])
def test_command_buffers_are_off_where_cuda_may_start_unless_the_flags_choose(cuda_plugin, environ, flags):
    without_command_buffers(environ)
    assert environ.get("XLA_FLAGS") == flags


def test_without_a_cuda_plugin_nothing_is_added(monkeypatch):
    monkeypatch.setattr(xla_flags.importlib.util, "find_spec", lambda name, *args: None)
    environ = {"XLA_FLAGS": "--xla_gpu_autotune_level=0"}
    without_command_buffers(environ)
    assert environ == {"XLA_FLAGS": "--xla_gpu_autotune_level=0"} and not cuda_may_start({})


def test_xla_takes_the_flag():
    """XLA ends the process at its first use of an XLA_FLAGS entry it does not know, or a value it cannot read."""
    run = lambda flags: subprocess.run(
        [sys.executable, "-c", "import jax.numpy as jnp; print(float((jnp.ones(3) + 1).sum()))"],
        capture_output=True, text=True, timeout=120, env={**os.environ, "XLA_FLAGS": flags, "JAX_PLATFORMS": "cpu"})
    assert run(NO_COMMAND_BUFFERS).stdout.strip() == "6.0"
    assert run("--xla_gpu_enable_command_buffer=NO_SUCH_COMMAND").returncode != 0
