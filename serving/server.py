"""An OpenAI-compatible HTTP server on aiohttp: `python -m serving.server --model PRESET|PATH [--host 127.0.0.1]
[--port 8000] [--device auto|cpu|cuda] [--max-model-len N] [--kv-tokens N] [--gpu-memory-utilization F] [--eager]
[--max-num-seqs N] [--api-key KEY] [--max-body-bytes N] [--max-queued N] [--served-model-name NAME] [--tp N]`.

--tp N: tensor parallel over N processes (GPUs cuda:0..N-1 with NCCL, or CPU processes with gloo); this process
is rank 0 (scheduler and HTTP), it spawns ranks 1..N-1 (serving.tp_worker). NCCL_NVLS_ENABLE=0 in every process.

On a CUDA device the KV pool takes --gpu-memory-utilization of the card; on the CPU it holds --kv-tokens.

GET /v1/models, POST /v1/completions and POST /v1/chat/completions, with SSE streaming; GET /health (no key
needed) and GET /metrics (Prometheus text). The wire format lives in serving.openai_protocol, the engine loop in
serving.async_engine, the metrics in serving.metrics.

Safe by default: it binds 127.0.0.1 unless --host says otherwise; with --api-key (or FA4_API_KEY) every route
but /health needs `Authorization: Bearer KEY` (else 401); a body over --max-body-bytes gets 413; when
--max-queued requests already wait for admission, a new one gets 429 with Retry-After. Bad requests get 4xx
with OpenAI's error JSON and the server keeps serving. A client that goes away mid-request has its request
aborted in the engine (its pages freed); a request that fails inside the engine fails alone (500, or an error
event in its stream).
"""
import asyncio
import hmac
import json
import logging
import os
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import torch
from aiohttp import web
from aiohttp.web_protocol import RequestPayloadError

from model import ops
from model.load import describe_model, load_model
from model.tokenizer import QwenTokenizer, tokenizer_for_model
from serving import cli, tp_worker
from serving.async_engine import AsyncEngine, EngineFailure, RequestRejected, RequestStream
from serving.config import EngineConfig
from serving.device import pick_device
from serving.engine import LLMEngine
from serving.metrics import ServingMetrics
from serving.openai_protocol import (
    ApiError,
    ChatDeltas,
    Detokenizer,
    GenerationRequest,
    ResponseHeader,
    ServedModel,
    chat_choice,
    chat_chunk_choice,
    chat_message,
    completion_choice,
    parse_chat,
    parse_completion,
    usage,
)

log = logging.getLogger(__name__)

DEFAULT_MAX_BODY_BYTES = 16 * 2**20
DEFAULT_MAX_QUEUED = 256
RETRY_AFTER_S = 1
# the CPU's snapshot pool: two snapshots a request (its prompt's end, its answer's end) for 64 recent requests
CPU_SNAPSHOT_SLOTS = 128
UNHEALTHY_FAILURES = 3  # failed engine steps in a row that make /health answer 503
CLIENT_CHECK_S = 0.5  # how often a request that gets no tokens (queued, or a long prefill) checks its client


@dataclass(frozen=True)
class Limits:
    """The server's safety settings: an API key (None: open), the largest request body, the longest queue."""
    api_key: str | None = None
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    max_queued: int = DEFAULT_MAX_QUEUED


@dataclass
class ServerState:
    engine: AsyncEngine
    tokenizer: QwenTokenizer
    served: ServedModel
    limits: Limits
    metrics: ServingMetrics


STATE = web.AppKey("state", ServerState)
METRICS = web.AppKey("metrics", ServingMetrics)


class ClientGone(Exception):
    """The client closed its connection before the answer was ready."""


@dataclass(frozen=True)
class Finished:
    """The end of a generation: its finish reason and usage."""
    reason: str
    usage: dict


# ---- generation shared by both endpoints ---------------------------------------------------------------------


def client_gone(request: web.Request) -> bool:
    transport = request.transport
    return transport is None or transport.is_closing()


