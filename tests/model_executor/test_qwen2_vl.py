"""The Qwen2-VL language model with precomputed vision features, against ``transformers``.

A tiny random Qwen2-VL (``qwen2_vl_dummy`` in tests/conftest.py) is saved by
``transformers`` and loaded by the engine. The features of random pixels come
from transformers' own vision tower (``model.visual``); the engine gets only
the features, transformers' ``generate`` the pixels. Greedy tokens must agree:
for one image, two images, a video, an image split by chunked prefill, and a
prompt whose first blocks come from the prefix cache.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fastdeploy import LLM, SamplingParams
from fastdeploy.multimodal import encode_features

IMG, VID, VS, VE = 290, 291, 292, 293
NUM_STEPS = 8
PATCH_DIM = 3 * 2 * 2 * 2  # channels x temporal patch x patch x patch
GREEDY = SamplingParams(temperature=0.0, max_tokens=NUM_STEPS)


class Item:
    """One image or video: its grid, random pixels and the features transformers' tower makes of them."""

    def __init__(self, hf, modality: str, grid: list[int], seed: int):
        self.modality, self.grid = modality, grid
        generator = torch.Generator().manual_seed(seed)
        self.pixels = torch.randn(grid[0] * grid[1] * grid[2], PATCH_DIM, generator=generator)
        with torch.no_grad():
            self.features = hf.model.visual(self.pixels, grid_thw=torch.tensor([grid])).pooler_output
        self.rows = self.features.shape[0]

    def mm_data(self) -> dict:
        return {f"{self.modality}_embeds": self.features, f"{self.modality}_grid_thw": self.grid}


def expand(ids: list[int], items: list[Item]) -> list[int]:
    """The prompt with each one-token placeholder repeated once per feature row (what the processor makes)."""
    queues = {
        IMG: [i for i in items if i.modality == "image"],
        VID: [i for i in items if i.modality == "video"],
    }
    out = []
    for token in ids:
        out += [token] * (queues[token].pop(0).rows if token in queues else 1)
    return out


def hf_greedy(hf, ids: list[int], items: list[Item]) -> list[int]:
    full = expand(ids, items)
    input_ids = torch.tensor([full])
    token_type = torch.tensor([[1 if t == IMG else 2 if t == VID else 0 for t in full]])
    kwargs = {}
    for modality, key in (("image", "pixel_values"), ("video", "pixel_values_videos")):
        chosen = [i for i in items if i.modality == modality]
        if chosen:
            kwargs[key] = torch.cat([i.pixels for i in chosen])
            kwargs[f"{modality}_grid_thw"] = torch.tensor([i.grid for i in chosen])
    with torch.no_grad():
        out = hf.generate(
            input_ids=input_ids,
            attention_mask=torch.ones_like(input_ids),
            mm_token_type_ids=token_type,
            max_new_tokens=NUM_STEPS,
            do_sample=False,
            **kwargs,
        )
    return out[0, len(full) :].tolist()


def prompt(ids: list[int], items: list[Item]) -> dict:
    data = {m: [i.mm_data() for i in items if i.modality == m] for m in ("image", "video")}
    return {"prompt_token_ids": ids, "multi_modal_data": data}


ENGINE = dict(dtype="float32", kv_cache_memory=0.02, max_num_seqs=4, num_threads=1, max_model_len=512)


@pytest.fixture(scope="module")
def media_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("features")


@pytest.fixture(scope="module")
def llm(qwen2_vl_dummy, media_dir):
    folder, _ = qwen2_vl_dummy
    engine = LLM(model=str(folder), allowed_local_media_path=str(media_dir), **ENGINE)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def hf(qwen2_vl_dummy):
    return qwen2_vl_dummy[1]


def run(engine: LLM, request: dict):
    out = engine.generate(request, GREEDY)[0]
    return out.outputs[0].token_ids, out.num_cached_tokens


def test_one_image(llm, hf):
    image = Item(hf, "image", [1, 4, 6], seed=1)
    ids = [5, 6, 7, VS, IMG, VE, 8, 9, 10]
    tokens, _ = run(llm, prompt(ids, [image]))
    assert tokens == hf_greedy(hf, ids, [image])


def test_two_images_and_a_video(llm, hf):
    first, second = Item(hf, "image", [1, 4, 6], seed=2), Item(hf, "image", [1, 6, 4], seed=3)
    ids = [11, VS, IMG, VE, 12, 13, VS, IMG, VE, 14]
    assert run(llm, prompt(ids, [first, second]))[0] == hf_greedy(hf, ids, [first, second])

    video = Item(hf, "video", [2, 4, 6], seed=4)  # temporal positions 0 and 1 per frame pair
    ids = [15, 16, VS, VID, VE, 17, 18]
    assert run(llm, prompt(ids, [video]))[0] == hf_greedy(hf, ids, [video])

    ids = [19, VS, IMG, VE, 20, VS, VID, VE, 21]
    mixed = [Item(hf, "image", [1, 4, 4], seed=5), Item(hf, "video", [2, 4, 4], seed=6)]
    assert run(llm, prompt(ids, mixed))[0] == hf_greedy(hf, ids, mixed)


def test_chunked_prefill_splits_an_image(qwen2_vl_dummy, hf):
    """A token budget of 8 cuts the 24-row image into chunks that start and end inside it."""
    folder, _ = qwen2_vl_dummy
    engine = LLM(model=str(folder), max_num_batched_tokens=8, enable_prefix_caching=False, **ENGINE)
    try:
        image = Item(hf, "image", [1, 8, 12], seed=7)
        ids = [22, 23, 24, VS, IMG, VE, 25, 26]
        assert run(engine, prompt(ids, [image]))[0] == hf_greedy(hf, ids, [image])
    finally:
        engine.shutdown()


