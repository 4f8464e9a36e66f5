"""Shared fixtures: the real default model (loaded once per session) and small random models; and how the suite
shares the machine under pytest-xdist (`make test` runs two workers).

Under xdist a test module is the unit of work: each module runs whole on one worker, so its module-scoped server
starts once. The Ray modules and those in ALONE run on one worker, one after another, with nothing else running
meanwhile: they start Ray clusters, race Ray Serve's timers or assert timings. `pytest -p no:xdist` (or
`-n 0`) runs everything in one process, in file order, as before.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

import pytest

# Modules that cannot share the machine with another module, besides every tests/test_ray_*.py: a Ray cluster
# each (two at once collide on ports and fight over the 2 CPUs), an autoscaler whose second replica must start
# before the downscale delay runs out, a SIGKILLed replica to be replaced within a minute.
ALONE = (
    "test_bench_soak.py",  # its load, SIGKILL and restart run on a clock
    "test_faults.py",  # a 2 s --step-timeout must be hit by the injected hang, not by a starved step
    "test_server_responsiveness.py",  # /health within 0.5 s while a grammar compiles
)
# The others that take more than about 25 s (measured under `make test` with an empty compilation cache, as on CI),
# slowest first, so that the workers end together (a stale order costs minutes, not correctness); then the rest in
# file order; those that run alone last, while the other worker ends its last short module.
SLOWEST_FIRST = (
    "test_tensor_parallel.py", "test_speculative.py", "test_engine.py", "test_engine_overlap.py", "test_quantization.py",
    "test_gpu_check.py", "test_api_fuzz.py", "test_lora_swap.py", "test_cli.py", "test_structured_output.py",
    "test_lora_serving.py", "test_api_e2e.py", "test_persistent_prefix_cache.py", "test_engine_mix.py",
    "test_kernel_build.py", "test_reasoning.py", "test_stalled_readers.py", "test_engine_smollm.py",
    "test_bench_smoke.py", "test_tool_calls.py", "test_rope_scaling.py", "test_multihost.py", "test_run_batch.py",
    "test_golden_smollm2.py", "test_server_chaos.py", "test_family_golden.py", "test_structured_engine.py",
    "test_agents_sdk.py", "test_lora.py", "test_paged_attention.py", "test_anthropic_messages.py",
    "test_openai_client.py", "test_engine_check.py", "test_sampler.py", "test_model_runner.py",
    "test_engine_int8_kv.py", "test_embeddings.py", "test_responses_api.py", "test_qwen3.py", "test_granite.py",
)


@pytest.fixture(scope="session", autouse=True)
def _compilation_cache() -> None:
    """Every test process, and every process a test starts, compiles through the persistent cache the engine
    uses from its first jit on, not only once an Engine exists: a test's compile time then does not depend on
    which tests ran before it in its process, and what a server compiles to convert a model is not compiled
    again at each start."""
    import jax

    from sluice.batching.compilation_cache import enable_compilation_cache

    enable_compilation_cache()
    for option in ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs",
                   "jax_persistent_cache_min_entry_size_bytes"):
        os.environ.setdefault(option.upper(), str(getattr(jax.config, option)))


@pytest.fixture(scope="session")
def smollm2():
    """The real SmolLM2-135M-Instruct (float32), fetched and converted on first use."""
    from sluice.model.loader import load_model

    return load_model(dtype="float32")


def home_with_built_kernels(home: Path) -> Path:
    """`home` as a SLUICE_HOME whose CPU kernels are those of the SLUICE_HOME the tests run under (linked, built
    there by whichever process needs them first): a process started under an empty home of its own would build
    them again (about 14 s of a server's start)."""
    from sluice.pallas_kernels import cpu_build

    built = cpu_build.cache_root()
    built.mkdir(parents=True, exist_ok=True)
    with pytest.MonkeyPatch.context() as env:
        env.setenv("SLUICE_HOME", str(home))
        linked = cpu_build.cache_root()
    linked.parent.mkdir(parents=True, exist_ok=True)
    linked.symlink_to(built, target_is_directory=True)
    return home


def _module_of(nodeid: str) -> str:
    return nodeid.split("::", 1)[0].rsplit("/", 1)[-1]


def _alone(module: str) -> bool:
    return module.startswith("test_ray_") or module in ALONE


@pytest.hookimpl(tryfirst=True, optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """Modules as units of work, those that run alone one unit; in the order the workers collected them."""
    from xdist.scheduler import LoadScopeScheduling

    class ModuleScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            module = _module_of(nodeid)
            return "ALONE" if _alone(module) else module

    config.option.loadscopereorder = False
    return ModuleScheduling(config, log)


def pytest_collection_modifyitems(config, items):
    if "PYTEST_XDIST_WORKER" not in os.environ:
        return

    def rank(item) -> int:
        module = _module_of(item.nodeid)
        if _alone(module):
            return len(SLOWEST_FIRST) + 1
        return SLOWEST_FIRST.index(module) if module in SLOWEST_FIRST else len(SLOWEST_FIRST)

    items.sort(key=rank)  # stable: file order within a rank


class MachineLock:
    """A worker's hold on the machine, shared (any module) or exclusive (a module that runs alone), taken as a module
    starts and kept until a module needs the other kind. flock on two files in the run's temporary folder: an
    exclusive taker holds `gate` while it waits for `machine`, so shared takers queue behind it instead of
    starving it; a shared holder lets go of `machine` between modules, for an exclusive taker to get in."""

    def __init__(self, folder: Path):
        self.gate = os.open(folder / "machine.gate", os.O_RDWR | os.O_CREAT)
        self.machine = os.open(folder / "machine.lock", os.O_RDWR | os.O_CREAT)
        self.held: str | None = None

    def take(self, alone: bool) -> None:
        if alone and self.held == "exclusive":
            return
        if self.held is not None:
            fcntl.flock(self.machine, fcntl.LOCK_UN)
            if self.held == "exclusive":
                fcntl.flock(self.gate, fcntl.LOCK_UN)
        if alone:
            fcntl.flock(self.gate, fcntl.LOCK_EX)
            fcntl.flock(self.machine, fcntl.LOCK_EX)
            self.held = "exclusive"
        else:
            fcntl.flock(self.gate, fcntl.LOCK_SH)
            fcntl.flock(self.machine, fcntl.LOCK_SH)
            fcntl.flock(self.gate, fcntl.LOCK_UN)
            self.held = "shared"

    def close(self) -> None:
        # A worker that has run its share stays alive until the others end: it must let go of the machine.
        os.close(self.machine)
        os.close(self.gate)


@pytest.fixture(scope="session")
def _machine_lock(tmp_path_factory):
    if "PYTEST_XDIST_WORKER" not in os.environ:
        yield None
        return
    # Each worker's base temporary folder is popen-gwN inside the run's folder, which the workers share.
    lock = MachineLock(tmp_path_factory.getbasetemp().parent)
    yield lock
    lock.close()


@pytest.fixture(scope="module", autouse=True)
def _share_the_machine(request, _machine_lock) -> None:
    if _machine_lock is not None:
        _machine_lock.take(alone=_alone(_module_of(request.node.nodeid)))
