"""The streamed bandwidth measure (`model.roofline.streamed_bandwidth`), which a GPU's peak takes: its loops do
every pass, each on what the last one gave, so that no pass can be taken out of the loop or merged with another."""

import jax.numpy as jnp
import numpy as np

from sluice.model.roofline import stream_loops, streamed_bandwidth


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
