"""Stand-ins for the parts of ComfyUI's core sampling stack the pack's MODEL is built on: `comfy.model_base`
(BaseModel, ModelType), `comfy.model_sampling` (flow matching: ModelSamplingFlux + CONST), `comfy.latent_formats`,
`comfy.conds` (CONDConstant), `comfy.patcher_extension` (wrappers) and `comfy.supported_models_base` (BASE).

Each mirrors what ComfyUI 0.8.0 and 0.33.0 do for the calls the pack makes (same names, signatures and formulas);
the real ones run in tests/test_core_sampling_comfyui.py (a real ComfyUI's `comfy` package) and tests/e2e.
"""

from __future__ import annotations

import enum
import math
import types

import torch

# -- comfy.patcher_extension -----------------------------------------------------------------------------------------


class WrappersMP:
    OUTER_SAMPLE = "outer_sample"
    APPLY_MODEL = "apply_model"
    DIFFUSION_MODEL = "diffusion_model"


class WrapperExecutor:
    """Calls the wrappers in order, then the original (`executor.class_obj` is the object the method belongs to)."""

    def __init__(self, original, class_obj, wrappers, idx=0):
        self.original, self.class_obj, self.wrappers, self.idx = original, class_obj, list(wrappers), idx

    @classmethod
    def new_class_executor(cls, original, class_obj, wrappers, idx=0):
        return cls(original, class_obj, wrappers, idx)

    def __call__(self, *args, **kwargs):
        return WrapperExecutor(self.original, self.class_obj, self.wrappers, self.idx + 1).execute(*args, **kwargs)

    def execute(self, *args, **kwargs):
        if self.idx == len(self.wrappers):
            return self.original(*args, **kwargs)
        return self.wrappers[self.idx](self, *args, **kwargs)


def get_all_wrappers(wrapper_type, transformer_options, is_model_options=False):
    if is_model_options:
        transformer_options = transformer_options.get("transformer_options", {})
    return [w for ws in transformer_options.get("wrappers", {}).get(wrapper_type, {}).values() for w in ws]


# -- comfy.latent_formats, comfy.conds ------------------------------------------------------------------------------


class LatentFormat:
    scale_factor = 1.0
    latent_channels = 4
    latent_dimensions = 2
    latent_rgb_factors = None
    latent_rgb_factors_bias = None
    taesd_decoder_name = None

    def process_in(self, latent):
        return latent * self.scale_factor

    def process_out(self, latent):
        return latent / self.scale_factor


class CONDConstant:
    def __init__(self, cond):
        self.cond = cond

    def process_cond(self, batch_size, **kwargs):
        return CONDConstant(self.cond)

    def can_concat(self, other):
        return self.cond == other.cond

    def concat(self, others):
        return self.cond

    def size(self):
        return [1]


# -- comfy.model_sampling -------------------------------------------------------------------------------------------


def _reshape_sigma(sigma, ndim):
    return sigma.reshape(sigma.shape[:1] + (1,) * (ndim - 1)) if isinstance(sigma, torch.Tensor) else sigma


class CONST:
    def calculate_input(self, sigma, noise):
        return noise

    def calculate_denoised(self, sigma, model_output, model_input):
        return model_input - model_output * _reshape_sigma(sigma, model_output.ndim)

    def noise_scaling(self, sigma, noise, latent_image, max_denoise=False):
        sigma = _reshape_sigma(sigma, noise.ndim)
        return sigma * noise + (1.0 - sigma) * latent_image


class ModelSamplingFlux(torch.nn.Module):
    def __init__(self, model_config=None):
        super().__init__()
        settings = model_config.sampling_settings if model_config is not None else {}
        self.shift = settings.get("shift", 1.15)
        t = torch.arange(1, 10001) / 10000
        self.register_buffer("sigmas", self.sigma(t))

    @property
    def sigma_max(self):
        return self.sigmas[-1]

    def timestep(self, sigma):
        return sigma

    def sigma(self, t):
        return math.exp(self.shift) / (math.exp(self.shift) + (1 / t - 1) ** 1.0)

    def percent_to_sigma(self, percent):
        if percent <= 0.0:
            return 1.0
        if percent >= 1.0:
            return 0.0
        return self.sigma(1.0 - percent)


