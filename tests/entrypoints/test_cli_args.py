"""The ``fastdeploy`` CLI: flags generated from the config dataclasses, YAML config merging."""

from __future__ import annotations

import dataclasses
import pathlib
import subprocess
import sys

import pytest

from fastdeploy.config import EngineConfig, field_docs
from fastdeploy.entrypoints.cli import main as cli_main
from fastdeploy.entrypoints.cli.args import (
    SERVER_FLAGS,
    ConfigFileError,
    all_flag_specs,
    engine_config_from_args,
    load_config_file,
    resolve_args,
    server_config_from_args,
)
from fastdeploy.entrypoints.cli.serve import make_parser

ROOT = pathlib.Path(__file__).resolve().parents[2]


def parse(*argv: str):
    return make_parser().parse_args(list(argv))


def config_of(*argv: str) -> EngineConfig:
    return engine_config_from_args(parse(*argv))


def write_yaml(tmp_path, text: str) -> str:
    path = tmp_path / "serve.yaml"
    path.write_text(text)
    return str(path)


def test_every_config_field_has_a_flag_with_its_docstring_as_help():
    help_text = " ".join(make_parser().format_help().split())
    for section_cls, field in EngineConfig.flat_fields():
        flag = "--" + field.name.replace("_", "-")
        assert flag in help_text, flag
        doc = field_docs(section_cls)[field.name]
        assert doc and doc in help_text, (flag, doc)
    for flag in ("--host", "--port", "--api-key", "--config"):
        assert flag in help_text


def test_issue_flags_exist():
    help_text = make_parser().format_help()
    for flag in (
        "--model",
        "--host",
        "--port",
        "--served-model-name",
        "--max-model-len",
        "--max-num-seqs",
        "--max-num-batched-tokens",
        "--block-size",
        "--kv-cache-memory",
        "--gpu-memory-utilization",
        "--enable-prefix-caching",
        "--no-enable-prefix-caching",
        "--dtype",
        "--load-format",
        "--api-key",
        "--tensor-parallel-size",
        "--config",
    ):
        assert flag in help_text, flag


def test_no_flags_give_the_dataclass_defaults_and_server_defaults():
    assert config_of() == EngineConfig()
    ns = resolve_args(parse())
    assert (ns.host, ns.port, ns.api_key, ns.config) == ("127.0.0.1", 8000, None, None)


def test_values_are_typed():
    config = config_of(
        "--model",
        "/m/x.gguf",
        "--max-num-seqs",
        "8",
        "--kv-cache-memory",
        "0.5",
        "--max-model-len",
        "1024",
        "--no-enable-prefix-caching",
        "--no-enable-chunked-prefill",
        "--hf-config-overrides",
        '{"num_hidden_layers": 2}',
        "--dtype",
        "float32",
    )
    assert config.model.model == "/m/x.gguf"
    assert config.scheduler.max_num_seqs == 8
    assert config.cache.kv_cache_memory == 0.5
    assert config.model.max_model_len == 1024
    assert config.cache.enable_prefix_caching is False
    assert config.scheduler.enable_chunked_prefill is False
    assert config.model.hf_config_overrides == {"num_hidden_layers": 2}
    assert config.model.dtype == "float32"
    assert config_of("--enable-prefix-caching").cache.enable_prefix_caching is True


def test_optional_int_accepts_none():
    assert config_of("--max-model-len", "none").model.max_model_len is None
    assert config_of("--num-gpu-blocks-override", "64").cache.num_gpu_blocks_override == 64


@pytest.mark.parametrize(
    "argv",
    [
        ["--max-num-seqs", "many"],
        ["--max-num-seqs", "1.5"],
        ["--kv-cache-memory", "lots"],
        ["--hf-config-overrides", "[1, 2]"],
        ["--hf-config-overrides", "{bad"],
        ["--block-size", "none"],
        ["--enable-prefix-caching=yes"],
        ["--unknown-flag", "1"],
    ],
)
def test_bad_flag_values_exit_2(argv, capsys):
    with pytest.raises(SystemExit) as info:
        parse(*argv)
    assert info.value.code == 2
    assert "error" in capsys.readouterr().err


def test_server_flags():
    ns = resolve_args(parse("--host", "0.0.0.0", "--port", "0", "--api-key", "k"))
    assert (ns.host, ns.port, ns.api_key) == ("0.0.0.0", 0, ["k"])
    assert not server_config_from_args(ns).return_tokens_as_token_ids
    ns = resolve_args(parse("--return-tokens-as-token-ids"))  # vLLM's flag
    assert server_config_from_args(ns).return_tokens_as_token_ids


