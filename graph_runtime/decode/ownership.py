"""Which live request owns each graph entry.

Two requests writing one entry's static buffers would overwrite each other's prefix mid-generation, so an entry
serves one request at a time: the first live request to use a key owns it. The owner is tracked by a weak
reference to the request's `OwnerToken` (held by its prefix cache), so the entry frees itself when the request's
cache is released or collected: nothing has to remember to hand it back.
"""

from __future__ import annotations

import weakref


class EntryOwners:
    """Owner per graph key. Not locked itself: callers hold the graph manager's lock around their use."""

    def __init__(self):
        self._refs: dict[object, weakref.ReferenceType] = {}

    def alive(self, key) -> bool:
        """Whether a request that is still alive owns `key`."""
        ref = self._refs.get(key)
        return ref is not None and ref() is not None

    def owned_by_other(self, key, token) -> bool:
        """Whether a live request other than `token`'s owns `key` (such a request must not touch the entry)."""
        ref = self._refs.get(key)
        owner = ref() if ref is not None else None
        return owner is not None and owner is not token

    def claim(self, key, token) -> None:
        """Make `token`'s request the owner of `key` (the caller has checked `owned_by_other`)."""
        self._refs[key] = weakref.ref(token)

    def claim_if_free(self, key, token) -> bool:
        """Claim `key` for `token` when no live request owns it; True when ownership changed hands, so the entry's
        buffers may hold another request's prefix."""
        if self.alive(key):
            return False
        self.claim(key, token)
        return True

    def forget(self, key) -> None:
        """The entry for `key` is gone: so is its owner record."""
        self._refs.pop(key, None)
