"""Token-budget grouping shared by the teacher and the trainer."""
from hypothesis import given
from hypothesis import strategies as st

from kdcache.common.batching import budget_groups


def groups(lengths, **kw):
    return [list(g) for g in budget_groups(lengths, lambda n: n, **kw)]


def test_budget_and_count_caps():
    assert groups([3, 3, 3, 3], max_tokens=9) == [[3, 3, 3], [3]]
    assert groups([2, 5, 2], max_tokens=10) == [[2, 5], [2]]            # padded: 5 x 3 = 15 > 10
    assert groups([1, 1, 1, 1, 1], max_items=2) == [[1, 1], [1, 1], [1]]
    assert groups([50, 1], max_tokens=10) == [[50], [1]]                  # too long alone: its own group
    assert groups([], max_tokens=10) == []


@given(st.lists(st.integers(1, 40), max_size=60), st.integers(0, 120), st.integers(0, 7))
def test_groups_keep_order_and_respect_the_budget(lengths, max_tokens, max_items):
    out = groups(lengths, max_tokens=max_tokens, max_items=max_items)
    assert [n for g in out for n in g] == lengths                          # nothing lost, duplicated or reordered
    for g in out:
        assert g
        if max_items:
            assert len(g) <= max_items
        if max_tokens and len(g) > 1:
            assert max(g) * len(g) <= max_tokens
