"""FastDeploy: an LLM inference serving engine with an OpenAI-compatible API."""

__version__ = "0.1.0"

from fastdeploy.platforms.backend import activate_from_env  # noqa: E402

activate_from_env()  # FD_BACKEND=paddle: `import torch` gives Paddle from here on, in every process

from fastdeploy.core.outputs import CompletionOutput, RequestOutput  # noqa: E402
from fastdeploy.core.sampling_params import SamplingParams  # noqa: E402


def __getattr__(name: str):
    # LLM pulls in torch and the model code; load it only when asked for.
    if name == "LLM":
        from fastdeploy.entrypoints.llm import LLM

        return LLM
    raise AttributeError(name)


__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "__version__"]
