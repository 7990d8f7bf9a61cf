import pytest
from hypothesis import given
from hypothesis import settings
from hypothesis import strategies as st

from megatron_dapo.data import PromptIterator

N = 7


def _drain(it, sizes):
    return [it.next_batch(n) for n in sizes]


def test_each_epoch_is_a_permutation_and_epochs_differ():
    it = PromptIterator(list(range(N)), seed=3)
    epochs = [it.next_batch(N) for _ in range(4)]
    for e in epochs:
        assert sorted(e) == list(range(N))
    assert len({tuple(e) for e in epochs}) > 1
    assert it.state_dict()["epoch"] == 4 and it.state_dict()["position"] == 0


def test_wraps_epochs_and_large_batches():
    it = PromptIterator(list(range(N)), seed=1)
    ref = PromptIterator(list(range(N)), seed=1)
    stream = [x for _ in range(3) for x in ref.next_batch(N)]
    assert it.next_batch(5) + it.next_batch(5) + it.next_batch(11) == stream
    assert it.state_dict()["epoch"] == 3


def test_seed_determinism_and_no_shuffle():
    a = _drain(PromptIterator(list(range(N)), seed=5), [3, 4, 6])
    b = _drain(PromptIterator(list(range(N)), seed=5), [3, 4, 6])
    c = _drain(PromptIterator(list(range(N)), seed=6), [3, 4, 6])
    assert a == b and a != c
    it = PromptIterator(list("abcde"), shuffle=False)
    assert it.next_batch(3) == ["a", "b", "c"] and it.next_batch(4) == ["d", "e", "a", "b"]


@settings(max_examples=40, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 2 * N + 1), min_size=1, max_size=8),
    cut=st.integers(0, 8),
    seed=st.integers(0, 2**31),
)
def test_save_restore_continues_exactly(sizes, cut, seed):
    cut = min(cut, len(sizes))
    full = PromptIterator(list(range(N)), seed=seed)
    expected = _drain(full, sizes)
    first = PromptIterator(list(range(N)), seed=seed)
    got = _drain(first, sizes[:cut])
    state = first.state_dict()
    resumed = PromptIterator(list(range(N)), seed=seed)
    resumed.load_state_dict(dict(state))
    got += _drain(resumed, sizes[cut:])
    assert got == expected
    assert resumed.state_dict() == full.state_dict()


def test_load_state_dict_rejects_mismatch():
    it = PromptIterator(list(range(N)), seed=0)
    it.next_batch(3)
    state = it.state_dict()
    assert state == {"epoch": 0, "position": 3, "seed": 0, "shuffle": True, "num_examples": N}
    with pytest.raises(ValueError, match="num_examples=7"):
        PromptIterator(list(range(N + 1)), seed=0).load_state_dict(state)
    with pytest.raises(ValueError, match="seed=0"):
        PromptIterator(list(range(N)), seed=1).load_state_dict(state)
    with pytest.raises(ValueError, match="out of range"):
        PromptIterator(list(range(N)), seed=0).load_state_dict({"epoch": 0, "position": N})
    with pytest.raises(ValueError, match="missing keys"):
        it.load_state_dict({"epoch": 1})
    with pytest.raises(ValueError, match="positive"):
        it.next_batch(0)
    with pytest.raises(ValueError, match="at least one"):
        PromptIterator([])


def test_peek_and_skip_walk_the_same_order_as_next_batch():
    from megatron_dapo.data import PromptIterator

    a = PromptIterator(list(range(7)), seed=3)
    b = PromptIterator(list(range(7)), seed=3)
    expected = a.next_batch(17)  # crosses two epoch boundaries
    assert [b.peek(i) for i in range(17)] == expected
    b.skip(5)
    b.skip(12)
    assert b.state_dict() == a.state_dict() and b.next_batch(3) == a.next_batch(3)
