"""A Qwen2-VL server with precomputed image features from ``file://`` URLs; http(s):// URLs
into the server's own network are refused."""

from __future__ import annotations

import numpy as np

GRID = [1, 4, 6]  # 24 patches, 6 feature rows after 2x2 merging
HIDDEN = 64


def image_part(url: str, grid: list[int] = GRID) -> dict:
    return {"type": "image_feature_url", "image_feature_url": {"url": url, "grid_thw": grid}}


def chat_body(model: str, parts: list[dict]) -> dict:
    content = [*parts, {"type": "text", "text": "What is in the picture?"}]
    return {
        "model": model,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": 6,
        "temperature": 0,
    }


def test_chat_with_image_feature_urls(server_factory, qwen2_vl_dummy, tmp_path):
    folder, _ = qwen2_vl_dummy
    media = tmp_path / "media"
    media.mkdir()
    rng = np.random.default_rng(0)
    np.save(media / "cat.npy", rng.standard_normal((6, HIDDEN)).astype(np.float32))
    np.save(media / "narrow.npy", rng.standard_normal((6, HIDDEN // 2)).astype(np.float32))
    np.save(media / "short.npy", rng.standard_normal((5, HIDDEN)).astype(np.float32))
    srv = server_factory("--model", str(folder), "--allowed-local-media-path", str(media))
    model = srv.model_name()
    cat = (media / "cat.npy").as_uri()

    client = srv.openai()
    body = chat_body(model, [image_part(cat)])
    completion = client.chat.completions.create(**body)
    text = completion.choices[0].message.content
    assert isinstance(text, str) and text
    # the prompt counts one token per feature row: 6 placeholders plus the text around them
    assert completion.usage.prompt_tokens > 6
    again = client.chat.completions.create(**body)  # cached URL and prefix: same greedy answer
    assert again.choices[0].message.content == text
    metrics = srv.wait_idle()
    # the second request's image was neither fetched nor sent to the worker again
    assert metrics["fastdeploy:encoder_cache_misses_total"] == 1
    assert metrics["fastdeploy:encoder_cache_hits_total"] == 1
    assert metrics["fastdeploy:feature_fetch_latency_seconds_count"] == 1

    with srv.http() as http:
        for name, what in (("narrow.npy", "wrong width"), ("short.npy", "wrong row count")):
            url = (media / name).as_uri()
            error = srv.check_error(
                http.post("/v1/chat/completions", json=chat_body(model, [image_part(url)])), 400
            )
            assert url in error["message"] and what in error["message"], error
            assert error["param"] == "messages[0].content[0]", error  # the part, not just "messages"
        missing = (media / "missing.npy").as_uri()
        error = srv.check_error(
            http.post("/v1/chat/completions", json=chat_body(model, [image_part(missing)])), 400
        )
        assert missing in error["message"] and "cannot read the file" in error["message"], error
        outside = (tmp_path / "elsewhere.npy").as_uri()
        error = srv.check_error(
            http.post("/v1/chat/completions", json=chat_body(model, [image_part(outside)])), 400
        )
        assert "outside --allowed-local-media-path" in error["message"], error
        # no SSRF: the server's own port, loopback in other spellings and the metadata address are
        # refused by the default media URL policy, without saying what a name resolved to
        for url in (
            f"http://127.0.0.1:{srv.port}/metrics",
            f"http://localhost:{srv.port}/metrics",
            f"http://0.0.0.0:{srv.port}/metrics",
            f"http://2130706433:{srv.port}/metrics",
            f"http://[::ffff:127.0.0.1]:{srv.port}/metrics",
            "http://169.254.169.254/latest/meta-data/",
        ):
            error = srv.check_error(
                http.post("/v1/chat/completions", json=chat_body(model, [image_part(url)])), 400
            )
            message = error["message"]
            assert url in message and "not allowed by the server's media URL policy" in message, error
            assert "127.0.0.1" not in message.replace(url, ""), error
        # files that reached numpy / torch unchecked were 500s: a float8 tensor, a long double array, a
        # header declaring terabytes; now 400s naming the part (the second part here)
        from safetensors.numpy import save_file

        save_file({"features": np.zeros((6, HIDDEN), dtype=np.float16)}, str(media / "ok16.safetensors"))
        np.save(media / "long.npy", np.zeros((6, HIDDEN), dtype=np.longdouble))
        small = (media / "cat.npy").read_bytes()
        (media / "huge.npy").write_bytes(small.replace(b"(6, 64), ", b"(1099511627776, 64), ", 1))
        for name, what in (("long.npy", "float16, float32 or float64"), ("huge.npy", "truncated .npy")):
            parts = [image_part((media / "ok16.safetensors").as_uri()), image_part((media / name).as_uri())]
            error = srv.check_error(http.post("/v1/chat/completions", json=chat_body(model, parts)), 400)
            assert what in error["message"] and error["param"] == "messages[0].content[1]", error
        # the server keeps serving after the refusals
        ok = http.post("/v1/chat/completions", json=body)
        assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["content"] == text