def test_api_key_from_the_environment(monkeypatch):
    monkeypatch.setenv("FD_API_KEY", "from-env")
    assert server_config_from_args(parse()).api_key == ["from-env"]
    assert server_config_from_args(parse("--api-key", "flag")).api_key == ["flag"]  # the flag wins
    monkeypatch.setenv("FD_API_KEY", "")
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    assert server_config_from_args(parse()).api_key is None
    monkeypatch.setenv("VLLM_API_KEY", "vllm-env")  # vLLM's variable, when ours is unset
    assert server_config_from_args(parse()).api_key == ["vllm-env"]
    monkeypatch.setenv("FD_API_KEY", "ours")
    assert server_config_from_args(parse()).api_key == ["ours"]


def test_positional_model():
    assert config_of("/models/smol").model.model == "/models/smol"
    assert config_of("/models/smol", "--model", "/models/smol").model.model == "/models/smol"
    with pytest.raises(ConfigFileError, match="model given twice"):
        config_of("/models/a", "--model", "/models/b")


def test_yaml_config_merges_with_cli_overrides(tmp_path):
    path = write_yaml(
        tmp_path,
        "model: /m/model.gguf\n"
        "max-num-seqs: 8\n"
        "max_num_batched_tokens: 512\n"
        "enable-prefix-caching: false\n"
        "hf_config_overrides: {num_hidden_layers: 2}\n"
        "kv-cache-memory: 2\n"
        "max-model-len: null\n"
        "port: 9001\n"
        "api-key: secret\n",
    )
    ns = resolve_args(parse("--config", path, "--max-num-seqs", "4", "--port", "9002"))
    config = engine_config_from_args(ns)
    assert config.model.model == "/m/model.gguf"
    assert config.scheduler.max_num_seqs == 4  # command line wins
    assert config.scheduler.max_num_batched_tokens == 512  # from the file
    assert config.cache.enable_prefix_caching is False
    assert config.model.hf_config_overrides == {"num_hidden_layers": 2}
    assert config.cache.kv_cache_memory == 2.0 and isinstance(config.cache.kv_cache_memory, float)
    assert config.model.max_model_len is None
    assert config.scheduler.enable_chunked_prefill is True  # default
    assert (ns.port, ns.api_key) == (9002, ["secret"])


def test_cli_bool_overrides_yaml(tmp_path):
    path = write_yaml(tmp_path, "enable-prefix-caching: false\n")
    assert config_of("--config", path, "--enable-prefix-caching").cache.enable_prefix_caching is True
    assert config_of("--config", path).cache.enable_prefix_caching is False


def test_resolve_is_idempotent(tmp_path):
    path = write_yaml(tmp_path, "max-num-seqs: 8\n")
    ns = resolve_args(parse("--config", path))
    assert resolve_args(ns) is ns
    assert engine_config_from_args(ns).scheduler.max_num_seqs == 8


def test_unknown_yaml_key_is_a_clear_error(tmp_path):
    path = write_yaml(tmp_path, "max-num-seq: 8\n")
    with pytest.raises(ConfigFileError) as info:
        load_config_file(path)
    message = str(info.value)
    assert "unknown key 'max-num-seq'" in message
    assert "did you mean 'max-num-seqs'" in message
    assert path in message


@pytest.mark.parametrize(
    "text, key",
    [
        ("max-num-seqs: many\n", "max-num-seqs"),
        ("max-num-seqs: 1.5\n", "max-num-seqs"),
        ("enable-prefix-caching: 3\n", "enable-prefix-caching"),
        ("block-size: null\n", "block-size"),
        ("hf-config-overrides: [1]\n", "hf-config-overrides"),
        ("dtype: [a, b]\n", "dtype"),
    ],
)
def test_bad_yaml_values_name_the_key(tmp_path, text, key):
    with pytest.raises(ConfigFileError, match=f"'{key}'"):
        load_config_file(write_yaml(tmp_path, text))


def test_bad_yaml_files(tmp_path):
    with pytest.raises(ConfigFileError, match="cannot read"):
        load_config_file(str(tmp_path / "missing.yaml"))
    with pytest.raises(ConfigFileError, match="mapping"):
        load_config_file(write_yaml(tmp_path, "- a\n- b\n"))
    with pytest.raises(ConfigFileError, match="not valid YAML"):
        load_config_file(write_yaml(tmp_path, "a: [\n"))
    assert load_config_file(write_yaml(tmp_path, "")) == {}


def test_serve_with_bad_config_exits_2_before_loading(tmp_path, capsys):
    path = write_yaml(tmp_path, "no-such-option: 1\n")
    with pytest.raises(SystemExit) as info:
        cli_main.main(["serve", "--config", path])
    assert info.value.code == 2
    assert "unknown key 'no-such-option'" in capsys.readouterr().err


