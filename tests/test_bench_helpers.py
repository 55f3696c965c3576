"""The benchmark's helpers that run without a GPU."""

import pytest

from bench.timing import timed_calls


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


def test_sustained_ms_reports_the_settled_second_half(monkeypatch):
    """Calls run back to back for the given time and only the second half of them counts: a card settles at its
    power limit within the first calls, so slow early calls must not move the figure. A fake clock makes it exact:
    40 calls of 20 ms then 20 of 10 ms fill 1 s; the median of all 60 would be 20 ms, of the last 30 it is 10 ms."""
    import types

    from bench import timing

    clock = {"now": 0.0, "calls": 0}

    def step():
        clock["calls"] += 1
        clock["now"] += 0.020 if clock["calls"] <= 40 else 0.010

    monkeypatch.setattr(timing, "time", types.SimpleNamespace(perf_counter=lambda: clock["now"]))
    assert timing.sustained_ms(step, "cpu", seconds=1.0) == pytest.approx(10.0)
    assert clock["calls"] == 60
