"""An episode split into several trajectories (openai_agent when the agent rewrote its history): its
group waits for every chain, exactly once, across duplicates, snapshots, undo and stale drops."""

from __future__ import annotations

import pytest

from asyncrl.buffer import protocol as P
from asyncrl.buffer.client import AsyncBufferProducer, BufferConsumer
from asyncrl.buffer.server import decode_put
from asyncrl.buffer.store import BufferState
from asyncrl.data.schema import SchemaError, encode, make_trajectory

GID = "r1-g0"


def chain(uid: str, episode: int, chains: int, version: int = 0):
    return make_trajectory(uid=uid, group_id=GID, group_size=2, prompt_ids=[1, 2], response_ids=[7, 8],
                           loss_mask=[1, 1], behavior_logprobs=[-0.1, -0.2], versions=[version, version],
                           reward=1.0, sample_index=episode, episode_chains=chains)


def entry(uid: str, episode: int, chains: int, version: int = 0):
    return decode_put(encode(chain(uid, episode, chains, version)))


SPLIT = [("r1-g0-0", 0, 3), ("r1-g0-0-c1", 0, 3), ("r1-g0-0-c2", 0, 3)]  # episode 0: three chains
WHOLE = ("r1-g0-1", 1, 1)  # episode 1: one trajectory


def rebuilt(st: BufferState) -> BufferState:
    """A fresh state from `st`'s compaction records, applied as replay does."""
    new = BufferState(1000, 1 << 30)
    for kind, payload in st.snapshot_records():
        if kind == P.REC_SNAPSHOT:
            new.apply_snapshot(P.unpack(payload, P.Snapshot))
        else:
            assert kind == P.REC_PUT
            new.apply_put(decode_put(payload))
    return new


def test_the_group_waits_for_every_chain_of_a_split_episode_once():
    st = BufferState(1000, 1 << 30)
    st.apply_put(entry(*WHOLE))
    st.apply_put(entry(*SPLIT[0]))
    g = st.groups[GID]
    assert g.expected == 4 and not g.is_complete()  # 2 episodes, one of them 3 chains
    st.apply_put(entry(*SPLIT[1]))
    assert st.apply_put(entry(*SPLIT[1])) == "dup" and g.expected == 4 and not g.is_complete()
    again = rebuilt(st)  # a compaction now: the re-put chains must not extend the group twice
    assert again.groups[GID].expected == 4 and again.groups[GID].extended == {0}
    for s in (st, again):
        s.apply_put(entry(*SPLIT[2]))
        assert s.groups[GID].is_complete()
        rec = s.plan_batch(1)
        assert rec is not None and sorted(u for sg in rec.groups for u in sg.uids) == sorted(
            [WHOLE[0]] + [u for u, _, _ in SPLIT])


def test_undoing_the_put_that_extended_the_group_restores_it():
    st = BufferState(1000, 1 << 30)
    st.apply_put(entry(*WHOLE))
    e = entry(*SPLIT[1])  # a later chain may arrive first: it extends
    assert st.apply_put(e) == "new" and st.groups[GID].expected == 4
    st.unapply_put(e, created=False)
    g = st.groups[GID]
    assert (g.expected, g.extended, len(g.members)) == (2, set(), 1)
    st.apply_put(entry(*SPLIT[0]))
    assert g.expected == 4 and g.extended == {0}


def test_a_stale_chain_counts_as_one_failed_trajectory():
    st = BufferState(1000, 1 << 30)
    st.apply_put(entry(*WHOLE, version=5))
    st.apply_put(entry(*SPLIT[0], version=5))
    st.apply_put(entry(*SPLIT[1], version=0))  # old weights: dropped as stale
    st.apply_drop(st.stale_uids(threshold=3))
    assert not st.groups[GID].is_complete()
    st.apply_put(entry(*SPLIT[2], version=5))
    g = st.groups[GID]
    assert g.is_complete() and (len(g.members), g.failed, g.expected) == (3, 1, 4)


@pytest.mark.parametrize("chains", [0, -1, 257, 10**9])
def test_an_impossible_chain_count_is_refused_naming_it(chains):
    t = chain("r1-g0-0", 0, 1)
    t.episode_chains = chains
    with pytest.raises(SchemaError, match="episode_chains"):
        t.validate()
    with pytest.raises(ValueError, match="episode_chains"):
        decode_put(encode(t))


async def test_the_service_serves_a_split_episode_whole(service):
    addr = service().address
    p = AsyncBufferProducer(addr)
    c = BufferConsumer(addr)
    try:
        assert await p.put_bytes(encode(chain(*SPLIT[0]))) == "new"
        assert await p.put_bytes(encode(chain(*WHOLE))) == "new"
        assert c.stats()["groups_complete"] == 0
        for u in SPLIT[1:]:
            assert await p.put_bytes(encode(chain(*u))) == "new"
        b = c.get_batch(1, 0, timeout_s=10)
        (g,) = b.groups
        assert (g.group_id, g.expected, g.failed) == (GID, 4, 0)
        assert sorted(t.uid for t in g.trajectories) == sorted([WHOLE[0]] + [u for u, _, _ in SPLIT])
    finally:
        await p.close()
        c.close()
