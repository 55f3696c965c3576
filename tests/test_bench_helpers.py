"""The benchmark's helpers that run without a GPU."""

import pytest

from graph_runtime.bench.timing import timed_calls


def test_timed_calls_records_each_call_and_restores_the_methods():
    """The benchmark's per-call host timer sees every call of the wrapped methods (raising ones too), passes
    results through, and leaves the instance using its class's method again."""
    class Counter:
        def __init__(self):
            self.n = 0

        def add(self, k):
            self.n += k
            return self.n

        def fail(self):
            raise ValueError("boom")

    c = Counter()
    with timed_calls((c, "add"), (c, "fail")) as times:
        assert c.add(2) == 2 and c.add(3) == 5
        with pytest.raises(ValueError):
            c.fail()
    assert len(times["add"]) == 2 and len(times["fail"]) == 1 and all(t >= 0 for t in times["add"])
    assert "add" not in vars(c) and "fail" not in vars(c)
    c.add(1)
    assert len(times["add"]) == 2
