"""Engine configuration: one frozen dataclass, filled from the CLI or by tests."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from sluice.batching.sampler import SAMPLER_BRANCHES
from sluice.model.llama import LAYER_LOOPS
from sluice.model.quantize import CHOICES as QUANTIZATIONS
from sluice.pallas_kernels.attention import BACKENDS, INT8_KV_KERNELS, reads_int8_kv
from sluice.pallas_kernels.kv_cache import KV_CACHE_DTYPES

DEFAULT_MAX_MODEL_LEN = 4096
# The batch limits when none are given: (max_num_seqs, max_num_batched_tokens) per kind of device. On a CPU, the
# setting every CPU figure in RESULTS.md was measured with: a step's time grows with its rows there, so a larger
# batch trades each stream's speed for little throughput. On an accelerator, vLLM's defaults for its API server:
# 1,024 sequences and 8,192 tokens on an 80 GB-class device or larger (H100, H200), but not an A100 (vLLM found
# the larger prefill chunks slower there), 256 and 2,048 on the others or where the size is not known. The KV pool
# bounds how many of them run at once (`scheduler.py` admits a sequence when its pages fit). The size is the
# device's whole memory (`device_memory_bytes`), whatever share of it the server may use, as vLLM's.
CPU_BATCH = (64, 512)
ACCELERATOR_BATCH = (256, 2048)
LARGE_ACCELERATOR_BATCH = (1024, 8192)
LARGE_ACCELERATOR_BYTES = 64 << 30

# Where jax's GPU backend reads, when it starts, the share of each GPU its allocator may hold: the first is the
# current name, the second the deprecated one it still reads; jax refuses to start with both set. Unset: 75%.
MEMORY_FRACTION_VARIABLES = ("XLA_CLIENT_MEM_FRACTION", "XLA_PYTHON_CLIENT_MEM_FRACTION")
JAX_DEFAULT_MEMORY_FRACTION = 0.75


# Tokens per KV page when none is given. On a CPU, 64: the attention kernel reads a page of one head as one block,
# and the hardware prefetchers do not run past 4 KB, so 16 tokens (4 KB in float32 at head_dim 64) leave it waiting
# on memory; 64 served 16-20% more output tokens per second (RESULTS.md, 2026-11-28). Elsewhere 16, as vLLM's.
CPU_PAGE_SIZE = 64
ACCELERATOR_PAGE_SIZE = 16

# vLLM's defaults of --max-loras and --max-lora-rank: the LoRA slots allocated for runtime updating when not given.
RUNTIME_MAX_LORAS = 1
RUNTIME_MAX_LORA_RANK = 16


def memory_fraction_variable(environ: Mapping[str, str]) -> str | None:
    """The variable of MEMORY_FRACTION_VARIABLES that gives jax's allocator its share in `environ`, if one does."""
    return next((name for name in MEMORY_FRACTION_VARIABLES if environ.get(name)), None)


def device_memory_bytes(platform: str, bytes_limit: int | None, environ: Mapping[str, str]) -> int | None:
    """A device's whole memory from its allocator's limit (`memory_stats()["bytes_limit"]`; None: not known): on a
    GPU, the share of it jax's allocator was given (`environ`'s, else jax's default) taken out."""
    if bytes_limit is None or platform != "gpu":
        return bytes_limit
    given = memory_fraction_variable(environ)
    return int(bytes_limit / (float(environ[given]) if given else JAX_DEFAULT_MEMORY_FRACTION))


def default_batch(platform: str, device_bytes: int | None, device_kind: str = "") -> tuple[int, int]:
    """(max_num_seqs, max_num_batched_tokens) for a device of `platform` (jax's: "cpu", "gpu", "tpu") of
    `device_bytes` of memory (`device_memory_bytes`; None: not known), of `device_kind` (jax's name for it, "NVIDIA
    H100 80GB HBM3" say)."""
    if platform == "cpu":
        return CPU_BATCH
    large = (device_bytes or 0) >= LARGE_ACCELERATOR_BYTES and "a100" not in device_kind.lower()
    return LARGE_ACCELERATOR_BATCH if large else ACCELERATOR_BATCH


