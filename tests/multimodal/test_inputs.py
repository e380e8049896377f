"""Feature items, shape checks, loaders (no pickle), content parts and mm_hash."""

from __future__ import annotations

import base64
import io
import pickle

import numpy as np
import pytest
import torch

from fastdeploy.multimodal import (
    FeatureItem,
    MultimodalInputError,
    decode_image_embeds,
    encode_features,
    expected_rows,
    item_from_content_part,
    load_feature_bytes,
    mm_hash,
    validate_features,
)

GRID = (1, 4, 6)  # 24 patches -> 6 rows at merge size 2


def test_expected_rows():
    assert expected_rows(GRID, 2) == 6
    assert expected_rows([2, 4, 4], 2) == 8
    assert expected_rows((3, 5, 7), 1) == 105
    with pytest.raises(MultimodalInputError, match="not multiples of the spatial merge size 2"):
        expected_rows((1, 3, 4), 2)
    for bad in [(1, 4), (0, 4, 4), (1, -2, 4), "144", (1.0, 4, 4), None]:
        with pytest.raises(MultimodalInputError, match="grid_thw"):
            expected_rows(bad, 2)


def test_validate_features_names_item_and_shapes():
    validate_features(torch.zeros(6, 16), GRID, 16, 2, "item")
    with pytest.raises(
        MultimodalInputError,
        match=r"http://x/a\.npy: wrong row count: expected shape \[6, 16\].*got \[5, 16\]",
    ):
        validate_features(torch.zeros(5, 16), GRID, 16, 2, "http://x/a.npy")
    with pytest.raises(
        MultimodalInputError, match=r"wrong width \(the model's hidden size\).*\[6, 16\].*got \[6, 12\]"
    ):
        validate_features(torch.zeros(6, 12), GRID, 16, 2, "image item 3")
    with pytest.raises(MultimodalInputError, match="image item 3: features must be 2-D"):
        validate_features(torch.zeros(6, 16, 1), GRID, 16, 2, "image item 3")
    with pytest.raises(MultimodalInputError, match="float"):
        validate_features(torch.zeros(6, 16, dtype=torch.int32), GRID, 16, 2, "x")


def test_feature_item_checks():
    item = FeatureItem("video", [2, 4, 4], url="http://h/v.npy")
    assert item.grid_thw == (2, 4, 4) and item.label == "http://h/v.npy"
    assert FeatureItem("image", GRID, features=torch.zeros(6, 4), index=2).label == "image item 2"
    with pytest.raises(MultimodalInputError, match="modality"):
        FeatureItem("audio", GRID, url="http://h/a.npy")  # type: ignore[arg-type]
    with pytest.raises(MultimodalInputError, match="give a feature URL or inline features"):
        FeatureItem("image", GRID)
    with pytest.raises(MultimodalInputError, match="http://h/a.npy: grid_thw"):
        FeatureItem("image", (1, 2), url="http://h/a.npy")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "fmt, dtype",
    [(f, d) for f in ("npy", "safetensors") for d in (torch.float32, torch.float16)]
    + [("safetensors", torch.bfloat16)],  # numpy has no bfloat16
)
def test_round_trip(fmt, dtype):
    x = torch.randn(6, 16).to(dtype)
    y = load_feature_bytes(encode_features(x, fmt))
    assert y.dtype == dtype and torch.equal(x, y)


def test_pickle_is_never_loaded():
    buffer = io.BytesIO()
    np.save(buffer, np.array([{"a": 1}, None], dtype=object), allow_pickle=True)
    with pytest.raises(MultimodalInputError, match="float16, float32 or float64, got dtype object"):
        load_feature_bytes(buffer.getvalue())  # refused from its header, before np.load
    saved = io.BytesIO()
    torch.save(torch.zeros(6, 16), saved)
    with pytest.raises(MultimodalInputError, match="torch.save / pickle files are not accepted"):
        load_feature_bytes(saved.getvalue())
    with pytest.raises(MultimodalInputError, match="not accepted"):
        load_feature_bytes(pickle.dumps(np.zeros((6, 16))))
    with pytest.raises(MultimodalInputError, match="expected a .npy or .safetensors"):
        load_feature_bytes(b"hello world, not a tensor")


def test_npy_non_float_and_truncated():
    buffer = io.BytesIO()
    np.save(buffer, np.zeros((6, 16), dtype=np.int64))
    with pytest.raises(MultimodalInputError, match="float16, float32 or float64, got dtype int64"):
        load_feature_bytes(buffer.getvalue())
    data = encode_features(torch.zeros(6, 16), "npy")
    with pytest.raises(MultimodalInputError, match=".npy"):
        load_feature_bytes(data[:-10])


def _npy(array: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, array, allow_pickle=False)
    return buffer.getvalue()


def test_npy_byte_order_long_double_and_declared_size():
    """A client's .npy is never a 500: big-endian floats load (the same values), long doubles are
    refused, and a header that declares more data than the file holds is refused before numpy
    allocates it (a 200-byte file asking for terabytes)."""
    x = np.random.default_rng(0).standard_normal((6, 16)).astype(">f4")
    y = load_feature_bytes(_npy(x))
    assert y.dtype == torch.float32 and torch.equal(y, torch.from_numpy(x.astype("<f4")))
    with pytest.raises(MultimodalInputError, match="got dtype float128"):
        load_feature_bytes(_npy(np.zeros((6, 16), dtype=np.longdouble)))
    small = _npy(np.zeros((1, 64), dtype=np.float32))  # 128-byte header (padded), 256 bytes of data
    forged = small[:-256].replace(b"(1, 64), ", b"(1099511627776, 64), ") + small[-256:]  # (into the padding)
    with pytest.raises(MultimodalInputError, match="declares 281474976710656 bytes"):
        load_feature_bytes(forged)
    with pytest.raises(MultimodalInputError, match="unreadable .npy feature file header"):
        load_feature_bytes(b"\x93NUMPY\x01\x00\x10\x00{'descr': <}      \n")