def test_dispatcher(capsys):
    parser = cli_main.build_parser()
    ns = parser.parse_args(["serve", "--max-num-seqs", "3"])
    assert ns.command == "serve" and callable(ns.func)
    assert cli_main.main([]) == 2  # no subcommand: help
    with pytest.raises(SystemExit) as info:
        cli_main.main(["--version"])
    assert info.value.code == 0
    assert "fastdeploy" in capsys.readouterr().out


def test_flag_keys_are_unique_and_cover_the_config():
    keys = [spec.key for spec in all_flag_specs()]
    assert len(keys) == len(set(keys))
    config_keys = [f.name for _, f in EngineConfig.flat_fields()]
    assert keys == config_keys + [s.key for s in SERVER_FLAGS]
    for spec in all_flag_specs():
        if spec.section != "server":
            section_cls = next(c for c, f in EngineConfig.flat_fields() if f.name == spec.key)
            field = next(f for f in dataclasses.fields(section_cls) if f.name == spec.key)
            assert spec.help == field_docs(section_cls)[field.name]


def test_uds_flag_is_vllms_and_unset_by_default():
    """``--uds PATH`` (vLLM's flag): serve on a Unix domain socket; shown with the server options."""
    parser = make_parser()
    assert server_config_from_args(parser.parse_args([])).uds is None
    assert server_config_from_args(parser.parse_args(["--uds", "/tmp/x.sock"])).uds == "/tmp/x.sock"


def test_cli_docs_list_every_flag():
    doc = (ROOT / "docs" / "cli.md").read_text(encoding="utf-8")
    for spec in all_flag_specs():
        assert f"`{spec.flag}" in doc, (
            f"{spec.flag} missing from docs/cli.md; run python tools/gen_cli_docs.py"
        )
    result = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "gen_cli_docs.py"), "--check"], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr


def test_serve_whose_engine_cannot_start_names_the_cause(capsys):
    """A backend this machine cannot run: exit 1 with the cause on one line, no traceback
    (the real engine process starts and fails; no server is left behind)."""
    code = cli_main.main(
        ["serve", "--attention-backend", "flashinfer", "--device", "cpu", "--num-threads", "1"]
    )
    err = capsys.readouterr().err
    assert code == 1
    assert "fastdeploy serve: the engine failed to start: " in err
    assert "--attention-backend flashinfer is not available: it runs on CUDA devices only" in err
    assert "Traceback" not in err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--reasoning-parser", "nope"], "unknown reasoning parser 'nope'; available: deepseek_r1, qwen3"),
        (["--tool-call-parser", "nope"], "unknown parser 'nope'; available: hermes, llama3_json, mistral"),
        (["--tensor-parallel-size", "4", "--device", "cpu"], "cannot split 9 attention heads"),
        (["--data-parallel-size", "0", "--device", "cpu"], "must be >= 1"),
        (["--api-server-count", "0"], "argument --api-server-count: must be at least 1 (got 0)"),
        (["--chat-template", "/no/such/template.jinja"], "argument --chat-template: "),
        (["--generation-config", "/no/such/folder"], "argument --generation-config: "),
        (["--ssl-keyfile", "/no/key.pem"], "HTTPS needs both --ssl-keyfile and --ssl-certfile"),
        (["--ssl-keyfile", "/no/key.pem", "--ssl-certfile", "/no/cert.pem"], "'/no/key.pem' is not a file"),
        (
            ["--api-server-count", "2", "--headless", "--nnodes", "2", "--node-rank", "1"],
            "argument --api-server-count: --headless runs no API server",
        ),
        (
            ["--max-logprobs", "-2"],
            "argument --max-logprobs: must be at least 0, or -1 for no bound (got -2)",
        ),
        (["--max_logprobs=-3"], "argument --max-logprobs: must be at least 0, or -1 for no bound (got -3)"),
        (
            ["--limit-mm-per-prompt", '{"audio": 2}'],
            "argument --limit-mm-per-prompt: unknown modality 'audio'",
        ),
    ],
    ids=[
        "reasoning-parser",
        "tool-call-parser",
        "heads",
        "dp-zero",
        "api-servers-zero",
        "chat-template",
        "generation-config",
        "ssl-half",
        "ssl-missing",
        "api-servers-headless",
        "max-logprobs",
        "max-logprobs-underscores",
        "limit-mm-per-prompt",
    ],
)
def test_serve_refuses_bad_options_before_starting(capsys, argv, message):
    """One line on stderr and exit 2, before any process starts."""
    code = cli_main.main(["serve", *argv])
    err = capsys.readouterr().err
    assert code == 2
    assert message in err and err.count("\n") == 1, err


