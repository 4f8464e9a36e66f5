"""The model over the paged KV pool gives the same logits as over the contiguous baseline cache."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from sluice.model.config import ModelConfig
from sluice.model.generate import sequence_logits
from sluice.model.llama import Llama, empty_kv_cache
from sluice.model.paged_attend import AttentionMetadata, flat_pool, make_paged_attend

PAGE_SIZE = 4


def test_chunked_prefill_and_decode_over_shuffled_pages_match_contiguous_logits():
    config = ModelConfig.tiny()
    model = Llama(config, rngs=nnx.Rngs(3))
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 256, n).tolist() for n in (9, 3, 14)]
    num_pages = 16
    kv_cache = flat_pool(empty_kv_cache(config, num_pages, PAGE_SIZE, jnp.float32))
    pages = rng.permutation(num_pages)[:12].reshape(3, 4)  # each sequence owns 4 scattered pages

    @jax.jit
    def step(kv_cache, tokens, positions, meta):
        attend = make_paged_attend(meta, num_pages, sm_scale=config.softmax_scale, backend="reference")
        hidden, kv_cache = model(tokens, positions, kv_cache, attend)
        return model.logits(hidden), kv_cache

    done = [0, 0, 0]
    outputs: list[list[np.ndarray]] = [[], [], []]
    for chunk in (5, 5, 5, 1):  # chunked prefill of unequal prompts, then a mixed step
        tokens, positions, slots, q_lens = [], [], [], []
        for s, prompt in enumerate(prompts):
            new = prompt[done[s] : done[s] + chunk]
            for i, token in enumerate(new):
                pos = done[s] + i
                tokens.append(token)
                positions.append(pos)
                slots.append(int(pages[s, pos // PAGE_SIZE]) * PAGE_SIZE + pos % PAGE_SIZE)
            q_lens.append(len(new))
        pad = 16 - len(tokens)
        meta = AttentionMetadata(
            slot_mapping=jnp.asarray(slots + [-1] * pad, jnp.int32),
            kv_lens=jnp.asarray([d + q for d, q in zip(done, q_lens)], jnp.int32),
            page_table=jnp.asarray(pages, jnp.int32),
            cu_q_lens=jnp.asarray(np.concatenate([[0], np.cumsum(q_lens)]), jnp.int32),
            max_q_len=max(max(q_lens), 1),
        )
        logits, kv_cache = step(kv_cache, jnp.asarray(tokens + [0] * pad, jnp.int32),
                                jnp.asarray(positions + [0] * pad, jnp.int32), meta)
        row = 0
        for s in range(3):
            outputs[s].extend(np.asarray(logits[row : row + q_lens[s]]))
            row += q_lens[s]
            done[s] += q_lens[s]

    for s, prompt in enumerate(prompts):
        np.testing.assert_allclose(np.stack(outputs[s]), sequence_logits(model, prompt), rtol=1e-5, atol=1e-5)
