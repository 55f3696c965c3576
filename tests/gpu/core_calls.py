"""What core's samplers hand the model function in the GPU tests."""


def core_call_inputs(cuda_models, steps: int):
    """What core's samplers hand the model function on the GPU: a conditioning entry read as the prefix reads it
    ("a red cube"), the dynamic schedule of `steps` steps for a 12x16 latent, and seeded noise of that latent."""
    from graph_runtime.comfy_interop.conditioning import prompt_to_conditioning
    from graph_runtime.core_model import PrefixSource
    from graph_runtime.encoding.prompt import PromptEncoder
    from graph_runtime.sampling.schedule import schedule_for
    from tests.test_core_model import comfy_noise

    embeds = PromptEncoder(cuda_models.text_encoder.float(), cuda_models.processor).encode("a red cube")
    (cond, extras), = prompt_to_conditioning(embeds)
    _, sigmas = schedule_for("dynamic", steps, 12 * 16, cuda_models.scheduler_config)
    return PrefixSource.from_conditioning(cond, extras), sigmas.cuda(), comfy_noise(3, (1, 64, 12, 16)).cuda()
