"""The worker's stop decision (``length_stop_codes`` + ``device_stop_codes``), the persistent batch's
sampling controls, and the step arrays' single upload."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fastdeploy.core.step_io import NewRequestData, StopCode, WorkerSamplingParams
from fastdeploy.ops.stop_ops import alloc_stop_flag, get_stop, set_stop
from fastdeploy.worker.input_batch import NO_MAX_TOKENS, InputBatch
from fastdeploy.worker.step_state import StepArrays, device_stop_codes, length_stop_codes

EOS = 2
MAX_MODEL_LEN = 32
PROMPT = [10, 11, 12, 13]


def batch_of(*requests: tuple[int, WorkerSamplingParams]) -> InputBatch:
    """A batch holding, per request, the prompt plus ``n`` outputs (7s) and its controls."""
    batch = InputBatch(8, MAX_MODEL_LEN, 4, torch.device("cpu"))
    for i, (num_outputs, params) in enumerate(requests):
        batch.add_request(NewRequestData(f"r{i}", PROMPT + [7] * num_outputs, len(PROMPT), params, [], 0))
    return batch


def stop_codes(batch: InputBatch, sampled: list[int]) -> list[StopCode]:
    """The codes the worker gives the rows of every slot in order, sampling ``sampled``."""
    slots = np.arange(len(sampled))
    num_tokens_after = batch.num_tokens[slots] + 1
    length = torch.from_numpy(length_stop_codes(batch, slots, num_tokens_after, MAX_MODEL_LEN))
    tokens = torch.tensor(sampled, dtype=torch.int64)
    codes = device_stop_codes(batch, slots, tokens, length, num_tokens_after, torch.from_numpy)
    assert codes.dtype == torch.int32
    return [StopCode(c) for c in codes.tolist()]


def test_stop_ids_then_length_decide_each_row():
    p = WorkerSamplingParams
    batch = batch_of(
        (0, p(max_tokens=5, eos_token_ids=[EOS])),  # EOS
        (0, p(max_tokens=5, eos_token_ids=[EOS], stop_token_ids=[20])),  # a stop id
        (0, p(max_tokens=5, eos_token_ids=[EOS], stop_token_ids=[EOS])),  # an id in both counts as EOS
        (4, p(max_tokens=5, eos_token_ids=[EOS])),  # the 5th output: length
        (4, p(max_tokens=5, eos_token_ids=[EOS])),  # EOS as the 5th output: stop, not length
        (0, p(max_tokens=5)),  # ignore_eos (no EOS ids sent)
        (27, p(max_tokens=None, eos_token_ids=[EOS])),  # the 32nd token: max_model_len
        (0, p(max_tokens=0, eos_token_ids=[EOS])),  # max_tokens 0: the prefill's token ends it by length
    )
    assert stop_codes(batch, [EOS, 20, EOS, 9, EOS, EOS, 9, EOS]) == [
        StopCode.EOS,
        StopCode.STOP_TOKEN,
        StopCode.EOS,
        StopCode.LENGTH,
        StopCode.EOS,
        StopCode.RUNNING,
        StopCode.LENGTH,
        StopCode.LENGTH,
    ]
    assert stop_codes(batch, [9, 9, 9, 9, 9, 9, 8, 9])[:3] == [StopCode.RUNNING] * 3


def test_stop_ids_count_only_once_min_tokens_are_out():
    params = WorkerSamplingParams(min_tokens=3, eos_token_ids=[EOS], stop_token_ids=[20])
    batch = batch_of((1, params), (2, params), (1, params))  # outputs after this token: 2, 3, 2
    assert stop_codes(batch, [EOS, 20, 20]) == [StopCode.RUNNING, StopCode.STOP_TOKEN, StopCode.RUNNING]


def test_a_slot_holds_exactly_its_request_controls_and_the_defaults_when_emptied():
    params = WorkerSamplingParams(
        temperature=0.5,
        top_k=-1,
        seed=1,
        logit_bias={3: 1.0},
        bad_words_token_ids=[[4], [5, 6]],
        min_tokens=2,
        max_tokens=9,
        eos_token_ids=[EOS],
        stop_token_ids=[20],
        logprobs=2,
    )
    batch = batch_of((0, params))
    slot = batch.req_id_to_index["r0"]
    assert (batch.temperature[slot], batch.top_k[slot], batch.max_tokens[slot]) == (0.5, 0, 9)
    assert batch.stop_ids[slot] == {20: StopCode.STOP_TOKEN, EOS: StopCode.EOS}
    assert batch.static_bans[slot] == [4] and batch.bad_word_seqs[slot] == [[5, 6]]
    assert slot in batch.generators and batch.num_logprobs[slot] == 2
    slots, tokens, codes = batch.sparse_entries()["stop_ids"]
    assert (slots.tolist(), tokens.tolist(), codes.tolist()) == ([slot, slot], [20, EOS], [2, 1])
    batch.remove_request("r0")
    empty = InputBatch(8, MAX_MODEL_LEN, 4, torch.device("cpu"))
    for name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "min_tokens", "max_tokens"):
        assert getattr(batch, name)[slot] == getattr(empty, name)[slot], name
    assert batch.max_tokens[slot] == NO_MAX_TOKENS and batch.num_logprobs[slot] == -1
    assert not (
        batch.stop_ids or batch.logit_bias or batch.static_bans or batch.bad_word_seqs or batch.generators
    )


def test_the_any_running_flag_follows_the_stop_codes():
    batch = batch_of((0, WorkerSamplingParams(eos_token_ids=[EOS])), (4, WorkerSamplingParams(max_tokens=5)))
    flag_device, flag_host = alloc_stop_flag("cpu")
    for sampled, running in (([9, 9], True), ([EOS, 9], False)):
        slots = np.arange(2)
        num_tokens_after = batch.num_tokens[slots] + 1
        length = torch.from_numpy(length_stop_codes(batch, slots, num_tokens_after, MAX_MODEL_LEN))
        codes = device_stop_codes(
            batch, slots, torch.tensor(sampled), length, num_tokens_after, torch.from_numpy
        )
        set_stop(codes != StopCode.RUNNING, flag_device, flag_host)
        assert get_stop(flag_host) is running


@pytest.mark.parametrize(
    "device",
    ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU"))],
)
def test_step_arrays_upload_in_one_copy_keeping_names_dtypes_and_shapes(device):
    rng = np.random.default_rng(0)
    host = StepArrays(
        query_start_loc=np.array([0, 3, 5], dtype=np.int32),
        seq_lens=np.array([3, 9], dtype=np.int32),
        block_table=rng.integers(0, 9, (2, 4)).astype(np.int32),
        slot_mapping=rng.integers(-1, 99, 5),
        input_ids=rng.integers(0, 99, 5),
        positions=rng.integers(0, 9, (3, 5)),
        logits_indices=np.array([2, 4]),
        unsaved_tokens=np.zeros(0, dtype=np.int64),
        unsaved_rows=np.zeros(0, dtype=np.int64),
        length_codes=np.array([0, 3], dtype=np.int32),
    )
    dev = host.upload(torch.device(device))
    assert dev.mask_offsets is None
    for name, array in vars(host).items():
        if array is None:
            continue
        tensor = getattr(dev, name)
        assert tensor.device.type == device and tensor.shape == array.shape, name
        assert np.array_equal(tensor.cpu().numpy(), array) and tensor.cpu().numpy().dtype == array.dtype, name
    if device == "cuda":  # views of one device buffer
        storages = {
            getattr(dev, name).untyped_storage().data_ptr() for name in vars(host) if name != "mask_offsets"
        }
        assert len(storages) == 1
