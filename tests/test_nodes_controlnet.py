"""KV-Graph Load / Apply ControlNet with the fake ComfyUI (CPU, tiny fp32 model, the tiny ControlNet `make-tiny`
writes): the KV-Graph Sampler with the ControlNet and core's Euler on the MODEL with it give the same latents (2e-5,
the fp32 round-off between the two samplers that tests/test_nodes_core_model.py states); strength 0 returns the model
unchanged; core's own Fun ControlNet patches (ComfyUI 0.38+'s apply node) on the MODEL run as the pack's node does
instead of being ignored."""

import sys
import types
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

from comfy_fake.fixtures import comfy_env  # noqa: E402,F401
from test_nodes_core_model import core_sample  # noqa: E402
from test_nodes_execute import encode, image, load_all, run, sampler  # noqa: E402

ATOL = 2e-5
FILE = "qwen_image_2.1_fun_controlnet_union.safetensors"


@pytest.fixture(scope="module")
def setup(comfy_env):
    from graph_runtime.controlnet.tiny import comfyui_controlnet_path, write_tiny_controlnet

    write_tiny_controlnet(comfyui_controlnet_path(comfy_env.models), dtype=torch.float32)
    transformer, text_encoder, vae = load_all(comfy_env)
    positive, _, latent = encode(comfy_env, text_encoder)
    net, = run(comfy_env, "KVGraphLoadControlNet", controlnet_name=FILE)
    return transformer, vae, positive, latent, net


def apply(env, model, net, vae, strength=1.0, **extra):
    inputs = dict(model=model, controlnet=net, vae=vae, strength=strength, start_percent=0.0, end_percent=1.0,
                  image=image(96, 128, seed=3))
    inputs.update(extra)
    return run(env, "KVGraphApplyControlNet", **inputs)[0]


def kv_sigmas(env, transformer, latent, steps=3):
    return run(env, "KVGraphSigmas", model=transformer.model, steps=steps, sigma_preset="dynamic", width=1024,
               height=1024, denoise=1.0, latent=latent)[0]


def _inpaint_inputs():
    mask = torch.zeros(1, 96, 128)
    mask[:, 32:80, 40:100] = 1.0  # paint this box anew
    return dict(image=None, inpaint_image=image(96, 128, seed=4), mask=mask)


@pytest.mark.parametrize("variant", ["control", "inpaint"])
def test_the_kvgraph_sampler_and_core_euler_agree_with_the_controlnet(comfy_env, setup, variant):
    """Both samplers, with a control image or with an inpaint image and mask: the same latents, and not the
    uncontrolled ones; the sampler's memory check counts the ControlNet."""
    transformer, vae, positive, latent, net = setup
    extra = _inpaint_inputs() if variant == "inpaint" else {}
    plain = sampler(comfy_env, transformer, positive, latent)["samples"]
    assert "ControlNet weights" not in transformer.last_budget["parts"]
    ours = sampler(comfy_env, apply(comfy_env, transformer, net, vae, **extra), positive, latent)["samples"]
    assert (ours - plain).abs().max().item() > 1e-2
    # The record is kept on the loader's handle.
    assert transformer.last_budget["parts"]["ControlNet weights"] > 0
    sigmas = kv_sigmas(comfy_env, transformer, latent)
    core = core_sample(comfy_env, apply(comfy_env, transformer.model, net, vae, **extra), positive, latent, sigmas, 7)
    assert (core - ours).abs().max().item() <= ATOL


def test_strength_zero_returns_the_model_and_bad_settings_are_refused(comfy_env, setup):
    from graph_runtime.errors import InputError

    transformer, vae, _, _, net = setup
    assert apply(comfy_env, transformer, net, vae, strength=0.0) is transformer
    assert apply(comfy_env, transformer.model, net, vae, strength=0.0) is transformer.model
    with pytest.raises(InputError, match="start_percent"):
        apply(comfy_env, transformer, net, vae, start_percent=0.8, end_percent=0.2)
    with pytest.raises(InputError, match="control image, an inpaint image or a mask"):
        apply(comfy_env, transformer, net, vae, image=None)
    with pytest.raises(InputError, match="one KV-Graph Apply ControlNet per model"):
        apply(comfy_env, apply(comfy_env, transformer, net, vae), net, vae)


