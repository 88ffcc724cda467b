"""A lease per stream (SET NX PX + owner-checked renewal) so exactly one encoder writes it."""

from __future__ import annotations

import redis

from common.wire import keys

# Renew or release only if we still own it: another encoder may have taken over after expiry.
_RENEW = "if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('pexpire', KEYS[1], ARGV[2]) end return 0"
_RELEASE = "if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) end return 0"


class Lease:
    def __init__(self, r: redis.Redis, stream: str, owner: str, ttl_ms: int):
        self.r, self.key, self.owner, self.ttl_ms = r, keys.lease(stream), owner, ttl_ms

    def acquire(self) -> bool:
        """Take the lease if free, or keep it if already ours."""
        if self.r.set(self.key, self.owner, nx=True, px=self.ttl_ms):
            return True
        return self.renew()

    def renew(self) -> bool:
        return bool(self.r.eval(_RENEW, 1, self.key, self.owner, self.ttl_ms))

    def release(self) -> None:
        self.r.eval(_RELEASE, 1, self.key, self.owner)
