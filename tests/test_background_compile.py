"""Programs compiled off the engine thread: compiled once per key, failures kept to their key, and a process that
exits while one compiles exits cleanly (XLA aborts a process torn down in the middle of a compile)."""

import gc
import os
import subprocess
import sys
import textwrap
import threading
import weakref

import jax
import jax.numpy as jnp
import numpy as np

from sluice.batching.background_compile import BackgroundCompiler, shapes_of

SPEC = jax.ShapeDtypeStruct((4, 4), jnp.float32)


def test_a_submitted_program_compiles_once_and_runs_as_the_jitted_one():
    compiler = BackgroundCompiler()
    double = jax.jit(lambda x: 2 * x)
    x = jnp.arange(16, dtype=jnp.float32).reshape(4, 4)
    assert compiler.get("double") is None and "double" not in compiler
    compiler.submit("double", lambda: double.lower(*shapes_of((x,))))
    assert "double" in compiler
    compiler.wait()
    np.testing.assert_array_equal(compiler.get("double")(x), double(x))
    assert compiler.num_compiled == 1


def test_a_program_that_fails_to_compile_stays_missing_and_the_others_compile():
    compiler = BackgroundCompiler()

    def broken():
        raise RuntimeError("no such program")

    compiler.submit("broken", broken)
    compiler.submit("negate", lambda: jax.jit(lambda x: -x).lower(SPEC))
    compiler.wait()
    assert compiler.get("broken") is None and "broken" in compiler
    assert compiler.get("negate") is not None


def test_a_process_that_exits_while_a_program_compiles_exits_cleanly():
    script = textwrap.dedent("""
        import threading, time
        import jax, jax.numpy as jnp
        from sluice.batching.background_compile import BackgroundCompiler

        def long(x):
            def body(x, _):
                for _ in range(1500):
                    x = jnp.sin(x @ x) + jnp.cos(x)
                return x, None
            return jax.lax.scan(body, x, None, length=8)[0]

        compiler = BackgroundCompiler()
        spec = jax.ShapeDtypeStruct((256, 256), jnp.float32)
        lowered = threading.Event()

        def lower():
            program = jax.jit(long).lower(spec)
            lowered.set()  # XLA compiles it next
            return program

        compiler.submit("long", lower)
        compiler.submit("queued", lambda: jax.jit(lambda x: long(x) + 1).lower(spec))
        lowered.wait()
        time.sleep(0.5)  # into the compile, which takes seconds
        print("compiled at exit:", compiler.num_compiled)
    """)
    env = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}  # compiled, not loaded
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "compiled at exit: 0" in done.stdout


def test_a_process_waits_at_exit_for_the_compile_of_a_compiler_it_dropped():
    """A dropped engine's compiler stops after the program it is on, but the process may exit first: XLA aborted
    such a process (exit codes 134 and 139 seen). The compile here is a stand-in that says when it ends."""
    script = textwrap.dedent("""
        import gc, threading, time
        from sluice.batching.background_compile import BackgroundCompiler

        started = threading.Event()

        class SlowLowered:
            def compile(self):
                started.set()
                time.sleep(1.0)
                print("compile ended", flush=True)
                return "program"

        compiler = BackgroundCompiler()
        compiler.submit("slow", SlowLowered)
        started.wait()
        del compiler
        gc.collect()
        print("exiting", flush=True)
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["exiting", "compile", "ended"]


def test_a_dropped_compiler_ends_its_thread():
    """A process that builds engine after engine (a test run, a fuzz) keeps no compile thread, nor its programs,
    per engine gone."""
    before = set(threading.enumerate())
    compiler = BackgroundCompiler()
    compiler.submit("negate", lambda: jax.jit(lambda x: -x).lower(SPEC))
    compiler.wait()
    (thread,) = set(threading.enumerate()) - before
    gone = weakref.ref(compiler)
    del compiler
    gc.collect()
    thread.join(timeout=30)
    assert gone() is None and not thread.is_alive()
