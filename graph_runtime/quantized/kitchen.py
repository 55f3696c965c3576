"""comfy-kitchen, ComfyUI's kernel library, imported when an INT8 ConvRot layer first needs it and checked against the
version that layer needs.

The pack never upgrades the comfy-kitchen a ComfyUI pins (0.33.0 pins 0.2.31): it requires the oldest release whose
int8 layers it runs (`INT8_LAYERS`), and a feature that needs a newer one says so when it is used, naming both
versions, instead of failing on a missing attribute. The versions were found by running the pack's int8 tests
against each release from PyPI (docs/quantized.md).
"""

from __future__ import annotations

import functools

from ..errors import DependencyError

PACKAGE = "comfy-kitchen"
# TensorWiseINT8Layout with ConvRot (quantize / dequantize) and the `comfy_kitchen::int8_linear` custom op.
INT8_LAYERS = "0.2.11"
# `TensorWiseINT8Layout.dequantize_embedding`: an int8 embedding table (the text encoder's, kept int8).
INT8_EMBEDDING = "0.2.23"


@functools.lru_cache(maxsize=None)
def installed_version() -> str | None:
    """The installed comfy-kitchen's version, or None when it is not installed."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(PACKAGE)
    except PackageNotFoundError:
        return None


@functools.lru_cache(maxsize=None)
def _older(installed: str, minimum: str) -> bool:
    from packaging.version import InvalidVersion, Version

    try:
        return Version(installed) < Version(minimum)
    except InvalidVersion:  # a local build with an odd version string: let it try
        return False


def require(feature: str, minimum: str = INT8_LAYERS, workaround: str | None = None):
    """The `comfy_kitchen` module, or DependencyError naming `feature`, the version it needs and the one installed."""
    installed = installed_version()
    if installed is not None and not _older(installed, minimum):
        import comfy_kitchen

        return comfy_kitchen
    have = f"comfy-kitchen {installed} is installed" if installed else "comfy-kitchen is not installed"
    message = (f"{feature} needs {PACKAGE} >= {minimum} (ComfyUI's kernel library), and {have}. KV-Graph does not "
               f"upgrade the version your ComfyUI pins: update it only if your ComfyUI allows "
               f"(pip install '{PACKAGE}>={minimum}')")
    if workaround:
        message += f", or {workaround}"
    raise DependencyError(message + ".")


def int8_layout(feature: str = "An INT8 ConvRot layer", minimum: str = INT8_LAYERS, workaround: str | None = None):
    """comfy-kitchen's `TensorWiseINT8Layout` (checked as `require` does); importing it registers the int8 ops."""
    require(feature, minimum, workaround)
    from comfy_kitchen.tensor import TensorWiseINT8Layout

    return TensorWiseINT8Layout
