"""Model registry: architecture name (config.json ``architectures``) → class."""

from fastdeploy.model_executor.models.ernie4_5_moe import Ernie4_5_MoeForCausalLM
from fastdeploy.model_executor.models.llama import LlamaForCausalLM
from fastdeploy.model_executor.models.qwen2_vl import Qwen2VLForConditionalGeneration
from fastdeploy.model_executor.models.qwen_moe import Qwen2MoeForCausalLM, Qwen3MoeForCausalLM

MODEL_REGISTRY = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
    "Ernie4_5ForCausalLM": LlamaForCausalLM,
    "Ernie4_5_MoeForCausalLM": Ernie4_5_MoeForCausalLM,
    "Qwen2MoeForCausalLM": Qwen2MoeForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "Qwen2VLForConditionalGeneration": Qwen2VLForConditionalGeneration,
    "Qwen2_5_VLForConditionalGeneration": Qwen2VLForConditionalGeneration,
}

__all__ = [
    "MODEL_REGISTRY",
    "Ernie4_5_MoeForCausalLM",
    "LlamaForCausalLM",
    "Qwen2MoeForCausalLM",
    "Qwen3MoeForCausalLM",
    "Qwen2VLForConditionalGeneration",
]