class InvalidEngineConfig(ValueError):
    """Engine settings that cannot be served (some found so only once the model is read): `setting`, the field
    of `EngineConfig`, and its `problem` (what it may be)."""

    def __init__(self, setting: str, problem: str):
        super().__init__(f"{setting} {problem}")
        self.setting = setting
        self.problem = problem


@dataclass(frozen=True)
class EngineConfig:
    """How the engine loads its model and sizes its batch and KV pool.

    `max_model_len` None means min(the model's context, 4096, what the KV pool holds). `max_num_seqs`,
    `max_num_batched_tokens` and `page_size` None mean the device's defaults (`default_batch`, `CPU_PAGE_SIZE`),
    filled in by `with_device_defaults` where the device is known.
    `kv_cache_memory` is the KV pool in bytes; None means a default (a fraction of free device memory on
    accelerators, a fixed budget on the CPU).
    `gpu_memory_utilization`: vLLM's share of each GPU's memory the server may use in all (weights, activations,
    KV pool), in (0, 1]. jax's allocator takes it when its backend starts (the CLI sets XLA_CLIENT_MEM_FRACTION),
    and the default pool is sized under that allocator's limit; the engine only says it is ignored on a CPU,
    whose pool is a fixed budget, as vLLM's CPU backend ignores it. None: jax's default share.
    `num_decode_steps` > 1: when every running sequence is decoding and none waits, run that many decode steps
    in one device call (sampled tokens fed back on the device). 8 by measurement (`bench/decode_steps.py`,
    RESULTS.md): it saves a call's fixed cost per token; a request that arrives mid-call waits at most one call.
    `async_scheduling`: overlap the host's work with the device's: the next step is scheduled and dispatched
    while the last one runs, its sampled tokens fed on the device (off: each step is collected before the next).
    `quantization`: the weights' format (`model.quantize.CHOICES`; "auto" picks per device). `chat_template`:
    rendered instead of the model's own (None: the model's). `hf_overrides`: keys that replace an HF folder's
    config.json's before the model is read, as vLLM's --hf-overrides (`model.loader.with_overrides`; None: none).
    `revision`, `download_dir`: a Hugging Face Hub model's revision (None: its default branch) and the HF cache
    folder it is kept in (None: huggingface_hub's), as vLLM's --revision and --download-dir (`model.hub`).
    `kv_cache_dtype`: "auto" keeps K/V in the activation dtype (float32 on a CPU: `kv_cache.kv_cache_dtype`), "int8"
    stores them in int8 with a scale per token and head (`pallas_kernels.kv_cache`), which fits about 3.8x the
    tokens of float32 in the same bytes.
    `layer_loop`: how the model runs its layers (`model.llama.LAYER_LOOPS`; "auto": unrolled on a GPU, where a
    scan copies each layer's weights out of their stack every step, a scan elsewhere).
    `sampler_branches`: who decides which of the sampler's optional passes a step runs (`sampler.SAMPLER_BRANCHES`;
    "auto": the host off the CPU, where a device-side decision stalls the call; the device on a CPU).
    `speculative` "ngram": draft up to `num_speculative_tokens` tokens per decoding sequence by prompt lookup
    (suffixes of `spec_ngram_min`..`spec_ngram_max` tokens) and verify them in one step, while at most
    `spec_max_batch_size` sequences decode (`batching/speculation.py`); inside multi-step decode calls the device
    proposes and checks them at every step of the call.
    `step_timeout_s`: the watchdog's limit on one step of a started engine (None: no watchdog); past it the step is
    taken for hung, and the process exits (`Engine._watch`). 300 s, as SGLang's.
    `enable_lora`: the model takes LoRA adapters (`model.lora`), `lora_modules`' (name, PEFT folder) pairs, served
    beside the base model, each kept in host memory, its rank padded to the largest adapter's, which must be at most
    `max_lora_rank` (None: any). `max_loras` (vLLM's): the device's LoRA slots, the most adapters one batch holds,
    into which the scheduler swaps adapters as sequences need them (`batching.lora_slots`); None: one per adapter,
    each in its own from the start. `lora_modules`' adapters fill the first slots; no more slots than adapters are
    made (every token multiplies every slot's weights), but `max_loras` is what the stats report, as vLLM's.
    `allow_runtime_lora_updating` (vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING): adapters are also loaded and unloaded
    while serving (`Engine.load_lora`), so the slots (`max_loras`, default RUNTIME_MAX_LORAS or one per adapter of
    `lora_modules` where they are more) are of rank `max_lora_rank` (default RUNTIME_MAX_LORA_RANK), for all seven
    projections, zeros where no adapter is.
    `max_cpu_loras` (vLLM's): the most adapters whose weights host memory holds; the least recently used others' are
    dropped, read again from their folder off the engine thread when a sequence needs a slot for one (`LoraSlots.find`).
    None: every adapter's, as long as it is served (not vLLM's default, `max_loras`). The CLI checks it is at least
    `max_loras`, as vLLM does; not checked here (fewer only means more adapters read again).
    A request names its adapter as its `model`.
    `prefix_cache_dir`: keep full KV pages past the pool, in `prefix_cache_ram` bytes of host RAM and then up to
    `prefix_cache_size` bytes of files in that directory (`kv_store.py`), so a restarted server still has them.
    """

    model: str | None = None
    dtype: str | None = None
    quantization: str = "none"
    chat_template: str | None = None
    hf_overrides: Mapping[str, Any] | None = field(default=None, hash=False)  # a dict: the config hashes without it
    revision: str | None = None
    download_dir: str | None = None
    max_model_len: int | None = None
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    num_decode_steps: int = 8
    async_scheduling: bool = True
    speculative: str | None = None
    num_speculative_tokens: int = 4
    spec_ngram_min: int = 1
    spec_ngram_max: int = 4
    spec_max_batch_size: int = 4
    kv_cache_memory: int | None = None
    gpu_memory_utilization: float | None = None
    kv_cache_dtype: str = "auto"
    page_size: int | None = None
    enable_prefix_caching: bool = True
    tp: int = 1
    attention_backend: str = "auto"
    layer_loop: str = "auto"
    sampler_branches: str = "auto"
    warmup: bool = True
    step_timeout_s: float | None = 300.0
    prefix_cache_dir: str | None = None
    prefix_cache_size: int = 16 << 30
    prefix_cache_ram: int = 1 << 30
    enable_lora: bool = False
    lora_modules: tuple[tuple[str, str], ...] = ()
    max_loras: int | None = None
    max_lora_rank: int | None = None
    allow_runtime_lora_updating: bool = False
    max_cpu_loras: int | None = None

    def __post_init__(self) -> None:
        names = [name for name, _ in self.lora_modules]
        checks = [
            (self.max_num_seqs is None or self.max_num_seqs >= 1, "max_num_seqs", "must be at least 1"),
            (self.max_num_batched_tokens is None or self.max_num_batched_tokens >= 1, "max_num_batched_tokens",
             "must be at least 1"),
            (None in (self.max_num_seqs, self.max_num_batched_tokens)
             or self.max_num_batched_tokens >= self.max_num_seqs, "max_num_batched_tokens",
             f"must be at least the sequences a step may run ({self.max_num_seqs}), one token of each"),
            (self.num_decode_steps >= 1, "num_decode_steps", "must be at least 1"),
            (self.speculative in (None, "ngram"), "speculative", "must be 'ngram' or unset"),
            (1 <= self.num_speculative_tokens <= 15, "num_speculative_tokens", "must be in [1, 15]"),
            (1 <= self.spec_ngram_min <= self.spec_ngram_max, "spec_ngram_min", "must be in [1, spec_ngram_max]"),
            (self.spec_max_batch_size >= 1, "spec_max_batch_size", "must be at least 1"),
            (self.page_size is None or self.page_size >= 1 and self.page_size & (self.page_size - 1) == 0,
             "page_size", "must be a power of two (the GPU kernels tile pages by powers of two)"),
            (self.max_model_len is None or self.max_model_len >= 1, "max_model_len", "must be at least 1"),
            (self.kv_cache_memory is None or self.kv_cache_memory > 0, "kv_cache_memory", "must be positive"),
            (self.gpu_memory_utilization is None or 0 < self.gpu_memory_utilization <= 1, "gpu_memory_utilization",
             "must be greater than 0 and at most 1"),
            (self.tp >= 1, "tp", "must be at least 1"),
            (self.step_timeout_s is None or self.step_timeout_s > 0, "step_timeout_s", "must be positive"),
            (self.prefix_cache_dir is None or self.enable_prefix_caching, "prefix_cache_dir",
             "needs prefix caching (it is a tier below it)"),
            (self.prefix_cache_dir is None or self.tp == 1, "prefix_cache_dir", "is not supported with --tp > 1 yet"),
            (self.prefix_cache_size > 0 and self.prefix_cache_ram >= 0, "prefix_cache_size",
             "must be positive (and prefix_cache_ram not negative)"),
            (self.attention_backend in BACKENDS, "attention_backend", f"must be one of {', '.join(BACKENDS)}"),
            (self.layer_loop in LAYER_LOOPS, "layer_loop", f"must be one of {', '.join(LAYER_LOOPS)}"),
            (self.sampler_branches in SAMPLER_BRANCHES, "sampler_branches",
             f"must be one of {', '.join(SAMPLER_BRANCHES)}"),
            (self.quantization in QUANTIZATIONS, "quantization", f"must be one of {', '.join(QUANTIZATIONS)}"),
            (self.kv_cache_dtype in KV_CACHE_DTYPES, "kv_cache_dtype", f"must be one of {', '.join(KV_CACHE_DTYPES)}"),
            (self.kv_cache_dtype != "int8" or reads_int8_kv(self.attention_backend), "kv_cache_dtype",
             f"int8 needs an attention backend that reads it ({', '.join(INT8_KV_KERNELS)}, or auto)"),
            (self.enable_lora or not names, "lora_modules", "needs enable_lora"),
            (self.enable_lora or self.max_loras is None, "max_loras", "needs enable_lora (or lora_modules)"),
            (self.enable_lora or self.max_lora_rank is None, "max_lora_rank", "needs enable_lora (or lora_modules)"),
            (all(names) and len(set(names)) == len(names), "lora_modules", "must have distinct, non-empty names"),
            (self.max_loras is None or self.max_loras >= 1, "max_loras", "must be at least 1"),
            (self.max_lora_rank is None or self.max_lora_rank >= 1, "max_lora_rank", "must be at least 1"),
            (self.max_cpu_loras is None or self.max_cpu_loras >= 1, "max_cpu_loras", "must be at least 1"),
            (self.enable_lora or self.max_cpu_loras is None, "max_cpu_loras", "needs enable_lora (or lora_modules)"),
            (self.enable_lora or not self.allow_runtime_lora_updating, "allow_runtime_lora_updating",
             "needs enable_lora"),
        ]
        for ok, name, why in checks:
            if not ok:
                raise InvalidEngineConfig(name, f"{why}, got {getattr(self, name)!r}")

    @property
    def runtime_lora_slots(self) -> tuple[int, int]:
        """(slots, rank) of the LoRA weights runtime updating holds: max_loras and max_lora_rank, or vLLM's defaults
        (the slots at least one per adapter of `lora_modules`, as vLLM's command lines give them)."""
        return (self.max_loras or max(RUNTIME_MAX_LORAS, len(self.lora_modules)),
                self.max_lora_rank or RUNTIME_MAX_LORA_RANK)

    def with_device_defaults(self, platform: str, device_bytes: int | None, device_kind: str = "") -> EngineConfig:
        """This config with the batch limits (`default_batch`) and the page size it leaves unset taken for a device
        (`default_batch`'s arguments). A limit left unset yields to the other one given (a step's token budget at
        least its sequences)."""
        seqs, tokens = default_batch(platform, device_bytes, device_kind)
        page_size = CPU_PAGE_SIZE if platform == "cpu" else ACCELERATOR_PAGE_SIZE
        return replace(self, max_num_seqs=self.max_num_seqs or min(seqs, self.max_num_batched_tokens or seqs),
                       max_num_batched_tokens=self.max_num_batched_tokens or max(tokens, self.max_num_seqs or 0),
                       page_size=self.page_size or page_size)
