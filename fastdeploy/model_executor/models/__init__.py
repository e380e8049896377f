"""Model registry: architecture name (config.json ``architectures``) → class."""

from fastdeploy.model_executor.models.llama import LlamaForCausalLM
from fastdeploy.model_executor.models.qwen2_vl import Qwen2VLForConditionalGeneration

MODEL_REGISTRY = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
    "Qwen2VLForConditionalGeneration": Qwen2VLForConditionalGeneration,
    "Qwen2_5_VLForConditionalGeneration": Qwen2VLForConditionalGeneration,
}

__all__ = ["MODEL_REGISTRY", "LlamaForCausalLM", "Qwen2VLForConditionalGeneration"]
