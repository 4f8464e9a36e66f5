"""Sluice, an LLM inference server on JAX: the package that holds the repository's app/, model/, pallas_kernels/,
batching/, sharding/ and bench/ as `sluice.app`, `sluice.model`, ...

An installed wheel has them inside this package. In a source checkout (where `python -m sluice.bench.gpu_check`
runs without an install) they are folders beside this one, so the package's path also covers the checkout.
"""

from pathlib import Path

_CHECKOUT = Path(__file__).resolve().parent.parent
if (_CHECKOUT / "pyproject.toml").is_file() and (_CHECKOUT / "batching").is_dir():
    __path__.append(str(_CHECKOUT))
