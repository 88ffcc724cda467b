"""A lease per stream (SET NX PX + owner-checked renewal) so exactly one encoder writes it.

A lease names its holder's process, not only its consumer name (`lease_owner`): two processes
under one name (a replacement started while the old one is frozen, or a name given twice by
mistake) each renewed the other's lease and both passed the publish fence, so one stream's head
had two writers. `holder_name` is the worker name an operator knows, for status and the API."""

from __future__ import annotations

import re
import secrets

import redis
import structlog

from common.wire import keys

log = structlog.get_logger(__name__)

# Renew or release only if we still own it: another encoder may have taken over after expiry.
# A lease is a string (its owner); a key of another type there is damage (nothing of ours writes
# one), and its WRONGTYPE stopped the worker renewing it, and every worker after it: it is
# deleted (-1), so the stream is free for a worker to take again.
_OWNED = """
local owner = redis.pcall('get', KEYS[1])
if type(owner) == 'table' and owner.err then
  if string.find(owner.err, 'WRONGTYPE', 1, true) then redis.call('del', KEYS[1]) return -1 end
  return redis.error_reply(owner.err)
end
if owner ~= ARGV[1] then return 0 end
"""
_RENEW = _OWNED + "return redis.call('pexpire', KEYS[1], ARGV[2])"
_RELEASE = _OWNED + "return redis.call('del', KEYS[1])"


LIFE_MARK = "#"  # between a consumer name and its process's life in a lease's value
_LIFE = re.compile(r"[0-9a-f]{12}")


def lease_owner(consumer: str) -> str:
    """This process's lease value: its consumer name and a random life, new at every start."""
    return f"{consumer}{LIFE_MARK}{secrets.token_hex(6)}"


def holder_name(value: bytes | str) -> str:
    """The consumer name in a lease's value (a value without a life, an older worker's, is one)."""
    text = value.decode("utf-8", "replace") if isinstance(value, bytes) else value
    name, mark, life = text.rpartition(LIFE_MARK)
    return name if mark and _LIFE.fullmatch(life) else text


class Lease:
    def __init__(self, r: redis.Redis, stream: str, owner: str, ttl_ms: int):
        self.r, self.key, self.owner, self.ttl_ms = r, keys.lease(stream), owner, ttl_ms

    def acquire(self) -> bool:
        """Take the lease if free, or keep it if already ours."""
        if self.r.set(self.key, self.owner, nx=True, px=self.ttl_ms):
            return True
        return self.renew()

    def renew(self) -> bool:
        return self._owned(self.r.eval(_RENEW, 1, self.key, self.owner, self.ttl_ms))

    def release(self) -> None:
        self._owned(self.r.eval(_RELEASE, 1, self.key, self.owner))

    def _owned(self, reply: int) -> bool:
        if int(reply) < 0:
            log.error("lease key held no lease (a wrong type); removed, the stream is free again", key=self.key)
        return int(reply) > 0
