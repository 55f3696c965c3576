"""One lock per VAE module: diffusers' `AutoencoderKLQwenImage21` keeps per-call state on the module itself (its causal
convolution cache `_feat_map` and the cursor `_conv_idx`, reset at the start of every encode and decode), so two
threads encoding or decoding with one VAE corrupt each other's cache. ComfyUI's route handlers run on another thread
than its prompt worker, and some ComfyUI forks run prompts concurrently, so every runtime encode/decode holds this.

The locks live in a weak dictionary keyed on the module, not on the module itself: an attribute holding a lock would
make the module impossible to deep-copy or pickle.
"""

from __future__ import annotations

import threading
import weakref

_locks: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_locks_guard = threading.Lock()


def vae_lock(vae) -> threading.RLock:
    """The lock serializing `vae`'s encode and decode calls (re-entrant, so a helper may call another)."""
    with _locks_guard:
        lock = _locks.get(vae)
        if lock is None:
            lock = _locks[vae] = threading.RLock()
        return lock
