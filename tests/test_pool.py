"""The KV pool's growth: a full pool adds what is needed (at least a granule), never another slab
of the first one's size; accounting is exact."""

from __future__ import annotations

import pytest
import torch

from common.engine.pool import KVPool, PoolFull, token_bytes

SHAPE = (2, 1, 4)  # layers, kv_heads, head_dim


def test_a_full_pool_grows_by_what_is_needed_not_by_its_first_slab():
    pool = KVPool(SHAPE, torch.float32, torch.device("cpu"), slab_tokens=1000, grow_tokens=100)
    first = pool.alloc(1000)
    assert pool.capacity_tokens == 1000
    small = pool.alloc(30)  # a granule
    assert [s.shape[3] for s in pool.slabs] == [1000, 100]
    big = pool.alloc(250)  # more than a granule: exactly that
    assert [s.shape[3] for s in pool.slabs] == [1000, 100, 250]
    rest = pool.alloc(70)  # fits in the granule's hole
    assert pool.capacity_tokens == 1350 and pool.used_tokens == 1350
    assert pool.bytes_per_token == token_bytes(SHAPE, torch.float32) == 2 * 2 * 1 * 4 * 4
    del first, small, big, rest
    assert pool.used_tokens == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_pool_refuses_to_grow_into_the_activations_reserve():
    _, total = torch.cuda.mem_get_info()
    pool = KVPool(SHAPE, torch.float32, torch.device("cuda"), slab_tokens=16, grow_tokens=16, keep_free_bytes=total)
    first = pool.alloc(16)  # the first slab is what was asked for at start
    with pytest.raises(PoolFull):
        pool.alloc(1)
    assert len(pool.slabs) == 1 and first.size == 16
