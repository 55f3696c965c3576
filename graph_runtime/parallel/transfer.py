"""What rank 0 hands the other ranks: the loaded transformer (read from disk once, by rank 0) and each request.

The model goes as a pickled skeleton whose tensor storages are left out (each pickled as its index, dtype and size)
and then one broadcast per storage over the compute group: NCCL from GPU to GPU, or gloo on CPUs. Whatever the
module tree holds (converted FP8 or INT8 layers, tied weights, buffers) arrives as it is, with its storages shared
as they were. A request is small (prompt embeddings, reference latents): pickled with its storages' bytes inline.

Rank 0 imports the pack under ComfyUI's name for it (`<folder>.graph_runtime`); the workers import the same files
as the top-level `graph_runtime` (the pack's folder is on their path), so class references are renamed on the way.
"""

from __future__ import annotations

import io
import pickle

import torch

# This copy of the runtime's name: "graph_runtime", or "<pack>.graph_runtime" inside ComfyUI.
PACKAGE = __name__.rsplit(".parallel.", 1)[0]


class _Pickler(pickle.Pickler):
    """Storages are kept out of the pickle: listed in `storages` (shared ones once), or with `inline` their bytes
    go into it."""

    def __init__(self, file, inline: bool):
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.inline = inline
        self.storages: list[torch.UntypedStorage] = []
        self._index: dict[int, int] = {}

    def persistent_id(self, obj):
        if isinstance(obj, torch.storage.TypedStorage):
            untyped, dtype = obj._untyped_storage, obj.dtype
        elif isinstance(obj, torch.UntypedStorage):
            untyped, dtype = obj, torch.uint8
        else:
            return None
        index = self._index.get(untyped._cdata)
        if index is None:
            index = self._index[untyped._cdata] = len(self.storages)
            self.storages.append(untyped)
        dtype_name = str(dtype).removeprefix("torch.")
        if self.inline:
            return ("bytes", index, dtype_name, _storage_bytes(untyped), untyped.device.type)
        return ("storage", index, dtype_name, untyped.nbytes(), untyped.device.type)


class _Unpickler(pickle.Unpickler):
    def __init__(self, file, device: torch.device, package: str):
        super().__init__(file)
        self.device, self.package = torch.device(device), package
        self.storages: dict[int, torch.UntypedStorage] = {}

    def find_class(self, module: str, name: str):
        if module == self.package or module.startswith(self.package + "."):
            module = PACKAGE + module[len(self.package):]
        return super().find_class(module, name)

    def persistent_load(self, pid):
        kind, index, dtype_name, data, device_type = pid
        storage = self.storages.get(index)
        if storage is None:
            # What rank 0 keeps on its accelerator goes to this rank's; what it keeps in host memory stays there.
            device = torch.device("cpu") if device_type == "cpu" else self.device
            if kind == "bytes":
                storage = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0,
                                                                                                  dtype=torch.uint8)
                storage = storage.to(device).untyped_storage()
            else:
                storage = torch.UntypedStorage(data, device=device)
            self.storages[index] = storage
        return torch.storage.TypedStorage(wrap_storage=storage, dtype=getattr(torch, dtype_name), _internal=True)


def _storage_bytes(storage: torch.UntypedStorage) -> bytes:
    if storage.nbytes() == 0:
        return b""
    return _as_bytes_tensor(storage).cpu().numpy().tobytes()


def _as_bytes_tensor(storage: torch.UntypedStorage) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage, 0, (storage.nbytes(),), (1,))


def dumps(obj) -> bytes:
    """`obj` with its tensors' bytes, for another rank (`loads`)."""
    buffer = io.BytesIO()
    pickle.dump(PACKAGE, buffer)
    _Pickler(buffer, inline=True).dump(obj)
    return buffer.getvalue()


def loads(data: bytes, device) -> object:
    """What `dumps` made, its tensors on `device`."""
    buffer = io.BytesIO(data)
    package = pickle.load(buffer)
    return _Unpickler(buffer, device, package).load()


def model_skeleton(model: torch.nn.Module) -> tuple[bytes, list[torch.UntypedStorage]]:
    """The pickled module without its storages, and the storages in the order `receive_model` expects them."""
    buffer = io.BytesIO()
    pickle.dump(PACKAGE, buffer)
    pickler = _Pickler(buffer, inline=False)
    pickler.dump(model)
    return buffer.getvalue(), pickler.storages


def broadcast_storages(storages, comm, device) -> int:
    """Rank 0 sends (other ranks receive into) `storages` in order over `comm`; returns the bytes moved. A storage
    held elsewhere than the group's device (a CPU copy with NCCL) is staged through it."""
    moved = 0
    device = torch.device(device)
    for storage in storages:
        if storage.nbytes() == 0:
            continue
        tensor = _as_bytes_tensor(storage)
        staged = tensor if tensor.device == device else tensor.to(device)
        comm.broadcast(staged, 0)
        if staged is not tensor:
            tensor.copy_(staged)
        moved += storage.nbytes()
    return moved


def receive_model(skeleton: bytes, device) -> tuple[torch.nn.Module, list[torch.UntypedStorage]]:
    """Rebuild the module from its skeleton with empty storages on `device`; they are filled by
    `broadcast_storages` next (in the skeleton's order)."""
    buffer = io.BytesIO(skeleton)
    package = pickle.load(buffer)
    unpickler = _Unpickler(buffer, device, package)
    model = unpickler.load()
    storages = [unpickler.storages[i] for i in sorted(unpickler.storages)]
    return model, storages


def weights_version(loaded) -> tuple:
    """Changes whenever the loaded model's weights change values after load (a LoRA merged, switched or restored in
    place)."""
    state = loaded.lora_state(create=False)
    return (None, 0) if state is None else (id(state), state.merges)
