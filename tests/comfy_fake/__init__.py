"""The few ComfyUI pieces the node pack touches, faked for CI (which has no ComfyUI), plus loading the pack the way
ComfyUI does. The real thing is exercised by tests/e2e against an actual ComfyUI server.

Installed into `sys.modules` only for as long as a test fixture holds them:
    comfy_api.latest (io, ComfyExtension), folder_paths, comfy.model_management, comfy.model_patcher, comfy.utils,
    comfy.cli_args, comfy.text_encoders, comfy_execution.utils, server, aiohttp.web (only if aiohttp is missing),
    and the core sampling stack the pack's MODEL is built on (comfy.model_base and friends: core.py).
Each fake mirrors the real contract the pack relies on (e.g. load_models_gpu moves the model through the patcher's
`partially_load`, as ComfyUI's LoadedModel.model_load does, and lists it in `current_loaded_models`; every progress
update is an interrupt check, as the hook ComfyUI's main.py installs is; `get_free_memory` reports `free_memory` when
a test sets it; `weight_budget` makes load_models_gpu ask for a partial load, as ComfyUI's lowvram figure does).
"""

from __future__ import annotations

import copy
import enum
import importlib.util
import os
import shutil
import sys
import tempfile
import types
import uuid
from collections import namedtuple
from pathlib import Path

import torch

from . import core as fake_core
from . import io as fake_io

PACK_ROOT = Path(__file__).resolve().parents[2]
# Decided once, before any fake is installed (a fake aiohttp in sys.modules has no import spec).
HAVE_AIOHTTP = importlib.util.find_spec("aiohttp") is not None


class InterruptProcessingException(Exception):
    pass


class ModelPatcher:
    """The ModelPatcher surface used by the pack: construction, sizes, a full load via patch_model, detach."""

    def __init__(self, model, load_device, offload_device, size=0, weight_inplace_update=False):
        self.model, self.load_device, self.offload_device, self.size = model, load_device, offload_device, size
        self.patches, self.model_options, self.parent = {}, {"transformer_options": {}}, None
        self.weight_inplace_update = weight_inplace_update
        self.patches_uuid = uuid.uuid4()
        self.attachments, self.wrappers, self.object_patches = {}, {}, {}
        if not hasattr(model, "device"):
            model.device = offload_device
        for name, value in (("model_loaded_weight_memory", 0), ("lowvram_patch_counter", 0),
                            ("model_lowvram", False), ("current_weight_patches_uuid", None)):
            if not hasattr(model, name):
                setattr(model, name, value)
        self.calls = []

    def clone(self):
        """ComfyUI's clone: a new patcher over the same model, with copies of its patches, options, attachments and
        wrappers (instance attributes the patcher's class does not copy are not carried)."""
        n = self.__class__(self.model, self.load_device, self.offload_device, self.model_size(),
                           weight_inplace_update=self.weight_inplace_update)
        n.patches = {k: list(v) for k, v in self.patches.items()}
        n.patches_uuid, n.parent = self.patches_uuid, self
        n.model_options = copy.deepcopy(self.model_options)
        n.attachments = dict(self.attachments)
        n.wrappers = {k: {kk: list(vv) for kk, vv in v.items()} for k, v in self.wrappers.items()}
        n.object_patches = dict(self.object_patches)
        return n

    def is_clone(self, other):
        return getattr(other, "model", None) is self.model

    def add_wrapper_with_key(self, wrapper_type, key, wrapper):
        self.wrappers.setdefault(wrapper_type, {}).setdefault(key, []).append(wrapper)

    def add_patches(self, patches, strength_patch=1.0, strength_model=1.0):
        self.patches_uuid = uuid.uuid4()
        for key, patch in patches.items():
            self.patches.setdefault(key, []).append((strength_patch, patch, strength_model))
        return list(patches)

    def model_size(self):
        if self.size > 0:
            return self.size
        self.size = sum(t.nbytes for t in self.model.state_dict().values())
        return self.size

    def loaded_size(self):
        return self.model.model_loaded_weight_memory

    def patch_model(self, device_to=None, lowvram_model_memory=0, load_weights=True, force_patch_weights=False):
        self.calls.append(("patch_model", device_to, lowvram_model_memory))
        if load_weights:
            self.model.to(device_to)
            self.model.device = device_to
            self.model.model_loaded_weight_memory = self.model_size()
            self.model.current_weight_patches_uuid = self.patches_uuid
        return self.model

    def partially_load(self, device_to, extra_memory=0, force_patch_weights=False):
        self.patch_model(device_to)
        return self.model_size()

    def partially_unload(self, device_to, memory_to_free=0, force_patch_weights=False):
        return 0

    def detach(self, unpatch_all=True):
        self.calls.append(("detach", unpatch_all))
        if unpatch_all:
            self.model.to(self.offload_device)
            self.model.device = self.offload_device
            self.model.model_loaded_weight_memory = 0
        return self.model


