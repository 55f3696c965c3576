"""The Qwen-Image-2.1 Fun ControlNet Union on the pack's prefill and replayed decode step.

    load_fun_controlnet(path)          the released file (ComfyUI's native layout), checked key by key
    ControlSpec(net, encode, ...)      a ControlNet applied to a model: images, strength, start/end sigmas
    spec.for_branch(...)               a prefix branch's control, for `DecodeEngine.prefill(..., control=...)`

docs/controlnet.md says what runs where; `stream.py` how the control stream rides on the prefill and decode step.
"""

from .file import load_fun_controlnet
from .model import CONTROL_CHANNELS, FunControlNet
from .spec import ControlSpec, flow_percent_to_sigma
from .stream import BlockResiduals, ControlledPrefix

__all__ = ["CONTROL_CHANNELS", "BlockResiduals", "ControlSpec", "ControlledPrefix", "FunControlNet",
           "flow_percent_to_sigma", "load_fun_controlnet"]
