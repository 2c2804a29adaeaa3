"""The broker's prefix index, pure: event order, gaps and snapshots, restarts, liveness, overlap."""

from __future__ import annotations

import pytest

from libs.prefix.index import PrefixIndex
from proto import messages as m


def stored(seq: int, *hashes: int, wid: str = "p0", epoch: str = "e1") -> m.BlocksStored:
    return m.BlocksStored(worker_id=wid, epoch=epoch, seq=seq, hashes=list(hashes))


def removed(seq: int, *hashes: int, wid: str = "p0", epoch: str = "e1") -> m.BlocksRemoved:
    return m.BlocksRemoved(worker_id=wid, epoch=epoch, seq=seq, hashes=list(hashes))


def snapshot(seq: int, *hashes: int, wid: str = "p0", epoch: str = "e1") -> m.KvSnapshot:
    return m.KvSnapshot(worker_id=wid, epoch=epoch, seq=seq, hashes=list(hashes))


def test_events_in_order_build_the_index() -> None:
    ix = PrefixIndex()
    assert not ix.apply(stored(1, 10, 11, 12), 0.0)
    assert not ix.apply(stored(1, 10, 11, wid="p1"), 0.0)
    assert not ix.apply(removed(2, 12), 0.0)
    assert ix.blocks_of("p0") == {10, 11} and ix.blocks_of("p1") == {10, 11}
    assert (ix.num_blocks, ix.num_entries) == (2, 4)
    assert not ix.apply(stored(2, 10, 11), 0.0)  # a repeat of an applied seq changes nothing
    assert ix.seq_of("p0") == ("e1", 2) and ix.blocks_of("p0") == {10, 11}


def test_overlap_counts_each_workers_leading_blocks() -> None:
    ix = PrefixIndex()
    ix.apply(stored(1, 1, 2, 3, 4), 0.0)
    ix.apply(stored(1, 1, 2, wid="p1"), 0.0)
    ix.apply(stored(1, 9, 3, wid="d0"), 0.0)  # holds block 3 but not the prefix before it
    assert ix.overlap([1, 2, 3, 4, 5]) == {"p0": 4, "p1": 2}
    assert ix.overlap([1, 2]) == {"p0": 2, "p1": 2}
    assert ix.overlap([7, 1, 2]) == {}
    assert ix.overlap([]) == {}


def test_a_gap_asks_for_a_snapshot_then_replays_what_came_after_it() -> None:
    ix = PrefixIndex()
    ix.apply(stored(1, 1, 2), 0.0)
    assert ix.apply(stored(3, 5), 0.0)  # seq 2 (say: removed 2, stored 4) was lost
    assert ix.needs_snapshot("p0")
    assert ix.apply(removed(4, 1), 0.0)  # buffered while resyncing; still wants the snapshot
    assert ix.blocks_of("p0") == {1, 2}  # stale until the snapshot, not emptied
    assert not ix.load_snapshot(snapshot(3, 1, 4, 5), 0.0)  # the worker's truth as of seq 3
    assert ix.blocks_of("p0") == {4, 5}  # ... plus the buffered seq 4 replayed on top
    assert ix.seq_of("p0") == ("e1", 4) and not ix.needs_snapshot("p0")
    assert not ix.apply(stored(5, 6), 0.0)
    assert ix.blocks_of("p0") == {4, 5, 6}


def test_a_gap_inside_the_replay_resyncs_again() -> None:
    ix = PrefixIndex()
    ix.apply(stored(1, 1), 0.0)
    ix.apply(stored(3, 3), 0.0)
    ix.apply(stored(6, 6), 0.0)
    assert ix.load_snapshot(snapshot(3, 1, 2, 3), 0.0)  # 4 and 5 are still missing
    assert ix.needs_snapshot("p0") and ix.blocks_of("p0") == {1, 2, 3}
    assert not ix.load_snapshot(snapshot(5, 1, 2, 3, 5), 0.0)
    assert ix.blocks_of("p0") == {1, 2, 3, 5, 6} and ix.seq_of("p0") == ("e1", 6)


def test_a_snapshot_older_than_the_applied_events_is_ignored() -> None:
    ix = PrefixIndex()
    for seq, h in [(1, 1), (2, 2), (3, 3)]:
        ix.apply(stored(seq, h), 0.0)
    assert not ix.load_snapshot(snapshot(2, 1, 2), 0.0)
    assert ix.blocks_of("p0") == {1, 2, 3} and ix.seq_of("p0") == ("e1", 3)


def test_an_unknown_worker_is_indexed_from_a_snapshot_or_from_its_first_event() -> None:
    ix = PrefixIndex()
    assert ix.needs_snapshot("p0")
    assert ix.apply(stored(7, 70), 0.0)  # joined late (a broker restart): events before 7 are unknown
    assert not ix.load_snapshot(snapshot(6, 1, 2), 0.0)
    assert ix.blocks_of("p0") == {1, 2, 70}
    assert not ix.load_snapshot(snapshot(0, wid="p1"), 0.0)  # empty cache, no event yet
    assert not ix.needs_snapshot("p1") and ix.blocks_of("p1") == set()


def test_a_restarted_worker_starts_over_with_its_new_epoch() -> None:
    ix = PrefixIndex()
    ix.apply(stored(1, 1, 2), 0.0)
    ix.apply(stored(2, 3), 0.0)
    assert not ix.apply(stored(1, 9, epoch="e2"), 0.0)  # a new process: old blocks are gone
    assert ix.blocks_of("p0") == {9} and ix.seq_of("p0") == ("e2", 1)
    assert ix.apply(stored(4, 8, epoch="e3"), 0.0)  # another restart, and its first events were lost
    assert ix.blocks_of("p0") == set() and ix.needs_snapshot("p0")


def test_dead_and_departed_workers_leave_the_index() -> None:
    ix = PrefixIndex(dead_after_intervals=3.0)
    ix.apply(stored(1, 1, 2), 0.0)
    ix.apply(stored(1, 1, wid="p1"), 0.0)
    ix.heard("p0", 0.0, interval_s=0.25)  # p0 dies after 0.75 s of silence
    ix.heard("p1", 0.0, interval_s=1.0)
    assert ix.expire(0.7) == []
    ix.heard("p1", 0.7, interval_s=1.0)
    assert ix.expire(0.8) == ["p0"]
    assert ix.overlap([1, 2]) == {"p1": 1} and ix.num_blocks == 1
    assert ix.drop_worker("p1") == 1 and ix.num_blocks == 0 and ix.workers() == []
    ix.heard("p9", 1.0)  # heard but never indexed: nothing to expire, it still wants a snapshot
    assert ix.expire(100.0) == [] and ix.needs_snapshot("p9")


def test_buffer_is_bounded() -> None:
    ix = PrefixIndex(max_buffered=2)
    ix.apply(stored(1, 1), 0.0)
    for seq in (3, 4, 5):
        ix.apply(stored(seq, seq), 0.0)
    assert ix.load_snapshot(snapshot(2, 1, 2), 0.0)  # 3 was dropped from the buffer: a gap again
    assert not ix.load_snapshot(snapshot(3, 1, 2, 3), 0.0)
    assert ix.blocks_of("p0") == {1, 2, 3, 4, 5}


def test_bad_settings_are_clear_errors() -> None:
    with pytest.raises(ValueError, match="dead_after_intervals"):
        PrefixIndex(dead_after_intervals=0)
    with pytest.raises(ValueError, match="max_buffered"):
        PrefixIndex(max_buffered=0)
