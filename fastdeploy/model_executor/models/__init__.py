"""Model registry: architecture name (config.json ``architectures``) → class."""

from fastdeploy.model_executor.models.llama import LlamaForCausalLM

MODEL_REGISTRY = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
}

__all__ = ["MODEL_REGISTRY", "LlamaForCausalLM"]
