"""Python face of the custom ops.

Each op dispatches to the compiled ``fastdeploy_ops`` extension when it is built
and loaded for the tensors' device, and to the pure-torch implementation in
:mod:`fastdeploy.ops.torch_ops` otherwise. Signatures are identical.
"""

from fastdeploy.ops.cache_ops import reshape_and_cache_flash

__all__ = ["reshape_and_cache_flash"]
