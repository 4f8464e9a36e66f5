"""The ids of `/v1/responses` responses, of `/v1/conversations` conversations and of the items they store, which name
the replica that stores them (`sluice serve --replicas`), so that the ingress sends a request naming one (`GET`,
`DELETE`, `input_items`, `previous_response_id`, `conversation`, an `item_reference`) to that replica
(`app/prefix_router.py`): each replica stores its own responses and conversations, in its memory."""

from __future__ import annotations

import uuid


def new_id(kind: str, replica: str | None) -> str:
    """`{kind}_<hex>` in a single process (`replica` "" or None), `{kind}_<replica>_<hex>` in a replica; `kind`:
    `resp` for a response, `conv` for a conversation, `msg`, `fc`, `fco` or `rs` for an item."""
    return f"{kind}_{replica}_{uuid.uuid4().hex}" if replica else f"{kind}_{uuid.uuid4().hex}"


def replica_of(named_id: str) -> str | None:
    """The replica whose id `named_id` (a response's or a stored item's) names, None if it names none."""
    kind, _, rest = named_id.partition("_")
    replica, separator, _ = rest.rpartition("_")
    return replica if kind and separator and replica else None

