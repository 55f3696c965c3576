"""The benchmark's reading of nvidia-smi samples: clock, power and what held the clock down."""

from bench.clocks import clock_limit, limit_reasons, parse_sample


def test_limit_reasons_decode_the_driver_bits():
    """0x4 is the software power cap, 0x20 software thermal slowdown; idle (0x1) is not a limit."""
    assert limit_reasons(0x4) == ["power cap"]
    assert limit_reasons(0x24) == ["power cap", "thermal (software)"]
    assert limit_reasons(0x1) == []


def test_clock_limit_keeps_reasons_active_in_half_the_samples():
    assert clock_limit([0x4, 0x4, 0x0, 0x24]) == "power cap"
    assert clock_limit([0x0, 0x1, 0x0]) == "none"
    assert clock_limit([]) is None


def test_parse_sample_reads_clock_power_and_mask():
    assert parse_sample("1530, 689.41, 0x0000000000000004") == (1530.0, 689.41, 4)
    assert parse_sample("1980, 120.0") == (1980.0, 120.0, None)
    assert parse_sample("clocks.sm [MHz], power.draw [W]") is None
    assert parse_sample("[N/A], 100") is None


def test_reason_field_falls_back_to_the_older_name_and_is_asked_once(monkeypatch):
    """A driver that only knows "clocks_throttle_reasons" gets that field; the probe runs once per card."""
    import subprocess

    from bench import clocks

    calls = []

    def fake_run(cmd, **kwargs):
        calls.append(cmd)
        field = cmd[3].split("=", 1)[1]
        known = field == "clocks_throttle_reasons.active"
        return subprocess.CompletedProcess(cmd, 0 if known else 2, "0x0000000000000004\n" if known else "", "")

    monkeypatch.setattr(clocks.subprocess, "run", fake_run)
    clocks._reason_field.cache_clear()
    try:
        assert clocks._reason_field(7) == "clocks_throttle_reasons.active"
        assert clocks._reason_field(7) == "clocks_throttle_reasons.active"
        assert len(calls) == 2 and all(call[2] == "7" for call in calls)
    finally:
        clocks._reason_field.cache_clear()