async def generate_text(request: web.Request, req: GenerationRequest, stream: RequestStream) -> AsyncIterator:
    """Text deltas of the request's tokens, then a Finished. A stop string ends the request in the engine with
    reason "stop" (the text stops before it); a client that went away (seen at each token, and every
    CLIENT_CHECK_S while none comes, e.g. in the queue) aborts it (ClientGone)."""
    state = request.app[STATE]
    detok, count = Detokenizer(state.tokenizer, req.params.stop, req.params.stop_token_ids), 0
    try:
        while True:
            try:
                token = await stream.next_token(CLIENT_CHECK_S)
            except TimeoutError:
                token = ...  # nothing yet: only check the client
            if client_gone(request):
                state.engine.cancel(stream)
                raise ClientGone
            if token is None:
                break
            if token is ...:
                continue
            count += 1
            if text := detok.push(token):
                yield text
            if detok.stopped:
                output = await state.engine.abort(stream, "stop")
                cached = output.cached_tokens if output else 0
                yield Finished("stop", usage(len(req.prompt_ids), count, cached))
                return
    except RequestRejected as error:
        raise ApiError(str(error), "prompt") from None
    if text := detok.flush():
        yield text
    output = stream.output.result()
    reason = "stop" if detok.stopped else output.finish_reason
    yield Finished(reason, usage(output.prompt_tokens, len(output.output_ids), output.cached_tokens))


async def sse(request: web.Request) -> web.StreamResponse:
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await response.prepare(request)
    return response


async def send(response: web.StreamResponse, body: dict | str) -> None:
    data = body if isinstance(body, str) else json.dumps(body, ensure_ascii=False)
    await response.write(f"data: {data}\n\n".encode())


async def serve_generation(request: web.Request, req: GenerationRequest, respond) -> web.StreamResponse:
    """Submit req (or refuse it with 429 when the queue is full), let `respond(items)` answer from the text
    items, and abort the request if that ends early for any reason."""
    state = request.app[STATE]
    if state.engine.num_queued >= state.limits.max_queued:
        raise ApiError(f"{state.engine.num_queued} requests are already waiting; retry later", status=429,
                       kind="rate_limit_error", code="queue_full", headers={"Retry-After": str(RETRY_AFTER_S)})
    stream = state.engine.submit(req.prompt_ids, req.params, req.cache_point)
    try:
        return await respond(generate_text(request, req, stream))
    finally:
        state.engine.cancel(stream)


async def first_then_rest(items: AsyncIterator) -> AsyncIterator:
    """items, with the first one already awaited: a request that fails before its first token (rejected by
    the engine, or failed in it) still gets a plain HTTP error instead of a broken stream."""
    first = await anext(items)

    async def rest():
        yield first
        async for item in items:
            yield item

    return rest()


async def stream_events(request: web.Request, items: AsyncIterator, write_events) -> web.StreamResponse:
    """Open the SSE response once the first item is there, then let write_events(response, items) fill it;
    an engine failure mid-stream becomes an error event (OpenAI clients raise it) and ends the stream."""
    items = await first_then_rest(items)
    response = await sse(request)
    try:
        await write_events(response, items)
    except (ClientGone, ConnectionResetError):
        raise
    except Exception as error:  # the headers are sent: the failure becomes the stream's last event
        if not isinstance(error, EngineFailure):
            log.exception("stream failed")
        message = str(error) if isinstance(error, EngineFailure) else f"internal error: {error!r}"
        await send(response, ApiError(message, status=500, kind="server_error").body())
        await response.write_eof()
    return response


# ---- endpoints -------------------------------------------------------------------------------------------------


async def list_models(request: web.Request) -> web.Response:
    served = request.app[STATE].served
    card = {"id": served.name, "object": "model", "created": 0, "owned_by": "fa4-agent",
            "max_model_len": served.max_model_len}
    return web.json_response({"object": "list", "data": [card]})


