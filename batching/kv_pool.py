"""The KV pool's size: how many pages the memory budget holds, and the longest request that pool allows."""

from __future__ import annotations

import logging

import jax
from jax.sharding import Mesh

from sluice.batching.config import DEFAULT_MAX_MODEL_LEN, EngineConfig, InvalidEngineConfig
from sluice.model.config import ModelConfig
from sluice.model.roofline import kv_bytes_per_token

logger = logging.getLogger(__name__)

CPU_KV_CACHE_BYTES = 1 << 30
ACCELERATOR_KV_FRACTION = 0.8


def kv_page_bytes(config: ModelConfig, page_size: int, kv_dtype) -> int:
    """One page of the pool: K and V of page_size tokens over all layers and KV heads (int8: with scales)."""
    return page_size * kv_bytes_per_token(config, kv_dtype)


def default_kv_cache_bytes(mesh: Mesh | None = None, gpu_memory_utilization: float | None = None) -> int:
    """The whole pool, over the devices of `mesh` (None: the first device), each holding an equal share of it
    (its KV heads): `accelerator_kv_bytes` of this process's devices, once per device; a fixed budget on the CPU,
    where `gpu_memory_utilization` (`EngineConfig`'s) is ignored, as vLLM's CPU backend ignores it."""
    devices = (jax.local_devices()[:1] if mesh is None
               else [d for d in mesh.devices.flat if d.process_index == jax.process_index()])
    if devices[0].platform == "cpu" and gpu_memory_utilization is not None:
        logger.info("--gpu-memory-utilization %g is ignored on a CPU: the KV pool is %d MiB (--kv-cache-memory sets "
                    "it)", gpu_memory_utilization, CPU_KV_CACHE_BYTES >> 20)
    stats = [d.memory_stats() or {} for d in devices]
    if devices[0].platform == "cpu" or any("bytes_limit" not in s for s in stats):
        return CPU_KV_CACHE_BYTES
    return accelerator_kv_bytes(stats) * (mesh.size if mesh is not None else 1)


def accelerator_kv_bytes(stats: list[dict[str, int]]) -> int:
    """One device's share of the pool, from each device's `memory_stats()`: ACCELERATOR_KV_FRACTION of the least
    memory left under its allocator's limit (`bytes_limit`: --gpu-memory-utilization of the device where given,
    else jax's default share) by what is in use (`bytes_in_use`: the weights, loaded by now). The rest of it is
    kept for the steps' activations."""
    free = min(s["bytes_limit"] - s.get("bytes_in_use", 0) for s in stats)
    return int(ACCELERATOR_KV_FRACTION * free)


def num_pool_pages(config: EngineConfig, model: ModelConfig, kv_dtype, mesh: Mesh | None, page_size_given: bool
                   ) -> int:
    """The pages of the KV pool: `config.kv_cache_memory` (None: `default_kv_cache_bytes`) over a page's bytes.
    InvalidEngineConfig if it holds none, naming the page size where it was given and the pool's size was not."""
    kv_bytes = config.kv_cache_memory or default_kv_cache_bytes(mesh, config.gpu_memory_utilization)
    page_bytes = kv_page_bytes(model, config.page_size, kv_dtype)
    if kv_bytes < page_bytes and page_size_given and config.kv_cache_memory is None:
        raise InvalidEngineConfig("page_size", f"{config.page_size} makes a page of {page_bytes:,} bytes, more "
                                               f"than the whole KV pool of {kv_bytes:,} bytes (--kv-cache-memory "
                                               f"sets the pool)")
    if kv_bytes < page_bytes:
        raise InvalidEngineConfig("kv_cache_memory", f"of {kv_bytes:,} bytes holds no page: one page of "
                                                     f"{config.page_size} tokens takes {page_bytes:,} bytes")
    return kv_bytes // page_bytes


def resolve_max_model_len(config: EngineConfig, model: ModelConfig, num_pages: int) -> int:
    """`config.max_model_len`, else the model's context up to DEFAULT_MAX_MODEL_LEN and to what the pool holds: a
    request without max_tokens may fill the rest of the context, which a smaller pool would refuse every time. A
    `max_model_len` given past the pool is refused, as vLLM refuses it: the context promised (the model card's
    max_input_tokens) would not be."""
    pooled = num_pages * config.page_size
    if config.max_model_len is not None:
        if config.max_model_len > model.max_position_embeddings:
            raise InvalidEngineConfig("max_model_len", f"{config.max_model_len} exceeds the model's context of "
                                                       f"{model.max_position_embeddings} tokens")
        if config.max_model_len > pooled:
            raise InvalidEngineConfig("max_model_len", f"{config.max_model_len} exceeds the {pooled} tokens the KV "
                                                       f"pool holds ({num_pages} pages of {config.page_size}): a "
                                                       f"larger --kv-cache-memory or --gpu-memory-utilization holds "
                                                       f"more")
        return config.max_model_len
    longest = min(DEFAULT_MAX_MODEL_LEN, model.max_position_embeddings)
    if pooled < longest:
        logger.warning("the KV pool holds %d tokens, fewer than the default context of %d: max_model_len is %d "
                       "(a larger --kv-cache-memory holds more)", pooled, longest, pooled)
    return min(longest, pooled)
