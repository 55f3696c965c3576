"""A minimal stand-in for `comfy_api.latest.io`: the classes the pack uses, with the constructor parameters that
both ComfyUI 0.8.0 and current upstream accept (an argument outside that set is a TypeError here, as it would be in
one of them), storing what they are given so tests can inspect schemas. No behaviour beyond that."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum


class Input:
    io_type = None

    def __init__(self, id, display_name=None, optional=False, tooltip=None, lazy=None, extra_dict=None,
                 raw_link=None):
        self.id, self.display_name, self.optional, self.tooltip = id, display_name, optional, tooltip
        self.lazy, self.extra_dict, self.raw_link = lazy, extra_dict, raw_link


class WidgetInput(Input):
    def __init__(self, id, display_name=None, optional=False, tooltip=None, lazy=None, default=None, socketless=None,
                 widget_type=None, force_input=None, extra_dict=None, raw_link=None):
        super().__init__(id, display_name, optional, tooltip, lazy, extra_dict, raw_link)
        self.default, self.socketless, self.widget_type, self.force_input = default, socketless, widget_type, force_input


class Output:
    io_type = None

    def __init__(self, id=None, display_name=None, tooltip=None, is_output_list=False):
        self.id, self.display_name, self.tooltip, self.is_output_list = id, display_name, tooltip, is_output_list


def _socket_type(io_type: str):
    return type(io_type, (), {"io_type": io_type,
                              "Input": type("Input", (Input,), {"io_type": io_type}),
                              "Output": type("Output", (Output,), {"io_type": io_type})})


def Custom(io_type: str):
    return _socket_type(io_type)


Image = _socket_type("IMAGE")
Latent = _socket_type("LATENT")
Conditioning = _socket_type("CONDITIONING")
Mask = _socket_type("MASK")
AnyType = _socket_type("*")
Model = _socket_type("MODEL")
Sigmas = _socket_type("SIGMAS")


class MatchType:
    """An input whose type the output copies (the frontend retypes the output to whatever is connected)."""

    io_type = "COMFY_MATCHTYPE_V3"

    class Template:
        def __init__(self, template_id, allowed_types=AnyType):
            self.template_id, self.allowed_types = template_id, allowed_types

    class Input(Input):
        io_type = "COMFY_MATCHTYPE_V3"

        def __init__(self, id, template, display_name=None, optional=False, tooltip=None, lazy=None, extra_dict=None,
                     raw_link=None):
            super().__init__(id, display_name, optional, tooltip, lazy, extra_dict, raw_link)
            self.template = template

    class Output(Output):
        io_type = "COMFY_MATCHTYPE_V3"

        def __init__(self, template, id=None, display_name=None, tooltip=None, is_output_list=False):
            super().__init__(id, display_name, tooltip, is_output_list)
            self.template = template


class Autogrow:
    """Inputs that grow as they are connected: the node gets `{name: value}` of the connected ones (ComfyUI passes
    them nested under the Autogrow input's id)."""

    io_type = "COMFY_AUTOGROW_V3"

    class TemplateNames:
        def __init__(self, input, names, min=1):
            self.input, self.names, self.min = input, list(names), min

    class TemplatePrefix:
        def __init__(self, input, prefix, min=1, max=10):
            self.input, self.prefix, self.min, self.max = input, prefix, min, max
            self.names = [f"{prefix}{i}" for i in range(max)]

    class Input(Input):
        io_type = "COMFY_AUTOGROW_V3"

        def __init__(self, id, template, display_name=None, optional=False, tooltip=None, lazy=None,
                     extra_dict=None):
            super().__init__(id, display_name, optional, tooltip, lazy, extra_dict)
            self.template = template


class Boolean:
    io_type = "BOOLEAN"

    class Input(WidgetInput):
        io_type = "BOOLEAN"

        def __init__(self, id, display_name=None, optional=False, tooltip=None, lazy=None, default=None,
                     label_on=None, label_off=None, socketless=None, force_input=None, extra_dict=None,
                     raw_link=None):
            super().__init__(id, display_name, optional, tooltip, lazy, default, socketless, None, force_input,
                             extra_dict, raw_link)
            self.label_on, self.label_off = label_on, label_off

    Output = type("Output", (Output,), {"io_type": "BOOLEAN"})


class Int:
    io_type = "INT"

    class Input(WidgetInput):
        io_type = "INT"

        def __init__(self, id, display_name=None, optional=False, tooltip=None, lazy=None, default=None, min=None,
                     max=None, step=None, control_after_generate=None, display_mode=None, socketless=None,
                     force_input=None, extra_dict=None, raw_link=None):
            super().__init__(id, display_name, optional, tooltip, lazy, default, socketless, None, force_input,
                             extra_dict, raw_link)
            self.min, self.max, self.step = min, max, step
            self.control_after_generate, self.display_mode = control_after_generate, display_mode

    Output = type("Output", (Output,), {"io_type": "INT"})


class Float:
    io_type = "FLOAT"

    class Input(WidgetInput):
        io_type = "FLOAT"

        def __init__(self, id, display_name=None, optional=False, tooltip=None, lazy=None, default=None, min=None,
                     max=None, step=None, round=None, display_mode=None, socketless=None, force_input=None,
                     extra_dict=None, raw_link=None):
            super().__init__(id, display_name, optional, tooltip, lazy, default, socketless, None, force_input,
                             extra_dict, raw_link)
            self.min, self.max, self.step, self.round, self.display_mode = min, max, step, round, display_mode

    Output = type("Output", (Output,), {"io_type": "FLOAT"})


class String:
    io_type = "STRING"

    class Input(WidgetInput):
        io_type = "STRING"

        def __init__(self, id, display_name=None, optional=False, tooltip=None, lazy=None, multiline=False,
                     placeholder=None, default=None, dynamic_prompts=None, socketless=None, force_input=None,
                     extra_dict=None, raw_link=None):
            super().__init__(id, display_name, optional, tooltip, lazy, default, socketless, None, force_input,
                             extra_dict, raw_link)
            self.multiline, self.placeholder, self.dynamic_prompts = multiline, placeholder, dynamic_prompts

    Output = type("Output", (Output,), {"io_type": "STRING"})


class Combo:
    io_type = "COMBO"

    class Input(WidgetInput):
        io_type = "COMBO"

        def __init__(self, id, options=None, display_name=None, optional=False, tooltip=None, lazy=None,
                     default=None, control_after_generate=None, upload=None, image_folder=None, remote=None,
                     socketless=None, extra_dict=None, raw_link=None):
            super().__init__(id, display_name, optional, tooltip, lazy, default, socketless, None, None, extra_dict,
                             raw_link)
            self.options, self.control_after_generate = options, control_after_generate
            self.upload, self.image_folder, self.remote = upload, image_folder, remote

    Output = type("Output", (Output,), {"io_type": "COMBO"})


class Hidden(str, Enum):
    """The hidden inputs a node may ask for; ComfyUI hands their values to `execute` as `cls.hidden.<name>`."""

    unique_id = "UNIQUE_ID"
    prompt = "PROMPT"
    extra_pnginfo = "EXTRA_PNGINFO"
    dynprompt = "DYNPROMPT"


WIDGET_TYPES = ("BOOLEAN", "INT", "FLOAT", "STRING", "COMBO")


@dataclass
class Schema:
    node_id: str
    display_name: str = None
    category: str = "sd"
    inputs: list = field(default_factory=list)
    outputs: list = field(default_factory=list)
    hidden: list = field(default_factory=list)
    description: str = ""
    is_input_list: bool = False
    is_output_node: bool = False
    is_deprecated: bool = False
    is_experimental: bool = False
    is_api_node: bool = False
    not_idempotent: bool = False
    enable_expand: bool = False


class ComfyNode:
    hidden = None  # the hidden inputs' values while a node runs (ComfyUI's HiddenHolder)

    @classmethod
    def define_schema(cls) -> Schema:
        raise NotImplementedError

    @classmethod
    def execute(cls, **kwargs):
        raise NotImplementedError

    @classmethod
    def fingerprint_inputs(cls, **kwargs):
        raise NotImplementedError

    @classmethod
    def validate_inputs(cls, **kwargs):
        raise NotImplementedError


class NodeOutput:
    def __init__(self, *args, ui=None, expand=None, block_execution=None):
        self.args, self.ui, self.expand, self.block_execution = args, ui, expand, block_execution

    @property
    def result(self):
        return self.args if self.args else None

    def __getitem__(self, index):
        return self.args[index]