def test_prefix_cache_reuses_image_blocks_and_keeps_other_images_apart(llm, hf):
    """18 text tokens, a 24-row image at tokens 18-41, 2 more: 44 tokens, 2 full blocks of 16 cacheable."""
    ids = list(range(30, 47)) + [VS, IMG, VE, 47]
    image, other = Item(hf, "image", [1, 8, 12], seed=8), Item(hf, "image", [1, 8, 12], seed=9)
    expected = hf_greedy(hf, ids, [image])
    assert run(llm, prompt(ids, [image])) == (expected, 0)
    # the second time blocks 0-1 (32 tokens) come from the cache: prefill starts inside the image
    assert run(llm, prompt(ids, [image])) == (expected, 32)
    # same text, other image: only the text-only block 0 is shared
    assert run(llm, prompt(ids, [other])) == (hf_greedy(hf, ids, [other]), 16)


def test_repeated_url_is_not_fetched_and_counts_encoder_cache_hits(llm, hf, media_dir, monkeypatch):
    import fastdeploy.multimodal.fetch as fetch

    image = Item(hf, "image", [1, 4, 8], seed=10)
    path = media_dir / "cat.npy"
    path.write_bytes(encode_features(image.features, "npy"))
    reads = []
    real_read = fetch.read_url
    monkeypatch.setattr(fetch, "read_url", lambda url, **kw: reads.append(url) or real_read(url, **kw))
    ids = [60, 61, VS, IMG, VE, 62]
    request = {
        "prompt_token_ids": ids,
        "multi_modal_data": {"image": [{"url": path.as_uri(), "grid_thw": image.grid}]},
    }
    before = (llm.engine.stats.encoder_cache_hits, llm.engine.stats.encoder_cache_misses)
    expected = hf_greedy(hf, ids, [image])
    assert run(llm, request)[0] == expected
    assert run(llm, request)[0] == expected
    assert reads == [path.as_uri()]  # fetched once
    hits, misses = (llm.engine.stats.encoder_cache_hits, llm.engine.stats.encoder_cache_misses)
    assert (hits - before[0], misses - before[1]) == (1, 1)  # sent to the worker once


def test_wrong_features_are_refused_before_anything_runs(llm, hf):
    from fastdeploy.multimodal import MultimodalInputError

    image = Item(hf, "image", [1, 4, 6], seed=11)
    narrow = {"image_embeds": image.features[:, :32], "image_grid_thw": image.grid}
    request = {"prompt_token_ids": [1, VS, IMG, VE], "multi_modal_data": {"image": [narrow]}}
    with pytest.raises(MultimodalInputError, match=r"image item 0: wrong width"):
        llm.generate(request, GREEDY)
    two = {"prompt_token_ids": [1, IMG, 2, IMG], "multi_modal_data": {"image": [image.mm_data()]}}
    with pytest.raises(MultimodalInputError, match="2 image placeholder"):
        llm.generate(two, GREEDY)
    assert not llm.engine.has_unfinished_requests()
    assert np.isfinite(image.features.numpy()).all()


def token_logprobs(output, full: list[int]) -> list[float]:
    """Log-probability of each prompt token after the first, as the engine reports it."""
    return [entry[full[i]].logprob for i, entry in enumerate(output.prompt_logprobs) if entry is not None]


def test_bidirectional_image_attention_matches_a_dense_mask(qwen2_vl_dummy, hf, llm):
    """``mm_bidirectional_attention``: the image's tokens see each other; text stays causal.

    Prompt logprobs before the image are unchanged, every later one changes, and all
    agree with transformers run on the same inputs with that dense mask.
    """
    folder, _ = qwen2_vl_dummy
    image = Item(hf, "image", [1, 4, 6], seed=12)
    ids = [70, 71, 72, VS, IMG, VE, 73, 74, 75]
    full = expand(ids, [image])
    first, end = full.index(IMG), len(full) - 1 - full[::-1].index(IMG) + 1  # the image: tokens 4..9
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    causal = token_logprobs(llm.generate(prompt(ids, [image]), params)[0], full)
    engine = LLM(model=str(folder), mm_bidirectional_attention=True, **ENGINE)
    try:
        bidirectional = token_logprobs(engine.generate(prompt(ids, [image]), params)[0], full)
    finally:
        engine.shutdown()

    # token i's logprob comes from position i - 1: positions before the image are untouched
    assert bidirectional[:first] == pytest.approx(causal[:first], abs=1e-5)
    changed = [abs(b - c) > 1e-4 for b, c in zip(bidirectional[first:], causal[first:])]
    assert all(changed), changed

    limit = torch.arange(len(full)) + 1
    limit[first:end] = end
    allowed = torch.arange(len(full))[None, :] < limit[:, None]
    mask = torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(torch.float32).min)[None, None]
    input_ids = torch.tensor([full])
    token_type = torch.tensor([[1 if t == IMG else 0 for t in full]])
    grid = torch.tensor([image.grid])
    with torch.no_grad():
        position_ids, _ = hf.model.get_rope_index(
            input_ids, mm_token_type_ids=token_type, image_grid_thw=grid
        )
        logits = hf(
            input_ids=input_ids,
            pixel_values=image.pixels,
            image_grid_thw=grid,
            mm_token_type_ids=token_type,
            position_ids=position_ids,
            attention_mask=mask,
        ).logits[0]
    reference = logits.log_softmax(-1)[torch.arange(len(full) - 1), torch.tensor(full[1:])].tolist()
    assert bidirectional == pytest.approx(reference, abs=1e-4)
    assert causal != pytest.approx(reference, abs=1e-4)
