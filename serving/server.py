"""An OpenAI-compatible HTTP server on aiohttp: `python -m serving.server --model PRESET|PATH [--host 127.0.0.1]
[--port 8000] [--device auto|cpu|cuda] [--max-model-len N] [--kv-tokens N]`.

GET /v1/models, POST /v1/completions and POST /v1/chat/completions, with SSE streaming. The wire format lives in
serving.openai_protocol, the engine loop in serving.async_engine. Bad requests get status 400 with OpenAI's error
JSON; a client that goes away mid-request has its request aborted in the engine.
"""
import argparse
import json
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

from aiohttp import web

from model import ops
from model.tokenizer import QwenTokenizer, load_tokenizer
from serving.async_engine import AsyncEngine, RequestStream
from serving.config import EngineConfig
from serving.demo import load_model, pick_device
from serving.engine import LLMEngine
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


@dataclass
class ServerState:
    engine: AsyncEngine
    tokenizer: QwenTokenizer
    served: ServedModel


STATE = web.AppKey("state", ServerState)


@dataclass(frozen=True)
class Finished:
    """The end of a generation: its finish reason and usage."""
    reason: str
    usage: dict


# ---- generation shared by both endpoints ---------------------------------------------------------------------


async def generate_text(state: ServerState, req: GenerationRequest, stream: RequestStream) -> AsyncIterator:
    """Text deltas of the request's tokens, then a Finished; a stop string aborts the request in the engine."""
    detok, count = Detokenizer(state.tokenizer, req.stop), 0
    async for token in stream:
        count += 1
        if text := detok.push(token):
            yield text
        if detok.stopped:
            output = await state.engine.abort(stream)
            cached = output.cached_tokens if output else 0
            yield Finished("stop", usage(len(req.prompt_ids), count, cached))
            return
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
    """Submit req, let `respond(stream)` answer, and abort the request if that ends early for any reason."""
    state = request.app[STATE]
    stream = state.engine.submit(req.prompt_ids, req.params)
    try:
        return await respond(stream)
    finally:
        state.engine.cancel(stream)


# ---- endpoints -------------------------------------------------------------------------------------------------


async def list_models(request: web.Request) -> web.Response:
    served = request.app[STATE].served
    card = {"id": served.name, "object": "model", "created": 0, "owned_by": "fa4-agent",
            "max_model_len": served.max_model_len}
    return web.json_response({"object": "list", "data": [card]})


async def completions(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    req = parse_completion(await read_json(request), state.tokenizer, state.served)
    header = ResponseHeader.new("cmpl", state.served.name)

    async def respond(stream: RequestStream) -> web.StreamResponse:
        items = generate_text(state, req, stream)
        if not req.stream:
            texts = [item async for item in items]
            end = texts.pop()
            return web.json_response(header.wrap("text_completion", [completion_choice("".join(texts), end.reason)],
                                                 end.usage))
        response = await sse(request)
        async for item in items:
            finished = isinstance(item, Finished)
            choice = completion_choice("", item.reason) if finished else completion_choice(item, None)
            await send(response, header.wrap("text_completion", [choice]))
        await finish_stream(response, header, "text_completion", item.usage if req.include_usage else None)
        return response

    return await serve_generation(request, req, respond)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    req = parse_chat(await read_json(request), state.tokenizer, state.served)
    header = ResponseHeader.new("chatcmpl", state.served.name)

    async def respond(stream: RequestStream) -> web.StreamResponse:
        items = generate_text(state, req, stream)
        if not req.stream:
            texts = [item async for item in items]
            end = texts.pop()
            message, called = chat_message("".join(texts), req.tools, req.enable_thinking)
            choice = chat_choice(message, "tool_calls" if called else end.reason)
            return web.json_response(header.wrap("chat.completion", [choice], end.usage))
        return await stream_chat(request, req, header, items)

    return await serve_generation(request, req, respond)


async def stream_chat(request: web.Request, req: GenerationRequest, header: ResponseHeader,
                      items: AsyncIterator) -> web.StreamResponse:
    response = await sse(request)
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
    return response


async def finish_stream(response: web.StreamResponse, header: ResponseHeader, kind: str, usage_: dict | None) -> None:
    """The usage chunk (no choices) when the client asked for it, then [DONE]."""
    if usage_ is not None:
        await send(response, header.wrap(kind, [], usage_))
    await send(response, "[DONE]")
    await response.write_eof()


# ---- errors and the app ----------------------------------------------------------------------------------------


async def read_json(request: web.Request):
    try:
        return await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise ApiError("the request body is not valid JSON") from None


@web.middleware
async def errors_as_json(request: web.Request, handler):
    try:
        return await handler(request)
    except ApiError as error:
        return web.json_response(error.body(), status=error.status)
    except web.HTTPException as error:
        if error.status < 400:
            raise
        return web.json_response(ApiError(error.reason, status=error.status).body(), status=error.status)
    except ConnectionResetError:
        raise  # the client went away; serve_generation already aborted its request
    except Exception as error:
        log.exception("request failed")
        return web.json_response(ApiError(f"internal error: {error}", kind="server_error").body(), status=500)


def create_app(engine: LLMEngine, tokenizer: QwenTokenizer, model_name: str, max_model_len: int) -> web.Application:
    """The server around an LLMEngine (whose eos_token_ids should be the tokenizer's); the engine loop starts
    and stops with the app. Prompts plus max_tokens are kept within max_model_len (capped to the KV pool)."""
    pool_tokens = engine.cfg.num_pages * engine.cfg.page_size
    served = ServedModel(model_name, min(max_model_len, pool_tokens), engine.model.config.vocab_size)
    app = web.Application(middlewares=[errors_as_json])

    async def start(app: web.Application) -> None:
        app[STATE] = ServerState(AsyncEngine(engine), tokenizer, served)
        await app[STATE].engine.start()

    async def stop(app: web.Application) -> None:
        await app[STATE].engine.stop()

    app.on_startup.append(start)
    app.on_cleanup.append(stop)
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


def parse_args(argv=None) -> ServerArgs:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="tiny", help="a preset name (random weights) or an HF checkpoint folder")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    ap.add_argument("--max-model-len", type=int, help="longest prompt + completion (default: the KV pool)")
    ap.add_argument("--kv-tokens", type=int, default=65536, help="tokens of KV the page pool holds")
    return ServerArgs(**vars(ap.parse_args(argv)))


def main(argv=None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO)
    device = pick_device(args.device)
    ops.set_backend("triton" if device.type == "cuda" else "reference")
    model, what = load_model(args.model, device)
    tokenizer = load_tokenizer()
    engine = LLMEngine(model, EngineConfig.for_token_budget(args.kv_tokens, eos_token_ids=tokenizer.eos_token_ids))
    max_len = args.max_model_len or model.config.max_position_embeddings
    log.info("serving %s on %s", what, device)
    web.run_app(create_app(engine, tokenizer, Path(args.model).name, max_len), host=args.host, port=args.port)


if __name__ == "__main__":
    main()