# -- comfy.supported_models_base, comfy.model_base -----------------------------------------------------------------


class BASE:
    unet_config = {}
    unet_extra_config = {"num_heads": -1, "num_head_channels": 64}
    sampling_settings = {}
    latent_format = LatentFormat
    memory_usage_factor = 2.0
    manual_cast_dtype = None
    supported_inference_dtypes = [torch.float16, torch.bfloat16, torch.float32]

    def __init__(self, unet_config):
        self.unet_config = dict(unet_config)
        self.sampling_settings = dict(self.sampling_settings)
        self.latent_format = self.latent_format()
        for key, value in self.unet_extra_config.items():
            self.unet_config[key] = value

    def set_inference_dtype(self, dtype, manual_cast_dtype):
        self.unet_config["dtype"] = dtype
        self.manual_cast_dtype = manual_cast_dtype


class ModelType(enum.Enum):
    EPS = 1
    FLOW = 6
    FLUX = 8


class BaseModel(torch.nn.Module):
    def __init__(self, model_config, model_type=ModelType.EPS, device=None):
        super().__init__()
        if not model_config.unet_config.get("disable_unet_model_creation", False):
            raise NotImplementedError("the fake builds no network of its own")
        if model_type not in (ModelType.FLOW, ModelType.FLUX):
            raise NotImplementedError("the fake knows flow-matching (FLOW, FLUX) models only")
        self.latent_format = model_config.latent_format
        self.model_config = model_config
        self.manual_cast_dtype = model_config.manual_cast_dtype
        self.device = device
        self.current_patcher = None
        self.model_type = model_type
        # core's FLOW sampling (a linear shift) is not faked: a model of that type must set its own
        self.model_sampling = type("ModelSampling", (ModelSamplingFlux, CONST), {})(model_config) \
            if model_type == ModelType.FLUX else None

    def apply_model(self, x, t, c_concat=None, c_crossattn=None, control=None, transformer_options={}, **kwargs):
        return WrapperExecutor.new_class_executor(
            self._apply_model, self, get_all_wrappers(WrappersMP.APPLY_MODEL, transformer_options),
        ).execute(x, t, c_concat, c_crossattn, control, transformer_options, **kwargs)

    def process_latent_in(self, latent):
        return self.latent_format.process_in(latent)

    def process_latent_out(self, latent):
        return self.latent_format.process_out(latent)


class WeightAdapterBase:
    """comfy.weight_adapter's base: `name` says the kind, `weights` holds its tensors, `loaded_keys` the file's keys."""

    name = "base"

    def __init__(self, loaded_keys, weights):
        self.loaded_keys, self.weights = loaded_keys, weights


class LoRAAdapter(WeightAdapterBase):
    """A low-rank pair as core's `load_lora` makes it: weights (up, down, alpha, mid, dora_scale, reshape)."""

    name = "lora"


class LoHaAdapter(WeightAdapterBase):
    name = "loha"


def modules() -> dict:
    """{module name: module} for the fake's `sys.modules` entries."""
    made = {}
    for name, members in {
        "comfy.patcher_extension": (WrappersMP, WrapperExecutor, get_all_wrappers),
        "comfy.latent_formats": (LatentFormat,),
        "comfy.conds": (CONDConstant,),
        "comfy.model_sampling": (CONST, ModelSamplingFlux),
        "comfy.supported_models_base": (BASE,),
        "comfy.model_base": (BaseModel, ModelType),
        "comfy.weight_adapter": (WeightAdapterBase, LoRAAdapter, LoHaAdapter),
    }.items():
        module = types.ModuleType(name)
        for member in members:
            setattr(module, member.__name__, member)
        made[name] = module
    return made