async def health(request: web.Request) -> web.Response:
    """200 while the engine loop runs and its steps succeed; 503 when it stopped, or when its last
    UNHEALTHY_FAILURES steps all failed (e.g. a broken device), until a step succeeds again."""
    state = request.app.get(STATE)
    if state is None or not state.engine.running:
        return web.json_response({"status": "engine stopped"}, status=503)
    if state.engine.consecutive_failures >= UNHEALTHY_FAILURES:
        return web.json_response({"status": "engine failing",
                                  "consecutive_failed_steps": state.engine.consecutive_failures}, status=503)
    return web.json_response({"status": "ok"})


async def metrics(request: web.Request) -> web.Response:
    state = request.app[STATE]
    return web.Response(body=state.metrics.render(state.engine.stats).encode(),
                        headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})


async def completions(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    req = parse_completion(await read_json(request), state.tokenizer, state.served)
    header = ResponseHeader.new("cmpl", state.served.name)

    async def respond(items: AsyncIterator) -> web.StreamResponse:
        if not req.stream:
            texts = [item async for item in items]
            end = texts.pop()
            return web.json_response(header.wrap("text_completion", [completion_choice("".join(texts), end.reason)],
                                                 end.usage))

        async def write_events(response: web.StreamResponse, items: AsyncIterator) -> None:
            async for item in items:
                finished = isinstance(item, Finished)
                choice = completion_choice("", item.reason) if finished else completion_choice(item, None)
                await send(response, header.wrap("text_completion", [choice]))
            await finish_stream(response, header, "text_completion", item.usage if req.include_usage else None)

        return await stream_events(request, items, write_events)

    return await serve_generation(request, req, respond)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    req = parse_chat(await read_json(request), state.tokenizer, state.served)
    header = ResponseHeader.new("chatcmpl", state.served.name)

    async def respond(items: AsyncIterator) -> web.StreamResponse:
        if not req.stream:
            texts = [item async for item in items]
            end = texts.pop()
            message, called = chat_message("".join(texts), req.tools, req.enable_thinking)
            choice = chat_choice(message, "tool_calls" if called else end.reason)
            return web.json_response(header.wrap("chat.completion", [choice], end.usage))
        return await stream_events(request, items, lambda response, items: write_chat(response, req, header, items))

    return await serve_generation(request, req, respond)


async def write_chat(response: web.StreamResponse, req: GenerationRequest, header: ResponseHeader,
                     items: AsyncIterator) -> None:
    kind, deltas = "chat.completion.chunk", ChatDeltas(req.tools, req.enable_thinking)
    await send(response, header.wrap(kind, [chat_chunk_choice({"role": "assistant", "content": ""})]))
    async for item in items:
        if isinstance(item, Finished):
            break
        for delta in deltas.push(item):
            await send(response, header.wrap(kind, [chat_chunk_choice(delta)]))
    last, called = deltas.finish()
    for delta in last:
        await send(response, header.wrap(kind, [chat_chunk_choice(delta)]))
    await send(response, header.wrap(kind, [chat_chunk_choice({}, "tool_calls" if called else item.reason)]))
    await finish_stream(response, header, kind, item.usage if req.include_usage else None)


async def finish_stream(response: web.StreamResponse, header: ResponseHeader, kind: str, usage_: dict | None) -> None:
    """The usage chunk (no choices) when the client asked for it, then [DONE]."""
    if usage_ is not None:
        await send(response, header.wrap(kind, [], usage_))
    await send(response, "[DONE]")
    await response.write_eof()


# ---- errors, limits and the app --------------------------------------------------------------------------------


async def read_json(request: web.Request):
    try:
        return await request.json()
    except (ValueError, RecursionError, LookupError, RequestPayloadError) as error:
        # ValueError: bad JSON, bad UTF-8, an integer of over 4300 digits; RecursionError: nesting too deep;
        # LookupError: an unknown charset; RequestPayloadError: a body that does not decode (Content-Encoding)
        raise ApiError(f"the request body is not valid JSON ({type(error).__name__})") from None


REJECTION_REASONS = {401: "unauthorized", 413: "too_large", 429: "queue_full"}


def error_response(error: ApiError, request: web.Request) -> web.Response:
    if error.status < 500 and (registry := request.app.get(METRICS)) is not None:
        registry.rejected.inc(label_value=REJECTION_REASONS.get(error.status, "invalid"))
    return web.json_response(error.body(), status=error.status, headers=error.headers)


@web.middleware
async def errors_as_json(request: web.Request, handler):
    try:
        return await handler(request)
    except ApiError as error:
        return error_response(error, request)
    except web.HTTPException as error:
        if error.status < 400:
            raise
        message = error.text if error.status == 413 and error.text else error.reason
        return error_response(ApiError(message, status=error.status, headers={
            k: v for k, v in error.headers.items() if k in ("Allow", "Retry-After")}), request)
    except EngineFailure as error:
        return error_response(ApiError(str(error), status=500, kind="server_error"), request)
    except ClientGone:
        return web.Response(status=499)  # nobody reads it
    except ConnectionResetError:
        raise  # the client went away mid-stream; serve_generation already aborted its request
    except Exception as error:
        log.exception("request failed")
        return error_response(ApiError(f"internal error: {error!r}", status=500, kind="server_error"), request)


def limits_middleware(limits: Limits):
    """The API key (every route but /health) and the body size, checked before a handler reads anything."""
    expected = f"Bearer {limits.api_key}".encode() if limits.api_key else None

    @web.middleware
    async def check_limits(request: web.Request, handler):
        if expected is not None and request.path != "/health":
            given = request.headers.get("Authorization", "").encode("utf-8", "surrogateescape")
            if not hmac.compare_digest(given, expected):
                raise ApiError("a valid API key is needed: send 'Authorization: Bearer <key>'", status=401,
                               code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
        if request.content_length is not None and request.content_length > limits.max_body_bytes:
            raise ApiError(f"the request body has {request.content_length} bytes; the limit is "
                           f"{limits.max_body_bytes}", status=413)
        return await handler(request)

    return check_limits


def create_app(engine: LLMEngine, tokenizer: QwenTokenizer, model_name: str, max_model_len: int,
               limits: Limits = Limits(), aliases: tuple[str, ...] = (),
               workers: tp_worker.WorkerGroup | None = None) -> web.Application:
    """The server around an LLMEngine (whose eos_token_ids should be the tokenizer's); the engine loop starts
    and stops with the app. Prompts plus max_tokens are kept within max_model_len (capped to the engine's
    max_model_len and its KV pool).
    Requests may name the model model_name or one of aliases. workers: the tensor-parallel ranks 1..N-1 (rank 0
    is this process): once the app runs, a worker that dies stops the engine (AsyncEngine.group_failed)."""
    limit = min(max_model_len, engine.cfg.max_model_len, engine.cfg.num_pages * engine.cfg.page_size)
    served = ServedModel(model_name, limit, engine.model.config.vocab_size, aliases)
    registry = ServingMetrics()
    app = web.Application(middlewares=[errors_as_json, limits_middleware(limits)],
                          client_max_size=limits.max_body_bytes)
    app[METRICS] = registry

    async def start(app: web.Application) -> None:
        app[STATE] = ServerState(AsyncEngine(engine, registry), tokenizer, served, limits, registry)
        await app[STATE].engine.start()
        if workers is not None:
            loop, aengine = asyncio.get_running_loop(), app[STATE].engine
            workers.on_failure = lambda error: loop.call_soon_threadsafe(aengine.group_failed, error)
            if workers.failure is not None:  # one died before the handler was in place
                aengine.group_failed(workers.failure)

    async def stop(app: web.Application) -> None:
        await app[STATE].engine.stop()  # a worker that dies meanwhile ends its wait for the step in flight
        if workers is not None:  # the loop closes next: a worker's end is only logged from here on
            workers.on_failure = tp_worker.log_failure

    app.on_startup.append(start)
    app.on_cleanup.append(stop)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/v1/models", list_models)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    return app


@dataclass(frozen=True)
class ServerArgs:
    model: str = "tiny"
    host: str = "127.0.0.1"
    port: int = 8000
    device: str = "auto"
    max_model_len: int | None = None
    kv_tokens: int = 65536
    gpu_memory_utilization: float = 0.85
    state_cache_fraction: float = EngineConfig.state_cache_fraction
    state_cache_gb: float | None = None
    snapshot_slots: int = CPU_SNAPSHOT_SLOTS
    eager: bool = False
    max_num_seqs: int = 8
    api_key: str | None = None
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    max_queued: int = DEFAULT_MAX_QUEUED
    served_model_name: str | None = None
    tp: int = 1
    speculative_tokens: int = 0
    speculative_draft_vocab: int = 0


DESCRIPTION = """\
An OpenAI-compatible HTTP server for a Qwen3.5 model (a checkpoint folder, or a preset with RANDOM weights).

endpoints:
  POST /v1/chat/completions  chat, with tools and SSE streaming
  POST /v1/completions       text completion, with SSE streaming
  GET  /v1/models            the served model
  GET  /health               200 while the engine steps (no API key needed)
  GET  /metrics              Prometheus text

It binds 127.0.0.1 unless --host says otherwise. With --api-key (or $FA4_API_KEY) every route but /health needs
`Authorization: Bearer KEY`.
"""


def parse_args(argv=None) -> ServerArgs:
    ap = cli.Parser(prog=cli.prog("serving.server"), description=DESCRIPTION)
    ap.add_argument("--model", default="tiny", type=cli.model_spec,
                    help="a preset name (random weights) or an HF checkpoint folder")
    ap.add_argument("--host", default="127.0.0.1", help="the address to bind; 127.0.0.1 is loopback only")
    ap.add_argument("--port", type=cli.port, default=8000, help="the TCP port to listen on (1..65535)")
    ap.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                    help="where the model runs; auto: cuda when a GPU is visible, else cpu")
    ap.add_argument("--max-model-len", type=cli.positive_int, help="longest prompt + completion (default: the KV "
                    "pool on the CPU, serving.config.DEFAULT_MAX_MODEL_LEN on a GPU; never past the model's positions)")
    ap.add_argument("--kv-tokens", type=cli.positive_int, default=65536, help="tokens of KV the page pool holds (CPU)")
    ap.add_argument("--gpu-memory-utilization", type=cli.fraction, default=0.85,
                    help="fraction of the card for weights, activations and the KV pool (CUDA), in (0, 1]")
    cli.add_state_cache_args(ap, cpu_slots=CPU_SNAPSHOT_SLOTS)
    ap.add_argument("--eager", action="store_true", help="no CUDA graphs for decode steps")
    ap.add_argument("--max-num-seqs", type=cli.positive_int, default=8, help="requests generated at once")
    ap.add_argument("--api-key", default=None,
                    help="require 'Authorization: Bearer KEY' on every route but /health (default: $FA4_API_KEY)")
    ap.add_argument("--max-body-bytes", type=cli.positive_int, default=DEFAULT_MAX_BODY_BYTES,
                    help="larger request bodies get 413")
    ap.add_argument("--max-queued", type=cli.positive_int, default=DEFAULT_MAX_QUEUED,
                    help="requests that may wait for admission; more get 429 with Retry-After")
    ap.add_argument("--served-model-name", help="the model name of the API (default: the --model name)")
    ap.add_argument("--tp", type=cli.positive_int, default=1,
                    help="tensor-parallel processes (GPUs): this one and N-1 workers")
    cli.add_speculative_args(ap)
    parsed = ap.parse_args(argv)
    cli.check_speculative(ap, parsed)
    args = vars(parsed)
    if args["api_key"] is None:  # read here, not as the default: --help must not print the key
        args["api_key"] = os.environ.get("FA4_API_KEY")
    return ServerArgs(**args)


def engine_config(args: ServerArgs, device: torch.device, eos_token_ids: tuple[int, ...]) -> EngineConfig:
    """The engine's config: on a GPU its KV and snapshot pools sized from memory, on the CPU from --kv-tokens and
    --snapshot-slots."""
    common = dict(max_num_seqs=args.max_num_seqs, eos_token_ids=eos_token_ids, max_model_len=args.max_model_len,
                  cuda_graphs=not args.eager, state_cache_fraction=args.state_cache_fraction,
                  state_cache_gb=args.state_cache_gb, **cli.speculative_fields(args))
    if device.type == "cuda":
        return EngineConfig.for_gpu_memory(args.gpu_memory_utilization, **common)
    return EngineConfig.for_token_budget(args.kv_tokens, snapshot_slots=args.snapshot_slots, **common)


def main(argv=None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO)
    device = pick_device(args.device)
    backend = "triton" if device.type == "cuda" else "reference"
    ops.set_backend(backend)
    tokenizer = tokenizer_for_model(args.model)  # the checkpoint's own chat template when it ships one
    cfg = engine_config(args, device, tokenizer.eos_token_ids)
    tp, workers = None, None
    if args.tp > 1:  # rank 0 here; ranks 1..N-1 in spawned workers that build the same engine
        if device.type == "cuda" and torch.cuda.device_count() < args.tp:
            raise SystemExit(f"--tp {args.tp} needs {args.tp} GPUs; {torch.cuda.device_count()} are visible")
        try:
            tp_worker.check_splits(args.model, args.tp)
        except ValueError as error:
            raise SystemExit(f"--tp {args.tp}: {error}") from None
        # until the app runs, a worker that dies ends this process: it may be blocked in a collective
        tp, workers = tp_worker.launch(args.tp, args.model, device.type, cfg, backend, on_failure=exit_at_startup)
        device = tp_worker.rank_device(device.type, 0)
    model = load_model(args.model, device, tp=tp)
    engine = LLMEngine(model, cfg)
    log.info("compiling the kernels of every step shape (LLMEngine.warm_up)")
    engine.warm_up()
    max_len = args.max_model_len or model.config.max_position_embeddings
    name = args.served_model_name or Path(args.model).name
    limits = Limits(args.api_key, args.max_body_bytes, args.max_queued)
    log.info("serving %s on %s as '%s' at http://%s:%d (API key %s)", describe_model(args.model), device, name,
             args.host, args.port, "required" if args.api_key else "off")
    app = create_app(engine, tokenizer, name, max_len, limits, aliases=(args.model,), workers=workers)
    try:
        web.run_app(app, host=args.host, port=args.port, print=None)
    finally:
        if workers is not None:
            stop_workers(app, engine, workers)


def exit_at_startup(error: Exception) -> None:
    """A tensor-parallel worker died before the server ran: nothing is served yet, and this process may wait in a
    collective for ever, so end it (the other workers die with it: tp_worker.die_with)."""
    log.critical("%s while the server was starting: exiting", error)
    logging.shutdown()
    os._exit(1)


def stop_workers(app: web.Application, engine: LLMEngine, workers: tp_worker.WorkerGroup) -> None:
    """Tensor parallel, at shutdown: stop the workers' loops; after a group failure kill them instead, and end this
    process at once (its step thread may be blocked in a collective, which would hang the interpreter's exit)."""
    state = app.get(STATE)
    if state is None or state.engine.broken is None:
        try:
            engine.close()
            workers.join(timeout=30)
            workers.kill()  # any that did not end
            return
        except RuntimeError as error:
            log.warning("could not stop the tensor-parallel workers cleanly: %s", error)
    log.warning("the tensor-parallel group failed: killing the workers")
    workers.kill()
    workers.join(timeout=30)
    logging.shutdown()
    os._exit(1)


if __name__ == "__main__":
    main()
