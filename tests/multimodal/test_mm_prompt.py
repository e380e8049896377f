"""Placing multimodal items in a prompt, their M-RoPE positions, and their trip to the worker."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fastdeploy.core.mm_item import MMItem, tensor_from_wire, tensor_to_wire
from fastdeploy.multimodal import FeatureItem, MultimodalInputError, mm_hash
from fastdeploy.multimodal.items import expand_placeholders
from fastdeploy.multimodal.positions import mrope_positions
from fastdeploy.transformers_utils.config import MultimodalArchConfig

MM = MultimodalArchConfig(
    image_token_id=90, video_token_id=91, vision_start_token_id=92, vision_end_token_id=93,
    spatial_merge_size=2, mrope_section=[2, 3, 3],
)  # fmt: skip
TEXT = dict(
    vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
)  # fmt: skip


def fetched(modality: str, grid: list[int], seed: int, hidden: int = 8) -> FeatureItem:
    rows = grid[0] * grid[1] * grid[2] // 4
    features = torch.randn(rows, hidden, generator=torch.Generator().manual_seed(seed))
    item = FeatureItem(modality, grid, features=features, index=seed)  # type: ignore[arg-type]
    return item.with_features(features, mm_hash(features, modality, grid))


def test_placeholders_expand_to_one_token_per_row_in_modality_order():
    video, image = fetched("video", [2, 4, 4], 0), fetched("image", [1, 4, 6], 1)
    ids, items = expand_placeholders([1, 92, 91, 93, 2, 92, 90, 93, 3], [video, image], MM)
    assert ids == [1, 92] + [91] * 8 + [93, 2, 92] + [90] * 6 + [93, 3]
    assert [(i.modality, i.offset, i.length) for i in items] == [("video", 2, 8), ("image", 13, 6)]
    assert items[1].mm_hash == image.mm_hash and items[1].features is image.features
    # a placeholder that already has one token per row is kept as it is
    assert expand_placeholders(ids, [video, image], MM)[0] == ids


@pytest.mark.parametrize(
    ("ids", "message"),
    [
        ([1, 90, 2], "1 image placeholder(s) (token 90) but 2 image item(s)"),
        ([1, 90, 2, 90, 91], "1 video placeholder(s) (token 91) but 0 video item(s)"),
        ([1, 90, 90, 2, 90], "its placeholder has 2 tokens; give one token (expanded to the item's 6"),
    ],
)
def test_placeholder_mismatches_name_the_problem(ids, message):
    items = [fetched("image", [1, 4, 6], 0), fetched("image", [1, 4, 6], 1)]
    with pytest.raises(MultimodalInputError, match=message.replace("(", r"\(").replace(")", r"\)")):
        expand_placeholders(ids, items, MM)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_items_cross_processes_as_raw_bytes(dtype):
    import msgpack

    features = torch.randn(6, 8).to(dtype)
    item = MMItem("image", 3, 6, (1, 4, 6), "abc", features)
    wire = msgpack.unpackb(msgpack.packb(item.to_wire(), use_bin_type=True), raw=False)
    back = MMItem.from_wire(wire)
    assert back.features.dtype == dtype and torch.equal(back.features, features)
    assert (back.offset, back.end, back.grid_thw, back.mm_hash) == (3, 9, (1, 4, 6), "abc")
    assert item.to_wire(with_features=False)["features"] is None
    with pytest.raises(ValueError, match="unknown feature dtype"):
        tensor_from_wire({**tensor_to_wire(features), "dtype": "object"})


def test_positions_match_transformers_get_rope_index(qwen2_vl_dummy):
    """Two images and a video (temporal extent within the spatial one) against transformers."""
    _, hf = qwen2_vl_dummy
    mm = MultimodalArchConfig(290, 291, 292, 293, spatial_merge_size=2, mrope_section=[2, 3, 3])
    grids = [("image", [1, 4, 6]), ("video", [2, 6, 4]), ("image", [1, 8, 2])]
    items, ids, types = [], [5, 6], [0, 0]
    for modality, (t, h, w) in grids:
        rows = t * h * w // 4
        ids += [292] + [290 if modality == "image" else 291] * rows + [293, 7]
        types += [0] + [1 if modality == "image" else 2] * rows + [0, 0]
        items.append(MMItem(modality, len(ids) - rows - 2, rows, (t, h, w), modality))
    positions, delta = mrope_positions(len(ids), items, mm.spatial_merge_size)
    expected, deltas = hf.model.get_rope_index(
        torch.tensor([ids]),
        mm_token_type_ids=torch.tensor([types]),
        image_grid_thw=torch.tensor([g for m, g in grids if m == "image"]),
        video_grid_thw=torch.tensor([g for m, g in grids if m == "video"]),
    )
    np.testing.assert_array_equal(positions, expected[:, 0].numpy())
    assert delta == int(deltas[0, 0]) and delta < 0


def test_positions_of_a_qwen2_5_video_step_by_tokens_per_second():
    """Temporal rows step by tokens_per_second * second_per_grid_t; text resumes after the largest."""
    video = MMItem("video", 1, 8, (2, 4, 4), "v", second_per_grid_t=2.0)
    positions, delta = mrope_positions(10, [video], spatial_merge_size=2, tokens_per_second=2)
    assert positions[:, 0].tolist() == [0, 0, 0]
    assert positions[0, 1:9].tolist() == [1, 1, 1, 1, 5, 5, 5, 5]  # 1 + t * 4
    assert positions[1, 1:9].tolist() == [1, 1, 2, 2, 1, 1, 2, 2]
    assert positions[2, 1:9].tolist() == [1, 2, 1, 2, 1, 2, 1, 2]
    assert positions[:, 9].tolist() == [6, 6, 6]
    assert delta == 7 - 10
    with pytest.raises(ValueError, match="gives 8 tokens"):
        mrope_positions(10, [MMItem("video", 1, 7, (2, 4, 4), "v")], spatial_merge_size=2)


def test_chat_feature_parts_become_the_chat_templates_vision_tokens(qwen2_vl_dummy):
    from transformers import AutoTokenizer

    from fastdeploy.multimodal.prompt import MultimodalPromptBuilder
    from fastdeploy.transformers_utils.config import ModelArchConfig, read_config_json

    folder, _ = qwen2_vl_dummy
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    builder = MultimodalPromptBuilder(ModelArchConfig.from_dict(read_config_json(str(folder))))
    video = {
        "type": "video_feature_url",
        "video_feature_url": {"url": "file:///v.npy", "grid_thw": [2, 4, 4]},
    }
    image = {
        "type": "image_feature_url",
        "image_feature_url": {"url": "file:///i.npy", "grid_thw": [1, 4, 6]},
    }
    text = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    conversation = [{"role": "system", "content": "s"}, {"role": "user", "content": [video, *text, image]}]
    rendered, items = builder.split_chat(conversation, tokenizer)
    assert rendered[0] == conversation[0]
    assert rendered[1]["content"] == (
        "<|vision_start|><|video_pad|><|vision_end|>a\nb<|vision_start|><|image_pad|><|vision_end|>"
    )
    assert [(i.modality, i.url, i.index) for i in items] == [
        ("video", "file:///v.npy", 0),
        ("image", "file:///i.npy", 1),
    ]
    ids = tokenizer.encode(rendered[1]["content"], add_special_tokens=False)
    assert ids[:3] == [292, 291, 293] and ids[-3:] == [292, 290, 293]

    text_only = MultimodalPromptBuilder(
        ModelArchConfig.from_dict({"architectures": ["Qwen2ForCausalLM"], **TEXT})
    )
    with pytest.raises(MultimodalInputError, match="does not accept image or video inputs"):
        text_only.split_chat(conversation, tokenizer)


def test_limit_mm_per_prompt_refuses_more_items_before_fetching(qwen2_vl_dummy):
    """``--limit-mm-per-prompt``: more items of a modality than its bound is an error naming the
    bound, before any URL is fetched (these would not be: no local media path is allowed)."""
    from fastdeploy.multimodal.prompt import MultimodalPromptBuilder, check_limit_per_prompt
    from fastdeploy.transformers_utils.config import ModelArchConfig, read_config_json

    folder, _ = qwen2_vl_dummy
    arch = ModelArchConfig.from_dict(read_config_json(str(folder)))
    builder = MultimodalPromptBuilder(arch, limit_per_prompt={"image": 1, "video": 0})
    images = [FeatureItem("image", (1, 4, 4), url=f"file:///i{i}.npy", index=i) for i in range(2)]
    video = FeatureItem("video", (2, 4, 4), url="file:///v.npy", index=0)
    with pytest.raises(
        MultimodalInputError, match=r"At most 1 image\(s\) may be provided in one prompt, got 2"
    ):
        builder.place([1, 2], images)
    with pytest.raises(MultimodalInputError, match=r"At most 0 video\(s\)"):
        builder.place([1, 2], [video])
    with pytest.raises(MultimodalInputError, match="file://"):  # within the bound: on to the fetch
        builder.place([1, 2], images[:1])
    with pytest.raises(ValueError, match="unknown modality 'audio'"):
        check_limit_per_prompt({"audio": 1})
    with pytest.raises(ValueError, match="image must be a count of at least 0"):
        check_limit_per_prompt({"image": -1})
