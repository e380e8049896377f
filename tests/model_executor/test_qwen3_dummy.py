"""A Qwen3-shaped model with dummy weights through the whole engine, against ``transformers``' Qwen3."""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from fastdeploy import LLM, SamplingParams

NUM_STEPS = 32
CONFIG = dict(
    vocab_size=512,
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    max_position_embeddings=128,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
)


@pytest.fixture(scope="module")
def qwen3_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("qwen3-dummy")
    config = Qwen3Config(**CONFIG)
    config.architectures = ["Qwen3ForCausalLM"]
    config.save_pretrained(str(folder))
    return folder


def hf_state_dict(our_state: dict[str, torch.Tensor], config: Qwen3Config) -> dict[str, torch.Tensor]:
    """Split our fused qkv_proj / gate_up_proj back into Hugging Face's separate projections."""
    q_size = config.num_attention_heads * config.head_dim
    kv_size = config.num_key_value_heads * config.head_dim
    out = {}
    for name, tensor in our_state.items():
        if "qkv_proj" in name:
            q, k, v = tensor.split([q_size, kv_size, kv_size], dim=0)
            out[name.replace("qkv_proj", "q_proj")] = q
            out[name.replace("qkv_proj", "k_proj")] = k
            out[name.replace("qkv_proj", "v_proj")] = v
        elif "gate_up_proj" in name:
            gate, up = tensor.split(config.intermediate_size, dim=0)
            out[name.replace("gate_up_proj", "gate_proj")] = gate
            out[name.replace("gate_up_proj", "up_proj")] = up
        else:
            out[name] = tensor
    return out


@pytest.fixture
def one_thread():
    """Tiny matmuls: a second OpenMP thread only adds overhead (20x+ when the CPU is busy)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_qwen3_dummy_greedy_matches_transformers(qwen3_folder, one_thread):
    llm = LLM(
        model=str(qwen3_folder),
        load_format="dummy",
        dtype="float32",
        seed=1234,
        block_size=16,
        num_gpu_blocks_override=24,
        max_num_seqs=4,
        max_num_batched_tokens=32,  # the 45-token prompt is prefilled in two chunks
        num_threads=1,
    )
    try:
        assert llm.get_tokenizer() is None
        model = llm.engine.core.executor.worker.runner.model
        state = {k: v.detach().clone() for k, v in model.state_dict().items()}
        assert any(k.endswith("self_attn.q_norm.weight") for k in state)

        g = torch.Generator().manual_seed(7)
        prompts = [torch.randint(0, CONFIG["vocab_size"], (n,), generator=g).tolist() for n in (5, 21, 45)]
        params = SamplingParams(temperature=0.0, max_tokens=NUM_STEPS, ignore_eos=True)
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        assert llm.engine.core.scheduler.kv.pool.num_used_blocks == 0
    finally:
        llm.shutdown()

    config = Qwen3Config(**CONFIG)
    ref = Qwen3ForCausalLM(config).eval()
    missing, unexpected = ref.load_state_dict(hf_state_dict(state, config), strict=False)
    assert not unexpected
    assert not [m for m in missing if "rotary" not in m]

    for prompt, out in zip(prompts, outputs):
        completion = out.outputs[0]
        assert completion.finish_reason == "length"
        assert len(completion.token_ids) == NUM_STEPS
        with torch.no_grad():
            gen = ref.generate(
                torch.tensor([prompt]),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                do_sample=False,
                max_new_tokens=NUM_STEPS,
                min_new_tokens=NUM_STEPS,
                output_scores=True,
                return_dict_in_generate=True,
                pad_token_id=0,
            )
        ref_tokens = gen.sequences[0, len(prompt) :].tolist()
        # the dummy weights spread the logits enough that greedy has no near-ties
        top2 = torch.stack(gen.scores).squeeze(1).topk(2, dim=-1).values
        assert (top2[:, 0] - top2[:, 1]).min() > 1e-4
        assert completion.token_ids == ref_tokens
    # dummy weights still produce varied text, not one repeated token
    assert len({t for o in outputs for t in o.outputs[0].token_ids}) > 3
