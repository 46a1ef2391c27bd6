"""`kvserve serve`: the arguments, then the app on uvicorn (imported only when serving)."""
from __future__ import annotations

import argparse
import logging
import os
from typing import TYPE_CHECKING

from kvserve.commands.options import add_quantize_arg
from kvserve.server.settings import ServerSettings

if TYPE_CHECKING:
    from kvserve.llm import LLM

log = logging.getLogger("kvserve.server")
_S = ServerSettings  # the flags' defaults are the settings' own
DEFAULT_DISK_GIB = 4.0  # --kv-disk-gib


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("serve", help="serve the OpenAI-compatible HTTP API")
    p.add_argument("model_arg", nargs="?", metavar="MODEL", help="the model, as --model (`kvserve serve MODEL`, as vllm serve)")
    p.add_argument("--model", default=None, help="alias, .gguf file or Hugging Face directory (default: smollm2-135m)")
    p.add_argument("--served-model-name", default=None, help="the name clients send as \"model\" (default: --model)")
    p.add_argument("--dtype", default="auto", help="auto, float32 or bfloat16")
    add_quantize_arg(p)
    p.add_argument("--batch-invariant", action=argparse.BooleanOptionalAction, default=None,
                   help="quantized weights: the integer kernel at every batch size, so a greedy request's tokens do "
                        "not depend on what else is batched with it (default: on where the kernel's dot is AVX-512 "
                        "VNNI or AVX2, as fast as sgemm there or faster; off on the plain C build, where sgemm takes "
                        "over past ~128 rows). --no-batch-invariant on a CPU with "
                        "bfloat16 arithmetic: steps of 32 rows or more (prompts, many users) run on a packed bfloat16 "
                        "copy of the weights, ~2.4x faster prefill for 2 more bytes a weight")
    p.add_argument("--host", default=_S.host, help="address to bind (default: loopback only; 0.0.0.0 for all)")
    p.add_argument("--port", type=int, default=_S.port)
    p.add_argument("--api-key", default=os.environ.get("KVSERVE_API_KEY"),
                   help="require Authorization: Bearer <key> (default: $KVSERVE_API_KEY; /health and /metrics stay open)")
    p.add_argument("--allowed-origins", default="", help="comma-separated origins for CORS (default: CORS off)")
    p.add_argument("--allowed-hosts", default="",
                   help="comma-separated Host header names answered, e.g. localhost,127.0.0.1,*.internal; others "
                        "get 400 (against DNS rebinding; default: any)")
    g = p.add_argument_group("limits")
    g.add_argument("--max-queued-requests", type=int, default=_S.max_queued_requests,
                   help="sequences that may wait beyond --max-num-seqs running ones; more get 429 (default: %(default)s)")
    g.add_argument("--max-n", type=int, default=_S.max_n, help="most completions per request (default: %(default)s)")
    g.add_argument("--max-logprobs", type=int, default=_S.max_logprobs, help="most top logprobs per token (default: %(default)s)")
    g.add_argument("--max-body-mib", type=float, default=_S.max_body_bytes / (1 << 20), help="largest request body in MiB (default: %(default)g)")
    g.add_argument("--max-prompts", type=int, default=_S.max_prompts,
                   help="most prompts in one /v1/completions request, or inputs in one /v1/embeddings request (default: %(default)s)")
    g.add_argument("--max-request-share", type=float, default=_S.max_request_share,
                   help="the largest share of running + queued capacity one request may hold (default: %(default)s)")
    g.add_argument("--drain-timeout", type=float, default=_S.drain_timeout,
                   help="seconds in-flight requests get to finish after SIGTERM (default: %(default)g)")
    g.add_argument("--stall-timeout", type=float, default=_S.stall_timeout,
                   help="an engine step running longer turns /health 503 \"stalled\" (default: %(default)g)")
    g.add_argument("--stream-stall-timeout", type=float, default=_S.stream_stall_timeout,
                   help="a stream whose client reads nothing for this long is aborted, its KV freed (default: %(default)g)")
    g.add_argument("--request-timeout", type=float, default=None,
                   help="stop any request running longer than this many seconds (default: no limit)")
    g.add_argument("--header-timeout", type=float, default=_S.header_timeout,
                   help="seconds a client has to send a request's headers (default: %(default)g)")
    g.add_argument("--max-connections", type=int, default=_S.max_connections,
                   help="open HTTP connections; one more is answered 503 and closed (default: %(default)s)")
    g.add_argument("--allow-special-tokens-in-messages", action="store_true",
                   help="let client text in chat requests (content, names, tools) spell control tokens such as <|im_start|> (default: it is text)")
    g.add_argument("--grammar-cache-mib", type=float, default=64.0,
                   help="memory for compiled structured-output grammars kept for reuse, least recently used "
                        "dropped first (default: 64)")
    g.add_argument("--grammar-compile-timeout", type=float, default=_S.grammar_compile_timeout,
                   help="seconds a request waits for its grammar to compile before a 400 (default: %(default)g)")
    g.add_argument("--grammar-compile-memory-mib", type=float, default=_S.grammar_compile_memory_mib,
                   help="memory one grammar compile may take in its process before its request gets a 400 "
                        "(default: %(default)g)")
    g.add_argument("--responses-store-size", type=int, default=_S.responses_store_size,
                   help="finished /v1/responses responses kept in memory for GET and previous_response_id, least "
                        "recently used dropped first; 0 keeps none (default: %(default)s)")
    g.add_argument("--responses-store-mib", type=float, default=_S.responses_store_bytes / (1 << 20),
                   help="memory for those stored responses (their JSON), least recently used dropped first past it "
                        "(default: %(default)g)")
    e = p.add_argument_group("engine")
    e.add_argument("--max-model-len", type=int, default=None, help="context length (default: the model's, within the KV cache)")
    e.add_argument("--threads", type=int, default=None,
                   help="CPU threads for the model's kernels (default: torch's, one per core)")
    e.add_argument("--tensor-parallel-size", "-tp", type=int, default=None,
                   help="split the model's weights and KV cache over N processes on this host (spawned on loopback; "
                        "under torchrun: its WORLD_SIZE); each gets --threads, default the cores / N (default: 1)")
    e.add_argument("--max-num-seqs", type=int, default=64, help="sequences in one engine step (default: 64)")
    e.add_argument("--max-num-batched-tokens", type=int, default=512, help="tokens in one engine step (default: 512)")
    e.add_argument("--kv-cache-gib", type=float, default=None, help="KV cache size (default: a share of free memory)")
    e.add_argument("--kv-cache-dtype", default="auto", choices=("auto", "float32", "bfloat16", "float16", "int8"),
                   help="the KV cache's element type (default: auto: float16 under quantized weights with float32 "
                        "activations, else --dtype; int8: a float16 scale per row, ~1.9x float16's tokens)")
    e.add_argument("--no-prefix-caching", action="store_true", help="do not reuse the KV of shared prompt prefixes")
    e.add_argument("--kv-disk-path", default=None, metavar="DIR",
                   help="keep prefix KV blocks evicted from RAM in this directory and read them back on later hits, "
                        "across restarts (default: off)")
    e.add_argument("--kv-disk-gib", type=float, default=None,
                   help="the disk tier's bound; the least recently used blocks are deleted past it (default: 4)")
    e.add_argument("--seed", type=int, default=None, help="seed of the engine's shared random generator")
    e.add_argument("--speculative", default=None, choices=("ngram", "draft"),
                   help="speculative decoding: ngram drafts tokens by prompt lookup (the tokens that followed the "
                        "latest n-gram earlier in the prompt or output), draft by a draft model's greedy tokens "
                        "(--draft-model); either is verified in the batch: greedy output is unchanged, sampling "
                        "keeps its distribution; a request opts out with \"speculative\": false (default: off)")
    e.add_argument("--num-speculative-tokens", type=int, default=4,
                   help="the most tokens drafted per sequence per step, with --speculative (default: 4)")
    e.add_argument("--draft-model", default=None, metavar="MODEL",
                   help="with --speculative draft: the draft model, named as --model is, with the target's "
                        "vocabulary, e.g. smollm2-135m (Q4_1) for --model smollm2-135m --quantize none --dtype float32")
    e.add_argument("--draft-quantize", default="auto", choices=("auto", "none", "q8_0", "q4_0"),
                   help="the draft model's weights, as --quantize (default: auto)")
    e.add_argument("--draft-kv-cache-gib", type=float, default=None,
                   help="the draft model's own KV cache (default: as many tokens as the target's KV cache, and one "
                        "block per sequence more)")
    d = p.add_argument_group("chat and sampling defaults")
    d.add_argument("--chat-template", default=None, metavar="FILE", help="a Jinja chat template file to use instead of the model's")
    d.add_argument("--generation-config", default="auto", choices=("auto", "none"),
                   help="auto: sampling defaults from the model (generation_config.json, GGUF general.sampling.*) when "
                        "it has them, else the server's; none: the server's (default: auto)")
    d.add_argument("--default-sampling", default=None, metavar="JSON",
                   help='override sampling defaults, e.g. \'{"temperature": 0.7, "top_p": 0.95}\'')
    d.add_argument("--max-tokens-default", type=int, default=None,
                   help="max_tokens of a chat request that gives none (default: 1024)")
    j = p.add_argument_group("router")
    j.add_argument("--join", default=None, metavar="ROUTER_URL",
                   help="register with a kvserve router once ready, deregister on drain")
    j.add_argument("--advertise-url", default=None, help="the URL the router should use (default: http://HOST:PORT)")
    j.add_argument("--join-key", default=os.environ.get("KVSERVE_ROUTER_ADMIN_KEY"),
                   help="the router's admin key (default: $KVSERVE_ROUTER_ADMIN_KEY)")
    k = p.add_argument_group("KV events (vLLM's ZMQ wire format, for llm-d and kvserve route)")
    k.add_argument("--kv-events-endpoint", default=None, metavar="ENDPOINT",
                   help="publish KV cache block events on a ZMQ PUB socket: tcp://*:5557 binds every interface, "
                        "tcp://HOST:PORT connects to a subscriber that binds (as vLLM; default: off)")
    k.add_argument("--kv-events-replay-endpoint", default=None, metavar="ENDPOINT",
                   help="a ZMQ ROUTER socket, bound, where subscribers ask for missed batches, e.g. tcp://*:5558")
    k.add_argument("--kv-events-topic", default="", help="the topic frame of every message (default: empty; "
                   "llm-d reads kv@POD@MODEL)")
    k.add_argument("--kv-events-format", default=None, metavar="{array,map}",
                   help="array: vLLM's positional events, which llm-d reads; map: vLLM's newer tagged-map events, "
                        "which vllm-router's kv_aware policy reads (default: array; kvserve route reads both)")
    p.add_argument("--no-access-log", action="store_true", help="do not log every HTTP request")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    try:
        import uvicorn
    except ImportError:
        raise ValueError("kvserve serve needs fastapi and uvicorn: pip install fastapi uvicorn prometheus-client") from None

    from kvserve.parallel.group import env_world
    from kvserve.server.app import build_app
    from kvserve.server.lifecycle import EngineServer, exit_now
    from kvserve.web.protocols import h11_options

    world = env_world()
    if world is not None and world[0] > 0:  # torchrun's ranks 1..: a tensor-parallel worker, no server
        from kvserve.parallel.worker import main as worker_main

        return worker_main()
    settings = settings_from_args(args)
    failure: list[BaseException] = []
    server = None

    def on_load_failure(e: BaseException) -> None:
        failure.append(e)
        if server is not None:
            server.should_exit = True

    app = build_app(settings, load=lambda: load_llm(args), on_load_failure=on_load_failure)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_config=None, access_log=not args.no_access_log,
                            timeout_graceful_shutdown=2, server_header=False,
                            **h11_options(settings.header_timeout, settings.max_connections,
                                          logging.getLogger("kvserve.server")))
    server = EngineServer(config, app.state.ctx.state, settings.drain_timeout)
    if args.join:
        from kvserve.server.join import Joiner, advertised_url

        own = advertised_url(args.host, args.port, args.advertise_url)
        local = f"http://127.0.0.1:{args.port}" if args.host in ("0.0.0.0", "::") else settings.url
        Joiner(args.join, own, local, args.join_key).attach(server)
    log.info("kvserve serve: %s at %s/v1 (loading the model; /health answers 503 until ready)",
             settings.model_name, settings.url)
    server.run()
    if failure:
        raise ValueError(f"the model failed to load: {failure[0]}")
    loader = app.state.loader
    if loader is not None and loader.is_alive():  # stopped while loading: torch's threads must not be torn down
        exit_now("stopped while the model was loading")
    return 0