class FakeComfy:
    """Holds the fake modules and the knobs tests turn (device, interrupt, preview method, folders)."""

    def __init__(self, models_dir: Path, tokenizer_parent: Path, device: str = "cpu", real_comfy: Path | None = None):
        self.real_comfy = Path(real_comfy) if real_comfy else None  # a ComfyUI checkout: use its real `comfy`
        self.models_dir = Path(models_dir)
        self.tokenizer_parent = Path(tokenizer_parent)
        self.device = torch.device(device)
        self.interrupted = False
        self.progress = []  # (value, total, preview) per ProgressBar update
        self.sent = []  # (event, data) per send_sync
        self.recipients = []  # the sid of each send_sync, in the same order (None: every connected browser)
        self.load_calls = []  # kwargs of each load_models_gpu call
        self.free_calls = []  # (memory_required, device) of each free_memory call
        self.free_memory = None  # what get_free_memory reports (bytes); None: the device's own figure
        # Bytes load_models_gpu lets each model hold on its device when not forced to load it whole (ComfyUI's
        # lowvram figure); None: no limit (ComfyUI's 1e32).
        self.weight_budget = None
        self.context = None  # ExecutionContext the node runs under
        self.interrupt_at_step = None
        self.routes = {}
        # ComfyUI's input folder (folder_paths.get_input_directory): empty, as on a fresh install; removed on uninstall.
        self.input_dir = Path(tempfile.mkdtemp(prefix="kvgraph-input-"))
        # ComfyUI's output folder; get_save_image_path names files in it from `save_counter` on, and records its calls.
        self.output_dir = Path(tempfile.mkdtemp(prefix="kvgraph-output-"))
        self.save_counter = 1
        self.save_path_calls = []  # (filename_prefix, output_dir, width, height) per get_save_image_path call
        self.modules = self._build()
        self._saved = {}

    # -- modules -----------------------------------------------------------------------------------------------

    def _build(self) -> dict:
        fake = self
        m = {}

        api = types.ModuleType("comfy_api")
        latest = types.ModuleType("comfy_api.latest")

        class ComfyExtension:
            async def on_load(self):
                return None

            async def get_node_list(self):
                raise NotImplementedError

        latest.io, latest.ComfyExtension = fake_io, ComfyExtension
        api.latest = latest
        m["comfy_api"], m["comfy_api.latest"] = api, latest

        fp = types.ModuleType("folder_paths")
        fp.get_folder_paths = lambda folder: [str(self.models_dir / folder)]

        def get_filename_list(folder):
            root = self.models_dir / folder
            return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()) if root.is_dir() else []

        def get_full_path(folder, name):
            path = self.models_dir / folder / name
            return str(path) if path.is_file() else None

        fp.get_filename_list, fp.get_full_path = get_filename_list, get_full_path
        fp.get_input_directory = lambda: str(self.input_dir)
        fp.get_output_directory = lambda: str(self.output_dir)

        def get_save_image_path(filename_prefix, output_dir, image_width=0, image_height=0):
            # ComfyUI's contract, without its %date% formatting or its scan of existing files for the counter.
            self.save_path_calls.append((filename_prefix, output_dir, image_width, image_height))
            subfolder, filename = os.path.split(os.path.normpath(filename_prefix))
            folder = os.path.join(output_dir, subfolder)
            os.makedirs(folder, exist_ok=True)
            return folder, filename, self.save_counter, subfolder, filename_prefix

        fp.get_save_image_path = get_save_image_path
        m["folder_paths"] = fp

        comfy = types.ModuleType("comfy")
        comfy.__path__ = []
        mm = types.ModuleType("comfy.model_management")
        mm.InterruptProcessingException = InterruptProcessingException
        mm.get_torch_device = lambda: fake.device
        mm.unet_offload_device = mm.text_encoder_offload_device = mm.vae_offload_device = lambda: torch.device("cpu")
        mm.text_encoder_device = mm.vae_device = lambda: fake.device
        mm.intermediate_device = lambda: torch.device("cpu")
        mm.soft_empty_cache = lambda force=False: None

        class LoadedModel:  # the part of ComfyUI's LoadedModel that the pack reads
            def __init__(self, patcher):
                self.model, self.device = patcher, patcher.load_device

            def model_loaded_memory(self):
                return self.model.loaded_size()

        mm.current_loaded_models = []

        def load_models_gpu(models, memory_required=0, force_patch_weights=False, minimum_memory_required=None,
                            force_full_load=False):
            fake.load_calls.append({"models": list(models), "memory_required": memory_required,
                                    "force_full_load": force_full_load})
            for patcher in models:  # ComfyUI's LoadedModel.model_load -> partially_load(device, extra_memory)
                # What the model may add beyond what it holds: 1e32 for "all", as ComfyUI passes it.
                extra = 1e32
                if fake.weight_budget is not None and not force_full_load:
                    extra = fake.weight_budget - patcher.loaded_size()
                patcher.partially_load(patcher.load_device, extra, force_patch_weights=force_patch_weights)
                if all(m.model is not patcher for m in mm.current_loaded_models):
                    mm.current_loaded_models.insert(0, LoadedModel(patcher))

        def get_free_memory(dev=None, torch_free_too=False):
            dev = torch.device(dev) if dev is not None else fake.device
            if fake.free_memory is not None:
                free = fake.free_memory
            elif dev.type == "cuda":  # as ComfyUI counts it: the driver's free memory + the allocator's unused cache
                free = (torch.cuda.mem_get_info(dev)[0] + torch.cuda.memory_reserved(dev)
                        - torch.cuda.memory_allocated(dev))
            else:
                free = 1 << 40
            return (free, free) if torch_free_too else free

        def processing_interrupted():
            return fake.interrupted

        def throw_exception_if_processing_interrupted():
            if fake.interrupted:
                fake.interrupted = False
                raise InterruptProcessingException()

        def loaded_models(only_currently_used=False):
            # ComfyUI's: the patchers loaded, optionally only those the running prompt uses (all of them here).
            return [m.model for m in mm.current_loaded_models]

        def free_memory(memory_required, device, keep_loaded=()):
            fake.free_calls.append((memory_required, torch.device(device)))

        mm.load_models_gpu = load_models_gpu
        mm.free_memory = free_memory
        mm.loaded_models = loaded_models
        mm.get_free_memory = get_free_memory
        mm.processing_interrupted = processing_interrupted
        mm.throw_exception_if_processing_interrupted = throw_exception_if_processing_interrupted

        mp = types.ModuleType("comfy.model_patcher")
        mp.ModelPatcher = ModelPatcher

        utils = types.ModuleType("comfy.utils")

        class ProgressBar:
            def __init__(self, total, node_id=None):
                self.total, self.current = total, 0

            def update_absolute(self, value, total=None, preview=None):
                if total is not None:
                    self.total = total
                self.current = min(value, self.total)
                fake.progress.append((self.current, self.total, preview))
                if fake.interrupt_at_step is not None and value >= fake.interrupt_at_step:
                    fake.interrupted = True
                throw_exception_if_processing_interrupted()  # ComfyUI's progress hook checks on every update

        utils.ProgressBar = ProgressBar

        cli = types.ModuleType("comfy.cli_args")

        class LatentPreviewMethod(enum.Enum):
            NoPreviews = "none"
            Auto = "auto"
            Latent2RGB = "latent2rgb"
            TAESD = "taesd"

        cli.LatentPreviewMethod = LatentPreviewMethod
        cli.args = types.SimpleNamespace(preview_method=LatentPreviewMethod.NoPreviews, preview_size=512,
                                         disable_metadata=False)

        te = types.ModuleType("comfy.text_encoders")
        te.__path__ = [str(self.tokenizer_parent)]  # a namespace package in ComfyUI: no __file__

        comfy.model_management, comfy.model_patcher, comfy.utils = mm, mp, utils
        comfy.cli_args, comfy.text_encoders = cli, te
        if self.real_comfy is None:
            m.update({"comfy": comfy, "comfy.model_management": mm, "comfy.model_patcher": mp, "comfy.utils": utils,
                      "comfy.cli_args": cli, "comfy.text_encoders": te})
            for name, module in fake_core.modules().items():  # the core sampling stack the MODEL is built on
                m[name] = module
                setattr(comfy, name.split(".")[1], module)

        ex = types.ModuleType("comfy_execution")
        ex_utils = types.ModuleType("comfy_execution.utils")
        ex_utils.ExecutionContext = namedtuple("ExecutionContext", "prompt_id node_id list_index")
        ex_utils.get_executing_context = lambda: fake.context
        ex.utils = ex_utils
        m["comfy_execution"], m["comfy_execution.utils"] = ex, ex_utils

        server = types.ModuleType("server")

        class Routes:
            def _add(self, method, path):
                def decorator(handler):
                    fake.routes[(method, path)] = handler
                    return handler
                return decorator

            def get(self, path):
                return self._add("GET", path)

            def post(self, path):
                return self._add("POST", path)

        class PromptServer:
            instance = None

            def __init__(self):
                self.routes = Routes()

            client_id = "fake-client"  # set by ComfyUI's executor to the client that queued the running prompt

            def send_sync(self, event, data, sid=None):
                fake.sent.append((event, data))
                fake.recipients.append(sid)

        PromptServer.instance = PromptServer()
        server.PromptServer = PromptServer
        m["server"] = server

        if not HAVE_AIOHTTP:
            aiohttp = types.ModuleType("aiohttp")
            web = types.ModuleType("aiohttp.web")
            Response = namedtuple("Response", "data status")
            web.json_response = lambda data, status=200: Response(data, status)
            aiohttp.web = web
            m["aiohttp"], m["aiohttp.web"] = aiohttp, web
        return m

    # -- lifecycle ---------------------------------------------------------------------------------------------

    def install(self) -> "FakeComfy":
        if self.real_comfy is not None:
            # ComfyUI's own model management, patcher, progress bar and bundled tokenizer; the rest stays fake.
            sys.path.insert(0, str(self.real_comfy))
            import comfy.model_management  # noqa: F401
            import comfy.model_patcher  # noqa: F401
        for name, module in self.modules.items():
            self._saved[name] = sys.modules.get(name)
            sys.modules[name] = module
        return self

    def uninstall(self) -> None:
        for name, previous in self._saved.items():
            if previous is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = previous
        self._saved.clear()
        shutil.rmtree(self.input_dir, ignore_errors=True)
        shutil.rmtree(self.output_dir, ignore_errors=True)

    def set_context(self, prompt_id="prompt-1", node_id="5"):
        self.context = self.modules["comfy_execution.utils"].ExecutionContext(prompt_id, node_id, None)

    @property
    def cli_args(self):
        return sys.modules["comfy.cli_args"] if self.real_comfy else self.modules["comfy.cli_args"]

    def events(self, phase=None) -> list[dict]:
        return [d for e, d in self.sent if e == "kvgraph.status" and (phase is None or d["phase"] == phase)]


def load_pack(name: str | None = None, root: Path = PACK_ROOT):
    """Import the pack the way ComfyUI's load_custom_node does: a spec for its __init__.py under an arbitrary module
    name, with the folder as the package's search location. `root` may be a link to the repository under another
    folder name, as under custom_nodes."""
    name = name or f"kvgraph_pack_{uuid.uuid4().hex[:8]}"
    spec = importlib.util.spec_from_file_location(name, Path(root) / "__init__.py",
                                                  submodule_search_locations=[str(root)])
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def unload_pack(module) -> None:
    prefix = module.__name__
    for name in [n for n in sys.modules if n == prefix or n.startswith(prefix + ".")]:
        del sys.modules[name]


def write_tokenizer(parent: Path) -> Path:
    """The tiny Qwen tokenizer in the layout ComfyUI bundles (comfy/text_encoders/qwen25_tokenizer)."""
    from graph_runtime.tiny import build_tokenizer

    folder = Path(parent) / "qwen25_tokenizer"
    build_tokenizer().save_pretrained(str(folder))
    return folder

