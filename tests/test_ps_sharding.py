"""Parameter-server layout: partitions cover every element once, are capped, and balance by bytes."""

from __future__ import annotations

import pytest

from ringtrain.ps.sharding import ITEMSIZE, cut, layout_digest, make_layout, partition_count

pytestmark = pytest.mark.timeout(30)


@pytest.mark.parametrize("numel", [0, 1, 3, 4, 5, 7, 100, 101, 1000])
@pytest.mark.parametrize("cap_elems", [1, 2, 3, 10, 1000])
def test_cut_covers_exactly_and_respects_the_cap(numel, cap_elems):
    pieces = cut(numel, cap_elems * ITEMSIZE)
    covered = [i for s, e in pieces for i in range(s, e)]
    assert covered == list(range(numel))
    assert all(0 < e - s <= cap_elems for s, e in pieces) or numel == 0
    sizes = [e - s for s, e in pieces]
    assert max(sizes) - min(sizes) <= 1 or len(sizes) == 1 or sizes[-1] < sizes[0]
    # As few pieces as the cap allows, and as many as partition_count (a server's check of a
    # worker's claim before it builds the layout) says without cutting.
    if numel:
        assert len(pieces) == -(-numel // cap_elems) == partition_count([numel], cap_elems * ITEMSIZE)


@pytest.mark.parametrize("servers", [1, 2, 3, 4, 7])
def test_layout_covers_every_parameter_once(servers):
    numels = [5, 1000, 3, 0, 4096, 17, 250]
    layout = make_layout(numels, servers, partition_bytes=64 * ITEMSIZE)
    for param, n in enumerate(numels):
        parts = sorted(layout.of_param(param), key=lambda p: p.start)
        assert [i for p in parts for i in range(p.start, p.stop)] == list(range(n)), param
    assert [p.id for p in layout.partitions] == list(range(len(layout.partitions)))
    assert all(p.numel <= 64 for p in layout.partitions)
    # every partition in exactly one shard; shard order is id order; offsets are running sums
    shards = [layout.shard(k) for k in range(servers)]
    assert sorted(p.id for s in shards for p in s) == list(range(len(layout.partitions)))
    for k, shard in enumerate(shards):
        assert [p.id for p in shard] == sorted(p.id for p in shard)
        offsets = layout.offsets(k)
        at = 0
        for p in shard:
            assert offsets[p.id] == at
            at += p.numel
        assert layout.shard_numel(k) == at


@pytest.mark.parametrize("servers", [2, 3, 4])
def test_a_large_tensor_is_spread_so_no_server_is_the_hot_spot(servers):
    # one 10 MB tensor and some small ones, 1 MB partitions: LPT keeps every server within
    # one partition of the others.
    numels = [10 * (1 << 20) // 4, 1000, 2000, 300]
    layout = make_layout(numels, servers, partition_bytes=1 << 20)
    loads = layout.bytes_per_server()
    biggest = max(p.numel for p in layout.partitions) * ITEMSIZE
    assert max(loads) - min(loads) <= biggest
    assert sum(loads) == ITEMSIZE * sum(numels)
    assert len({p.server for p in layout.of_param(0)}) == servers


def test_layout_is_deterministic_and_its_digest_tells_layouts_apart():
    a = make_layout([10, 20, 30], 2, 32)
    assert a == make_layout([10, 20, 30], 2, 32)
    digests = {a.digest(), make_layout([10, 20, 31], 2, 32).digest(), make_layout([10, 20, 30], 3, 32).digest(),
               make_layout([10, 20, 30], 2, 64).digest()}
    assert len(digests) == 4
    # Sizes that read the same run together ([1, 23] and [12, 3]) are different models.
    assert make_layout([1, 23], 2, 32).digest() != make_layout([12, 3], 2, 32).digest()
    assert layout_digest([10, 20, 30], 2, 32) == a.digest()


@pytest.mark.parametrize("kwargs,word", [({"servers": 0}, "servers"), ({"servers": 1.5}, "servers"),
                                         ({"servers": True}, "servers"),
                                         ({"servers": 1, "partition_bytes": 2}, "partition_bytes")])
def test_bad_arguments_name_the_option(kwargs, word):
    with pytest.raises(ValueError, match=word):
        make_layout([4, 4], **kwargs)
    with pytest.raises(ValueError, match="sizes"):
        make_layout([-1], 1)


@pytest.mark.parametrize("numels", [[5, 7, 0, 3], [9, 1, 1]])
def test_as_many_servers_as_partitions_is_served_one_partition_each(numels):
    servers = partition_count(numels, 8 * ITEMSIZE)
    layout = make_layout(numels, servers, partition_bytes=8 * ITEMSIZE)
    assert len(layout.partitions) == servers
    assert sorted(p.server for p in layout.partitions) == list(range(servers))
    with pytest.raises(ValueError, match=f"use at most {servers} servers"):
        make_layout(numels, servers + 1, partition_bytes=8 * ITEMSIZE)


def test_partitions_go_largest_first_to_the_least_loaded_server_ties_to_the_lower():
    # No cutting (every parameter fits one partition). Largest first: 8 -> s0; 4 -> s1; 4 -> s1
    # (4 < 8); then the four 1s alternate from a tie (8 = 8: the lower server, s0). Loads 10 and
    # 10 elements; round-robin by id would give 14 and 6, and ties to the higher server would
    # swap every 1 between the servers.
    layout = make_layout([8, 1, 1, 1, 1, 4, 4], 2, partition_bytes=64 * ITEMSIZE)
    assert [p.server for p in layout.partitions] == [0, 0, 1, 0, 1, 1, 1]
    assert layout.bytes_per_server() == [10 * ITEMSIZE, 10 * ITEMSIZE]


@pytest.mark.parametrize("servers", [2, 3, 5])
def test_longest_first_keeps_every_server_within_one_partition_of_the_least_loaded(servers):
    # Greedy dealing's guarantee (LPT keeps it): the fullest server was the emptiest when it took
    # its last partition, so max - min <= the largest partition. Sizes fall and rise so that
    # dealing round-robin by id breaks it.
    numels = [1, 1, 1, 30, 1, 1, 29, 2, 2, 28, 3, 3, 27, 1]
    layout = make_layout(numels, servers, partition_bytes=64 * ITEMSIZE)
    loads = layout.bytes_per_server()
    assert sum(loads) == ITEMSIZE * sum(numels)
    assert max(loads) - min(loads) <= ITEMSIZE * max(numels), loads
