"""A stateless consumer-group read for tests: what GroupReader does, without its cursors."""

from __future__ import annotations

from collections.abc import Iterable

import redis

from common import redisio


def read_group(
    r: redis.Redis,
    stream_keys: Iterable[str],
    group: str,
    consumer: str,
    *,
    count: int = 10,
    block_ms: int = 5000,
) -> list[redisio.Entry]:
    """This consumer's pending entries if it has any (after a crash), else new ones (blocking).

    Stateless: entries left un-acked come back on every call. A consumer that keeps entries
    pending across reads on purpose (the encoder, until a chunk is complete) uses GroupReader.
    """
    streams = list(stream_keys)
    pending = redisio._drop_trimmed(
        r, group, redisio._entries(r.xreadgroup(group, consumer, dict.fromkeys(streams, "0"), count))
    )
    if pending:
        return pending
    redisio._check_block(r, block_ms)
    return redisio._entries(r.xreadgroup(group, consumer, dict.fromkeys(streams, ">"), count, block=block_ms))
