"""The measured peaks (`model.roofline`): the streamed bandwidth measure, which a GPU's peak takes (its loops do
every pass, each on what the last one gave, so that no pass can be taken out of the loop or merged with another),
and a CPU's int8 matmul rate, which counts Sluice's own kernel."""

import jax.numpy as jnp
import numpy as np
import pytest

from sluice.model import roofline
from sluice.model.roofline import int8_kernel_seconds, measure_peaks, stream_loops, streamed_bandwidth
from sluice.pallas_kernels import cpu_qmatmul


def test_stream_loops_do_every_pass_on_what_the_last_one_gave():
    m = np.random.default_rng(0).random((16, 8192), dtype=np.float32)
    read, read_write = stream_loops(3)
    expected = np.zeros(16, np.float32)
    for _ in range(3):
        expected = expected + np.maximum(m - expected[:1, None], 0).sum(axis=1)
    np.testing.assert_allclose(read(jnp.asarray(m)), expected, rtol=1e-5)
    np.testing.assert_allclose(read_write(jnp.asarray(m)), m + 3, rtol=1e-6)


def test_streamed_bandwidth_is_a_rate():
    bandwidth = streamed_bandwidth(jnp.ones((512, 8192), jnp.float32), repeats=3)
    assert 1e8 < bandwidth < 1e14, bandwidth


needs_kernels = pytest.mark.skipif(not cpu_qmatmul.available(), reason="the CPU kernel library is not built here")


@needs_kernels
def test_the_int8_kernel_is_timed_on_an_n_cubed_product():
    assert 0 < int8_kernel_seconds(64, repeats=1) < 10


@needs_kernels
def test_a_cpus_int8_peak_is_the_faster_of_xlas_dot_and_sluices_kernel(monkeypatch):
    # Without VNNI, XLA's int8 dot ran at the float32 rate, slower than the kernels that serve (a 2-core EPYC).
    monkeypatch.setattr(roofline, "int8_kernel_seconds", lambda n, repeats: 1e-6)
    peaks = measure_peaks(elements=1 << 16, matmul_sizes=(64,), repeats=1, dtype="int8")
    assert peaks.matmul_gflops == pytest.approx(2 * 64**3 / 1e-6 / 1e9)
    monkeypatch.setattr(roofline, "int8_kernel_seconds", lambda n, repeats: 1e3)
    assert measure_peaks(elements=1 << 16, matmul_sizes=(64,), repeats=1, dtype="int8").matmul_gflops > 2 * 64**3 / 1e3 / 1e9
