"""``text.tokens.common_prefix_length``: the shared prefix of two token lists."""

from hypothesis import given
from hypothesis import strategies as st

from triforce.text.tokens import common_prefix_length


def test_common_prefix_length_of_known_cases():
    assert common_prefix_length([], []) == 0
    assert common_prefix_length([], [1, 2]) == 0 and common_prefix_length([1, 2], []) == 0
    assert common_prefix_length([5, 6, 7], [5, 6, 7]) == 3  # equal lists
    assert common_prefix_length([5, 6], [5, 6, 7, 8]) == 2 and common_prefix_length([5, 6, 7, 8], [5, 6]) == 2
    assert common_prefix_length([1, 2, 3], [9, 2, 3]) == 0  # differ at the first token
    assert common_prefix_length([1, 2, 3, 4], [1, 2, 0, 4]) == 2  # equal again after a difference: not counted
    assert common_prefix_length((1, 2), [1, 2, 3]) == 2  # any sequences


@given(st.lists(st.integers(0, 3)), st.lists(st.integers(0, 3)))
def test_common_prefix_length_is_the_longest_shared_prefix(a, b):
    n = common_prefix_length(a, b)
    assert 0 <= n <= min(len(a), len(b)) and a[:n] == b[:n]
    assert n == min(len(a), len(b)) or a[n] != b[n]
    assert common_prefix_length(b, a) == n