def test_float8_and_non_finite_features_refused():
    with pytest.raises(
        MultimodalInputError, match="float16, bfloat16, float32 or float64, got dtype torch.float8"
    ):
        validate_features(torch.zeros(6, 16).to(torch.float8_e4m3fn), GRID, 16, 2, "image item 0")
    bad = torch.zeros(6, 16)
    bad[3, 5] = float("nan")
    with pytest.raises(MultimodalInputError, match="image item 0: features contain NaN or infinite values"):
        validate_features(bad, GRID, 16, 2, "image item 0")
    bad[3, 5] = float("inf")
    with pytest.raises(MultimodalInputError, match="NaN or infinite"):
        validate_features(bad, GRID, 16, 2, "image item 0")


def test_content_part_errors_name_their_request_field():
    part = {"type": "image_feature_url", "image_feature_url": {"url": "", "grid_thw": list(GRID)}}
    with pytest.raises(
        MultimodalInputError, match=r"messages\[0\]\.content\[1\] \(image_feature_url\)"
    ) as err:
        item_from_content_part(part, 0, location="messages[0].content[1]")
    assert err.value.param == "messages[0].content[1]"
    part = {
        "type": "image_embeds",
        "image_embeds": base64.b64encode(encode_features(torch.zeros(6, 16))).decode(),
    }
    with pytest.raises(MultimodalInputError, match="grid_thw") as err:
        item_from_content_part(part, 0, location="messages[2].content[0]")
    assert err.value.param == "messages[2].content[0]"


def test_safetensors_several_tensors():
    from safetensors.torch import save

    x = torch.randn(6, 16)
    assert torch.equal(load_feature_bytes(save({"features": x, "grid": torch.tensor([1, 4, 6])})), x)
    with pytest.raises(MultimodalInputError, match=r"holds 2 tensors \['a', 'b'\].*'features'"):
        load_feature_bytes(save({"a": x, "b": x.clone()}))


def test_image_embeds_payload():
    x = torch.randn(6, 16)
    for fmt in ("npy", "safetensors"):
        b64 = base64.b64encode(encode_features(x, fmt)).decode()
        assert torch.equal(decode_image_embeds(b64), x)
        assert torch.equal(decode_image_embeds("data:application/octet-stream;base64," + b64), x)
    saved = io.BytesIO()
    torch.save(x, saved)
    with pytest.raises(MultimodalInputError, match="not accepted"):
        decode_image_embeds(base64.b64encode(saved.getvalue()).decode())
    with pytest.raises(MultimodalInputError, match="not valid base64"):
        decode_image_embeds("***")
    with pytest.raises(MultimodalInputError, match="exceeds the limit of 100 bytes"):
        decode_image_embeds(base64.b64encode(encode_features(x)).decode(), max_bytes=100)


def test_content_parts():
    item = item_from_content_part(
        {"type": "video_feature_url", "video_feature_url": {"url": "bos://b/k.npy", "grid_thw": [2, 4, 4]}}, 1
    )
    assert (item.modality, item.url, item.grid_thw, item.index) == ("video", "bos://b/k.npy", (2, 4, 4), 1)
    x = torch.randn(6, 16)
    b64 = base64.b64encode(encode_features(x)).decode()
    flat = item_from_content_part({"type": "image_embeds", "image_embeds": b64, "grid_thw": list(GRID)}, 0)
    nested = item_from_content_part(
        {"type": "image_embeds", "image_embeds": {"image_embeds": b64, "image_grid_thw": list(GRID)}}, 0
    )
    for it in (flat, nested):
        assert it.modality == "image" and it.grid_thw == GRID and torch.equal(it.features, x)
    with pytest.raises(MultimodalInputError, match="content part 3 \\(image_feature_url\\): 'url'"):
        item_from_content_part({"type": "image_feature_url", "image_feature_url": {"grid_thw": [1, 2, 2]}}, 3)
    with pytest.raises(MultimodalInputError, match="content part 0 \\(image_embeds\\): .*base64"):
        item_from_content_part({"type": "image_embeds", "image_embeds": "@@", "grid_thw": [1, 2, 2]}, 0)


def test_mm_hash_depends_on_content_not_source():
    x = torch.randn(6, 16)
    h = mm_hash(x, "image", GRID)
    assert h == mm_hash(x.clone(), "image", GRID) and len(h) == 64
    assert h == mm_hash(load_feature_bytes(encode_features(x, "npy")), "image", GRID)
    different = [
        mm_hash(x, "video", GRID),
        mm_hash(x, "image", (1, 6, 4)),
        mm_hash(x.to(torch.float16), "image", GRID),
        mm_hash(x.reshape(12, 8), "image", GRID),
        mm_hash(x + 1, "image", GRID),
    ]
    assert len({h, *different}) == 6
    assert mm_hash(x.to(torch.bfloat16), "image", GRID) != h
    assert mm_hash(x.t().contiguous().t(), "image", GRID) == h  # layout does not matter, values do