def test_api_server_count_defaults_to_one_per_data_parallel_engine_core_on_a_gpu(monkeypatch):
    """Unset: one API server per DP engine core when the engine runs on a GPU (as vllm serve), one
    on a CPU, with DP=1 or headless; a given count is kept."""
    import torch

    from fastdeploy.entrypoints.cli.serve import default_api_server_count

    def args(*argv):
        return resolve_args(make_parser().parse_args(list(argv)))

    assert args().api_server_count is None
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert default_api_server_count(args("--data-parallel-size", "2")) == 2
    assert default_api_server_count(args("--data-parallel-size", "2", "--device", "cpu")) == 1
    assert default_api_server_count(args("--data-parallel-size", "2", "--api-server-count", "1")) == 1
    assert default_api_server_count(args()) == 1
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert default_api_server_count(args("--data-parallel-size", "2")) == 1
    assert default_api_server_count(args("--data-parallel-size", "4", "--device", "cuda")) == 4


def test_chat_template_replaces_the_tokenizers(tmp_path):
    """``--chat-template``: a file or the template text itself becomes the tokenizer's template."""
    from fastdeploy.config import ModelConfig
    from fastdeploy.model_executor.model_loader import load_tokenizer, resolve_model

    template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
    path = tmp_path / "template.jinja"
    path.write_text(template)
    for value in (str(path), template):
        config = ModelConfig(chat_template=value)
        tokenizer = load_tokenizer(config, resolve_model(config))
        text = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
        assert text == "<user>hi"
    ns = resolve_args(parse("--chat-template", str(path), "--trust-remote-code", "--enable-auto-tool-choice"))
    assert engine_config_from_args(ns).model.chat_template == str(path)
    assert engine_config_from_args(ns).model.trust_remote_code
    assert server_config_from_args(ns).enable_auto_tool_choice


def test_list_flags_take_a_json_array_or_commas(tmp_path):
    ns = resolve_args(parse("--allowed-origins", '["https://a.example", "https://b.example"]'))
    assert server_config_from_args(ns).allowed_origins == ["https://a.example", "https://b.example"]
    ns = resolve_args(parse("--allowed-origins", "https://a.example, https://b.example"))
    assert server_config_from_args(ns).allowed_origins == ["https://a.example", "https://b.example"]
    assert server_config_from_args(resolve_args(parse())).allowed_origins == []
    config = tmp_path / "c.yaml"
    config.write_text("allowed-origins: ['*']\nallowed-methods: GET,POST\n")
    server = server_config_from_args(resolve_args(parse("--config", str(config))))
    assert (server.allowed_origins, server.allowed_methods) == (["*"], ["GET", "POST"])


def test_flags_take_vllms_underscore_spelling_and_its_names():
    """``vllm serve`` command lines: ``--max_model_len 512`` (and ``=``) as ``--max-model-len``, and
    ``--hf-overrides`` as ``--hf-config-overrides``; values and what follows a bare ``--`` unchanged."""
    argv = ["serve", "--max_model_len", "512", "--served_model_name=my_model", "--enable_prefix_caching",
            "--hf-overrides", '{"num_hidden_layers": 2}', "--", "--keep_this"]  # fmt: skip
    normalized = cli_main.normalize_flag_names(argv)
    assert normalized == ["serve", "--max-model-len", "512", "--served-model-name=my_model",
                          "--enable-prefix-caching", "--hf-overrides", '{"num_hidden_layers": 2}', "--", "--keep_this"]  # fmt: skip
    config = config_of(*normalized[1:7])
    assert config.model.max_model_len == 512 and config.model.served_model_name == ["my_model"]
    assert config.model.hf_config_overrides == {"num_hidden_layers": 2}
    assert config_of("--max-logprobs", "-1").model.max_logprobs == -1
    assert config_of().model.max_logprobs == 20
    server = server_config_from_args(parse("--enable-server-load-tracking", "--enable-prompt-tokens-details"))
    assert server.enable_server_load_tracking and server.enable_prompt_tokens_details


def test_api_key_and_served_model_name_take_several_values():
    """``--api-key k1 k2`` (any of them is accepted) and ``--served-model-name a b`` (the first is
    reported), as vLLM's flags take them; the model stays positional after them only with --model."""
    ns = parse("--api-key", "k1", "k2", "--served-model-name", "a", "b", "--model", "m.gguf")
    assert ns.api_key == ["k1", "k2"] and ns.served_model_name == ["a", "b"]
    assert server_config_from_args(ns).api_key == ["k1", "k2"]
    from fastdeploy.entrypoints.openai.http_server import default_served_model_names

    assert default_served_model_names(engine_config_from_args(ns)) == ["a", "b"]
