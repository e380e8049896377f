"""The gaps of Paddle's torch-compat proxy (paddlepaddle 3.3.x) that the engine needs closed.

:func:`install` enables the proxy (``import torch`` then gives Paddle) and adds what the
engine uses but the proxy lacks or does differently. Each entry was found by running
the engine on Paddle, not assumed; docs/paddle.md lists them. Module attributes go in
the proxy's override table (the proxy rebuilds its ``torch`` modules whenever a blocked
library imports, so attributes set on them would be lost); tensor methods go on
``paddle.Tensor``.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Callable
from typing import Any

_TORCH_FREE_LIBRARIES = ("transformers",)
"""Libraries that must not see the proxy: transformers would take it for torch and fail to
import its configs (hub kernels, torch.distributed.tensor); the engine uses it only for
configs and tokenizers, which need no torch."""

_installed = False


def install() -> None:
    """Enable ``paddle.enable_compat()`` and close the proxy's gaps (idempotent)."""
    global _installed
    if _installed:
        return
    import paddle
    from paddle.compat import proxy

    paddle.enable_compat(blocked_modules=_TORCH_FREE_LIBRARIES)
    proxy.GLOBAL_OVERRIDES.update(
        {f"torch.{name}": proxy.RawOverriddenAttribute(value) for name, value in _module_attributes().items()}
    )
    # `torch.nn.functional` reached as an attribute (`from torch import nn; nn.functional.linear`) is
    # the raw paddle.nn.functional (Paddle's linear takes its weight transposed); give it the proxy
    # `import torch.nn.functional` gives, with the torch-semantics functions of paddle.compat
    proxy.GLOBAL_OVERRIDES["torch.nn.functional"] = proxy.RawOverriddenAttribute(
        _proxy_module(proxy, "torch.nn.functional")
    )
    for name, method in _tensor_methods().items():
        if not hasattr(paddle.Tensor, name):
            setattr(paddle.Tensor, name, method)
    for name, method in _torch_semantics_methods().items():
        setattr(paddle.Tensor, name, method)
    if not hasattr(paddle.float32, "itemsize"):  # torch.dtype.itemsize: bytes per element
        type(paddle.float32).itemsize = property(_itemsize)
    _import_gguf_reader_with_proxy()
    _installed = True


def _proxy_module(proxy: Any, torch_name: str) -> Any:
    """The proxy of ``torch_name`` with the overrides registered under it."""
    prefix = torch_name + "."
    overrides = {k.removeprefix(prefix): v for k, v in proxy.GLOBAL_OVERRIDES.items() if k.startswith(prefix)}
    source = importlib.import_module(torch_name.replace("torch", "paddle", 1))
    return proxy.ProxyModule(source, torch_name, overrides)


def _module_attributes() -> dict[str, Any]:
    """``torch.<name>`` → what it is under Paddle, for names the proxy lacks or gets wrong."""
    import paddle

    return {
        "inference_mode": _inference_mode,
        # the proxy's torch.device is the module paddle.device, not callable through the proxy
        "device": paddle.device.Device,
        "where": _where,
        "narrow": lambda input, dim, start, length: input.narrow(dim, start, length),
        "eye": _eye,
        "set_num_threads": _set_num_threads,
        "get_num_threads": _get_num_threads,
    }


def _tensor_methods() -> dict[str, Callable[..., Any]]:
    """``Tensor.<name>`` methods the engine calls that ``paddle.Tensor`` lacks (added)."""
    import paddle

    def index_copy_(self, dim: int, index, source):
        """torch's ``index_copy_``: ``self`` rows ``index`` along ``dim`` = ``source`` (in place)."""
        dim = dim % self.ndim
        if dim == 0:
            paddle.index_put_(self, (index,), source)
        else:  # rows along another dim: copy through a transposed view
            perm = [dim, *(d for d in range(self.ndim) if d != dim)]
            paddle.index_put_(self.transpose(perm), (index,), source.transpose(perm))
        return self

    return {"index_copy_": index_copy_}


def _torch_semantics_methods() -> dict[str, Callable[..., Any]]:
    """``Tensor.<name>`` methods whose Paddle meaning differs from torch's (replaced).

    Each replacement takes torch's signature and falls back to Paddle's own method when
    called Paddle-style (``axis=`` / ``num_or_sections=``), so Paddle's code keeps working.
    """
    import paddle
    import paddle.compat

    original_split = paddle.Tensor.split

    def split(self, split_size_or_sections=None, dim=0, **kwargs):
        if kwargs or split_size_or_sections is None:  # Paddle-style call
            return original_split(self, split_size_or_sections, **kwargs)
        return paddle.compat.split(self, split_size_or_sections, dim=dim)

    original_view = paddle.Tensor.view

    def view(self, *shape, **kwargs):
        if self.ndim == 0 and shape and not isinstance(shape[0], (paddle.dtype, str)):
            return self.reshape(list(shape[0]) if isinstance(shape[0], (list, tuple)) else list(shape))
        return original_view(self, *shape, **kwargs)  # Paddle cannot view a 0-d tensor

    def narrow(self, dim: int, start: int, length: int):
        """Paddle's narrow of a view drops the view's offset (it writes at the base's start); a
        basic slice is a view that keeps it."""
        dim = dim % self.ndim
        start = int(start) % self.shape[dim] if int(start) < 0 else int(start)
        return self[(slice(None),) * dim + (slice(start, start + int(length)),)]

    methods = {"split": split, "view": view, "narrow": narrow}
    for name in _INT_PROMOTING_OPERATORS:
        methods[name] = _promoting_ints(getattr(paddle.Tensor, name))
    return methods