class QwenImage21FunControlBlockPatch:
    """Stands in for ComfyUI 0.38's block patch class of the same name (its attributes as the apply node sets them)."""

    def __init__(self, control_patch):
        self.control_patch, self.previous = control_patch, None


def test_cores_fun_controlnet_patches_run_as_the_packs_node(comfy_env, setup):
    """The MODEL with core's Fun ControlNet block patches (what ComfyUI 0.38's apply node registers) gives the same
    latents as the MODEL with KV-Graph Apply ControlNet: the same net, images, strength and range."""
    from graph_runtime.controlnet.file import to_file_state_dict

    transformer, vae, positive, latent, net = setup
    control = image(96, 128, seed=3)
    ours = core_sample(comfy_env, apply(comfy_env, transformer.model, net, vae, start_percent=0.3), positive, latent,
                       kv_sigmas(comfy_env, transformer, latent), 7)

    class CoreNet(torch.nn.Module):  # core's module: the file's key layout
        def __init__(self):
            super().__init__()
            for key, value in to_file_state_dict(net).items():
                self.register_buffer(key.replace(".", "__"), value.clone())

        def state_dict(self, *args, **kwargs):
            return {k.replace("__", "."): v for k, v in self._buffers.items()}

    pack_apply = sys.modules[f"{comfy_env.pack.__name__}.nodes.controlnet"]
    core_vae = types.SimpleNamespace(  # core's VAE: IMAGE in, raw latents out
        encode=lambda pixels: pack_apply.encode_raw(vae, pack_apply.comfy_image_to_vae_pixels(pixels)))
    sampling = transformer.model.model.model_sampling
    state = types.SimpleNamespace(model_patch=types.SimpleNamespace(model=CoreNet()), vae=core_vae, image=control,
                                  inpaint_image=None, mask=None, strength=1.0,
                                  sigma_range=(sampling.percent_to_sigma(0.3), sampling.percent_to_sigma(1.0)))
    patched = transformer.model.clone()
    # Where core's set_model_patch_replace puts them.
    dit = patched.model_options.setdefault("transformer_options", {}).setdefault("patches_replace", {})
    dit["dit"] = {("single_block", i): QwenImage21FunControlBlockPatch(state) for i in (0, 1)}
    core = core_sample(comfy_env, patched, positive, latent, kv_sigmas(comfy_env, transformer, latent), 7)
    assert (core - ours).abs().max().item() <= ATOL


def test_python_block_patches_with_the_controlnet_are_refused_before_the_first_step(comfy_env, setup):
    """A MODEL with the ControlNet (acting from half-way) and a Python attention patch (run in an eager step over the
    blocks alone, without the control stream) stops the sampling call before any model call, naming both, rather
    than after the steps before the net's range; nothing of the run is left and the model samples on."""
    import copy

    from test_nodes_core_model import pack_module

    transformer, vae, positive, latent, net = setup
    controlled = apply(comfy_env, transformer.model, net, vae, start_percent=0.5)
    patched = controlled.clone()
    patched.model_options = copy.deepcopy(controlled.model_options)
    options = patched.model_options.setdefault("transformer_options", {})
    options.setdefault("patches", {})["attn1_patch"] = [lambda q, k, v, extra_options: (q, k, v)]
    sigmas = kv_sigmas(comfy_env, transformer, latent)
    calls = []
    with pytest.raises(Exception, match="Python block or attention patches together with a ControlNet") as caught:
        core_sample(comfy_env, patched, positive, latent, sigmas, 7, calls.append)
    assert type(caught.value).__name__ == "InputError" and calls == []
    assert pack_module(comfy_env, "graph_runtime.in_flight").runs() == [] and not transformer.loaded.busy
    core_sample(comfy_env, controlled, positive, latent, sigmas, 7)
