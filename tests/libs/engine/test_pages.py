import pytest

from libs.engine.pages import OutOfPagesError, PageAllocator


def test_alloc_and_free_round_trip():
    a = PageAllocator(8)
    pages = a.alloc(5)
    assert len(set(pages)) == 5 and a.num_free == 3 and a.num_used == 5
    assert a.free(pages) == 5
    assert a.num_free == 8


def test_out_of_pages_is_a_clear_error_and_changes_nothing():
    a = PageAllocator(4)
    a.alloc(3)
    with pytest.raises(OutOfPagesError, match="asked for 2, 1 free of 4"):
        a.alloc(2)
    assert a.num_free == 1


def test_shared_pages_free_on_last_reference():
    a = PageAllocator(4)
    pages = a.alloc(2)
    a.incref(pages[:1])
    assert a.refcount(pages[0]) == 2
    assert a.free(pages) == 1  # pages[1] released, pages[0] still held once
    assert a.num_free == 3
    assert a.free(pages[:1]) == 1
    assert a.num_free == 4


def test_misuse_raises():
    a = PageAllocator(4)
    (p,) = a.alloc(1)
    a.free([p])
    with pytest.raises(ValueError, match="freed more often"):
        a.free([p])
    with pytest.raises(ValueError, match="is free"):
        a.incref([p])
    with pytest.raises(ValueError, match="outside the pool"):
        a.free([9])
    with pytest.raises(ValueError):
        PageAllocator(0)