_INT_PROMOTING_OPERATORS = (
    "__add__", "__radd__", "__sub__", "__rsub__", "__mul__", "__rmul__", "__floordiv__", "__mod__",
    "__lt__", "__le__", "__gt__", "__ge__", "__eq__", "__ne__", "__and__", "__or__", "__xor__",
)  # fmt: skip
"""Binary operators that, as in torch, promote int32 with int64 to int64 (Paddle refuses to mix them)."""


def _promoting_ints(operator: Callable[..., Any]) -> Callable[..., Any]:
    import paddle

    wide = {paddle.int32: 1, paddle.int64: 2, paddle.int16: 0, paddle.uint8: 0, paddle.int8: 0}

    def promoted(self, other):
        if (
            isinstance(other, paddle.Tensor)
            and self.dtype != other.dtype
            and self.dtype in wide
            and other.dtype in wide
        ):
            if wide[self.dtype] < wide[other.dtype]:
                self = self.astype(other.dtype)
            else:
                other = other.astype(self.dtype)
        return operator(self, other)

    promoted.__name__ = operator.__name__
    return promoted


def _inference_mode(mode: bool = True) -> Any:
    """``torch.inference_mode()`` (decorator or context manager): Paddle's ``no_grad``."""
    import paddle

    return paddle.no_grad() if mode else contextlib.nullcontext()


def _where(condition: Any, input: Any = None, other: Any = None, **kwargs: Any) -> Any:
    """``torch.where``: a Python scalar takes the dtype of the tensor beside it (Paddle makes an
    int64 or float32 tensor of it, then refuses to mix int32 with int64)."""
    import paddle

    if input is None and other is None:
        return paddle.nonzero(condition, as_tuple=True)
    if not isinstance(input, paddle.Tensor) and isinstance(other, paddle.Tensor):
        input = paddle.full_like(other, input)
    elif not isinstance(other, paddle.Tensor) and isinstance(input, paddle.Tensor):
        other = paddle.full_like(input, other)
    return paddle.where(condition, input, other, **kwargs)


def _eye(*args: Any, dtype: Any = None, **kwargs: Any) -> Any:
    """``torch.eye``: Paddle has no bool kernel of eye; build it as int32 and cast."""
    import paddle

    if dtype == paddle.bool:
        return paddle.eye(*args, dtype=paddle.int32, **kwargs).astype(paddle.bool)
    return paddle.eye(*args, dtype=dtype, **kwargs)


def _itemsize(dtype: Any) -> int:
    import paddle

    return paddle.empty([0], dtype=dtype).element_size()


_num_threads = 0


def _set_num_threads(n: int) -> None:
    """``torch.set_num_threads``: Paddle's CPU math threads."""
    import paddle

    global _num_threads
    paddle.base.core.set_num_threads(int(n))
    _num_threads = int(n)


def _get_num_threads() -> int:
    """``torch.get_num_threads``: the count last set here, else the CPU count."""
    import os

    return _num_threads or os.cpu_count() or 1


def _import_gguf_reader_with_proxy() -> None:
    """Import transformers' GGUF reader once with the proxy as its torch.

    It builds the tokenizer of a .gguf model (the default model) and imports torch at
    module level, for dtype constants only; blocked like the rest of transformers it
    would find no torch where none is installed. Its parent packages load blocked first.
    """
    from paddle.compat import proxy

    try:
        importlib.import_module("transformers.integrations.gguf")
    except ImportError:  # an older transformers without this module: nothing to do
        return
    proxy.TORCH_PROXY_BLOCKED_MODULES.difference_update(_TORCH_FREE_LIBRARIES)
    try:
        importlib.import_module("transformers.integrations.gguf.reader")
    finally:
        proxy.TORCH_PROXY_BLOCKED_MODULES.update(_TORCH_FREE_LIBRARIES)
    # its metadata-only path (return_tensors=False, all a tokenizer needs) asks for torch needlessly
    importlib.import_module("transformers.modeling_gguf_pytorch_utils").is_torch_available = lambda: True
