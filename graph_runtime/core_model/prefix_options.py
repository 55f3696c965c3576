"""The prefix placement of a core sampling run, read from the MODEL's `transformer_options`.

ComfyUI's own Qwen-Image-2.1 cache node (0.37 and later) sets `transformer_options["qwen_image21_cache"]` to
`{"device": auto | gpu | cpu | off, "dtype": default | int8 | int4}` on the MODEL it returns; a KV-Graph MODEL
reads the same setting, so that node places the prefix of KSampler and the other core samplers too. Its choices map
onto the placements (decode/prefix_store.py): off -> recompute, cpu -> host, int8 or int4 -> int8, else gpu.
"""

from __future__ import annotations

from ..decode.prefix_store import GPU, HOST, INT8, RECOMPUTE
from ..errors import InputError

CORE_CACHE_OPTION = "qwen_image21_cache"
_DEVICES = ("auto", "gpu", "cpu", "off")
_DTYPES = ("default", "int8", "int4")


def placement_from_options(transformer_options: dict) -> tuple[str, str | None]:
    """`(placement, note)`: where a run keeps its prefixes, and what of the setting it could not follow (None when
    all of it). Without the setting: gpu (a core run has no budget of its own to choose by)."""
    setting = transformer_options.get(CORE_CACHE_OPTION)
    if setting is None:
        return GPU, None
    if not isinstance(setting, dict):
        raise InputError("model (Qwen Image 2.1 Cache)", repr(setting)[:80], "a {'device', 'dtype'} setting")
    device, dtype = setting.get("device", "auto"), setting.get("dtype", "default")
    if device not in _DEVICES:
        raise InputError("Qwen Image 2.1 Cache device", device, "one of " + ", ".join(_DEVICES))
    if dtype not in _DTYPES:
        raise InputError("Qwen Image 2.1 Cache dtype", dtype, "one of " + ", ".join(_DTYPES))
    if device == "off":
        return RECOMPUTE, None
    if device == "cpu":
        note = None if dtype == "default" else f"a host prefix is kept in the model's dtype, not {dtype}"
        return HOST, note
    if dtype != "default":
        return INT8, "int4 is kept as int8 (the one quantized placement)" if dtype == "int4" else None
    return GPU, None
