"""The ids of `/v1/responses` responses, which name the replica that stores them (`sluice serve --replicas`), so
that the ingress sends a request naming one (`GET`, `DELETE`, `input_items`, `previous_response_id`) to that
replica (`app/prefix_router.py`): each replica stores its own responses, in its memory."""

from __future__ import annotations

import uuid

PREFIX = "resp_"


def new_response_id(replica: str) -> str:
    """`resp_<hex>` in a single process (`replica` ""), `resp_<replica>_<hex>` in a replica."""
    return f"{PREFIX}{replica}_{uuid.uuid4().hex}" if replica else f"{PREFIX}{uuid.uuid4().hex}"


def replica_of(response_id: str) -> str | None:
    """The replica whose id `response_id` names, None if it names none."""
    replica, separator, _ = response_id.removeprefix(PREFIX).rpartition("_")
    return replica if response_id.startswith(PREFIX) and separator and replica else None