def settings_from_args(args: argparse.Namespace) -> ServerSettings:
    """The checked arguments of `kvserve serve` as the server's settings (a bad one fails here, in
    one line, before the model loads); sets torch's threads from --threads."""
    from kvserve.generation_defaults import MAX_TOKENS_DEFAULT, resolve
    from kvserve.model.loader import resolve_model_path
    from kvserve.web.hosts import parse_allowed_hosts

    if args.model_arg and args.model and args.model_arg != args.model:
        raise ValueError(f"two models given: {args.model_arg!r} and --model {args.model!r}; give one")
    args.model = args.model_arg or args.model or "smollm2-135m"
    from kvserve.parallel.group import env_world

    world = env_world()
    _check_limits(args)
    _check_kv_disk(args)
    _check_kv_events(args)
    tp = args.tensor_parallel_size or (world[1] if world else 1)
    if tp < 1:
        raise ValueError(f"--tensor-parallel-size must be at least 1, got {tp}")
    args.tensor_parallel_size = tp
    if tp > 1:  # what the ranks do not share yet: refused now, in one line, not after the model loads
        unsupported = [flag for flag, on in (("--kv-cache-dtype int8", args.kv_cache_dtype == "int8"),
                                             ("--kv-disk-path", args.kv_disk_path is not None),
                                             ("--speculative", args.speculative is not None)) if on]
        if unsupported:
            raise ValueError(f"--tensor-parallel-size {tp} does not work with {' or '.join(unsupported)} yet: "
                             "leave them out, or serve from one process")
    if args.threads is not None and args.threads < 1:
        raise ValueError(f"--threads must be at least 1, got {args.threads}")
    threads = args.threads or (max(1, (os.cpu_count() or 1) // tp) if tp > 1 and world is None else None)
    if threads is not None:  # (under torchrun OMP_NUM_THREADS, which it sets, decides)
        import torch

        torch.set_num_threads(threads)

    _check_speculative(args)
    path = resolve_model_path(args.model)  # a wrong name fails now, in one line, not after startup
    if args.draft_model is not None:
        resolve_model_path(args.draft_model)
    if args.chat_template is not None:
        from kvserve.tokenizer.chat_template import ChatTemplate

        with open(args.chat_template, encoding="utf-8") as f:
            args.chat_template_source = f.read()
        ChatTemplate(args.chat_template_source)  # one that does not compile fails now
    defaults = resolve(path, args.generation_config, args.default_sampling, args.model)
    log.info("%s; chat max_tokens default %d", defaults.describe(), args.max_tokens_default or MAX_TOKENS_DEFAULT)
    settings = ServerSettings(
        model_name=args.served_model_name or args.model,
        host=args.host,
        port=args.port,
        api_key=args.api_key or None,
        allowed_origins=tuple(o.strip() for o in args.allowed_origins.split(",") if o.strip()),
        allowed_hosts=parse_allowed_hosts(args.allowed_hosts),
        max_queued_requests=args.max_queued_requests,
        max_n=args.max_n,
        max_logprobs=args.max_logprobs,
        max_prompts=args.max_prompts,
        max_request_share=args.max_request_share,
        max_body_bytes=int(args.max_body_mib * (1 << 20)),
        drain_timeout=args.drain_timeout,
        stall_timeout=args.stall_timeout,
        stream_stall_timeout=args.stream_stall_timeout,
        request_timeout=args.request_timeout,
        header_timeout=args.header_timeout,
        max_connections=args.max_connections,
        special_tokens_in_messages=args.allow_special_tokens_in_messages,
        grammar_compile_timeout=args.grammar_compile_timeout,
        grammar_compile_memory_mib=args.grammar_compile_memory_mib,
        sampling_defaults=defaults,
        max_tokens_default=args.max_tokens_default or MAX_TOKENS_DEFAULT,
        responses_store_size=args.responses_store_size,
        responses_store_bytes=int(args.responses_store_mib * (1 << 20)),
        kv_events_endpoint=args.kv_events_endpoint,
        kv_events_replay_endpoint=args.kv_events_replay_endpoint,
        kv_events_topic=args.kv_events_topic,
        kv_events_format=args.kv_events_format or "array",
    )
    return settings


def _check_limits(args: argparse.Namespace) -> None:
    from kvserve.sampling_params import MAX_LOGPROBS

    ranges = {"max_queued_requests": (0, None), "max_n": (1, None), "max_logprobs": (0, MAX_LOGPROBS),
              "max_num_seqs": (1, None), "max_num_batched_tokens": (1, None), "max_body_mib": (0.001, None),
              "drain_timeout": (0, None), "max_prompts": (1, None), "max_request_share": (0.0001, 1),
              "stall_timeout": (0.1, None), "stream_stall_timeout": (0.1, None), "header_timeout": (0.1, None),
              "grammar_compile_timeout": (0.1, None), "grammar_cache_mib": (0, None),
              "grammar_compile_memory_mib": (16, None),
              "max_connections": (1, None), "max_tokens_default": (1, None),
              "responses_store_size": (0, None), "responses_store_mib": (0, None), "num_speculative_tokens": (1, 16)}
    for name, (low, high) in ranges.items():
        value = getattr(args, name)
        if value is None:
            continue
        if value < low or (high is not None and value > high):
            allowed = f"at least {low}" if high is None else f"in [{low}, {high}]"
            raise ValueError(f"--{name.replace('_', '-')} must be {allowed}, got {value}")


def _check_speculative(args: argparse.Namespace) -> None:
    if args.speculative == "draft" and args.draft_model is None:
        raise ValueError("--speculative draft needs --draft-model MODEL: a model with the target's vocabulary "
                         "(an alias, .gguf file or Hugging Face directory)")
    draft_only = [flag for flag, on in (("--draft-model", args.draft_model is not None),
                                        ("--draft-quantize", args.draft_quantize != "auto"),
                                        ("--draft-kv-cache-gib", args.draft_kv_cache_gib is not None)) if on]
    if draft_only and args.speculative != "draft":
        raise ValueError(f"{' and '.join(draft_only)} only work with --speculative draft: add it, or leave them out")
    if args.draft_kv_cache_gib is not None and args.draft_kv_cache_gib <= 0:
        raise ValueError(f"--draft-kv-cache-gib must be > 0, got {args.draft_kv_cache_gib}")


def _check_kv_disk(args: argparse.Namespace) -> None:
    if args.kv_disk_path is None:
        if args.kv_disk_gib is not None:
            raise ValueError("--kv-disk-gib bounds the disk tier: give --kv-disk-path DIR to turn it on")
        return
    if args.no_prefix_caching:
        raise ValueError("the disk tier keeps prefix blocks: drop --no-prefix-caching or --kv-disk-path")
    if args.kv_disk_gib is not None and args.kv_disk_gib <= 0:
        raise ValueError(f"--kv-disk-gib must be > 0, got {args.kv_disk_gib}")


def _check_kv_events(args: argparse.Namespace) -> None:
    """A bad KV events endpoint fails now, in one line, before the model loads."""
    from kvserve.kv.event_wire import FORMATS

    if args.kv_events_format is not None and args.kv_events_format not in FORMATS:
        raise ValueError(f"--kv-events-format must be array (what llm-d reads) or map (what vllm-router's kv_aware "
                         f"reads); got {args.kv_events_format!r}")
    if args.kv_events_endpoint is None:
        if args.kv_events_replay_endpoint is not None:
            raise ValueError("--kv-events-replay-endpoint needs --kv-events-endpoint (the PUB socket it replays)")
        if args.kv_events_format is not None:
            raise ValueError("--kv-events-format needs --kv-events-endpoint (the PUB socket whose events it shapes)")
        return
    from kvserve.server.kv_publisher import binds, check_endpoint

    check_endpoint(args.kv_events_endpoint, "--kv-events-endpoint")
    if args.kv_events_replay_endpoint is not None:
        check_endpoint(args.kv_events_replay_endpoint, "--kv-events-replay-endpoint")
        if not binds(args.kv_events_replay_endpoint):
            raise ValueError("--kv-events-replay-endpoint is bound, so give tcp://*:PORT or ipc://PATH; got "
                             f"{args.kv_events_replay_endpoint!r}")


def load_llm(args: argparse.Namespace) -> LLM:
    from kvserve.config import CacheConfig, SchedulerConfig, SpeculativeConfig
    from kvserve.llm import LLM

    cache = CacheConfig(
        memory_bytes=int(args.kv_cache_gib * (1 << 30)) if args.kv_cache_gib else None,
        enable_prefix_caching=not args.no_prefix_caching,
        dtype=args.kv_cache_dtype,
        disk_path=args.kv_disk_path,
        disk_bytes=int((args.kv_disk_gib or DEFAULT_DISK_GIB) * (1 << 30)),
    )
    sched = SchedulerConfig(max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs)
    spec = None
    if args.speculative:
        draft_kv = int(args.draft_kv_cache_gib * (1 << 30)) if args.draft_kv_cache_gib else None
        spec = SpeculativeConfig(args.speculative, num_speculative_tokens=args.num_speculative_tokens,
                                 draft_model=args.draft_model,
                                 draft_quantization=args.draft_quantize,
                                 draft_kv_cache_bytes=draft_kv)
    llm = LLM(args.model, dtype=args.dtype, quantization=args.quantize, cache=cache, scheduler=sched, max_model_len=args.max_model_len, seed=args.seed,
              batch_invariant=args.batch_invariant, activations=args.activations, speculative=spec, tensor_parallel_size=args.tensor_parallel_size)
    if args.chat_template is not None:
        llm.use_chat_template(args.chat_template_source)
        log.info("chat template: %s", args.chat_template)
    llm.engine.grammars.cache.resize(int(args.grammar_cache_mib * (1 << 20)))
    return llm
