"""Rank 0's commands to the other ranks and their answers, through the rendezvous store (torch.distributed's
TCPStore): a command is one key per sequence number, an answer one key per rank. Waiting on the store, unlike a
collective, can last as long as ComfyUI sits idle between prompts, and it never mixes with the groups' collectives,
so a rank stuck in one is seen (its answer does not come) rather than answered crosswise."""

from __future__ import annotations

import pickle
import time

POLL_S = 0.2


class StoreTimeout(RuntimeError):
    """An answer did not come in time."""


class Control:
    def __init__(self, store, rank: int, world: int):
        self.store, self.rank, self.world = store, rank, world

    # Rank 0 ------------------------------------------------------------------------------------------------------

    def post(self, seq: int, kind: str, payload: bytes = b"") -> None:
        self.store.set(f"cmd/{seq}", pickle.dumps((kind, payload)))

    def answers(self, seq: int, timeout_s: float, health=None) -> dict[int, dict]:
        """Every worker's answer to command `seq`, waiting up to `timeout_s`; `health()` runs between polls (it
        raises when a worker is gone, so a dead one is not waited for)."""
        keys = [f"answer/{seq}/{rank}" for rank in range(1, self.world)]
        deadline = time.monotonic() + timeout_s
        while not self.store.check(keys):
            if health is not None:
                health()
            if time.monotonic() > deadline:
                missing = [rank for rank, key in enumerate(keys, 1) if not self.store.check([key])]
                raise StoreTimeout(f"rank(s) {', '.join(map(str, missing))} did not answer within {timeout_s:.0f} s")
            time.sleep(POLL_S)
        answers = {rank: pickle.loads(self.store.get(key)) for rank, key in enumerate(keys, 1)}
        for key in keys:
            self.store.delete_key(key)
        self.store.delete_key(f"cmd/{seq}")
        return answers

    def failures(self) -> dict[int, str]:
        """What workers reported before exiting (`report_failure`)."""
        found = {}
        for rank in range(1, self.world):
            key = f"failure/{rank}"
            if self.store.check([key]):
                found[rank] = self.store.get(key).decode("utf-8", "replace")
        return found

    # Other ranks ---------------------------------------------------------------------------------------------------

    def next_command(self, seq: int, keep_waiting) -> tuple[str, bytes]:
        """Command `seq`, polled (quickly after the last one, then backing off to `POLL_S`) as long as
        `keep_waiting()` says. Polled, not waited on: a store wait that times out logs a warning each time."""
        key = f"cmd/{seq}"
        delay, checked = 0.002, time.monotonic()
        while not self.store.check([key]):
            time.sleep(delay)
            delay = min(POLL_S, delay * 1.5)
            if time.monotonic() - checked > 1.0:
                if not keep_waiting():
                    raise SystemExit(0)
                checked = time.monotonic()
        return pickle.loads(self.store.get(key))

    def answer(self, seq: int, **answer) -> None:
        self.store.set(f"answer/{seq}/{self.rank}", pickle.dumps(answer))

    def report_failure(self, text: str) -> None:
        self.store.set(f"failure/{self.rank}", text.encode("utf-8", "replace")[:4000])
