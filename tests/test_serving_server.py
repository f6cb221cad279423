"""The OpenAI-compatible server on the `tiny` preset (random weights, CPU), driven by the real openai client over
a socket: greedy text equals the model's own greedy decode, streaming equals non-streaming, usage reports prefix
cache hits, stop strings, stop token ids and ignore_eos hold, `<tool_call>` output becomes tool_calls (the model's
tokens scripted), bad requests get 4xx with OpenAI's error JSON, and an aborted stream leaks no KV pages.
tests/test_serving_faults.py has the bad input and fault tests."""
import asyncio
import json
import threading
import time
from collections import Counter
from dataclasses import dataclass

import httpx
import openai
import pytest
import torch
from aiohttp import web

from model.generate import greedy
from model.model import Qwen35ForCausalLM
from model.tokenizer import QwenTokenizer, load_tokenizer
from serving.async_engine import AsyncEngine
from serving.config import EngineConfig
from serving.engine import LLMEngine
from serving.openai_protocol import ChatDeltas, Detokenizer, MarkerSplitter, chat_message
from serving.sequence import SamplingParams
from serving.server import create_app

MAX_MODEL_LEN = 1024
TOOLS = [{"type": "function", "function": {
    "name": "read_file", "description": "Read a file.",
    "parameters": {"type": "object", "properties": {"path": {"type": "string"}, "lines": {"type": "integer"}}}}}]


@dataclass
class Server:
    url: str
    engine: LLMEngine
    model: Qwen35ForCausalLM
    tokenizer: QwenTokenizer

    @property
    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key="x", max_retries=0)


@pytest.fixture(scope="module")
def server():
    model = Qwen35ForCausalLM.from_preset("tiny", seed=0)
    tokenizer = load_tokenizer()
    cfg = EngineConfig(num_pages=64, page_size=16, max_num_seqs=4, snapshot_slots=8,
                       eos_token_ids=tokenizer.eos_token_ids)
    engine = LLMEngine(model, cfg)
    loop = asyncio.new_event_loop()
    runner = web.AppRunner(create_app(engine, tokenizer, "tiny", MAX_MODEL_LEN))
    loop.run_until_complete(runner.setup())
    loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", 0).start())
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    yield Server(f"http://127.0.0.1:{runner.addresses[0][1]}", engine, model, tokenizer)
    asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result()
    loop.call_soon_threadsafe(loop.stop)
    thread.join()


def greedy_text(server: Server, prompt_ids: list[int], n: int) -> str:
    tokens = greedy(server.model, torch.tensor([prompt_ids]), n)[0].tolist()
    return server.tokenizer.decode(t for t in tokens if t not in server.tokenizer.eos_token_ids)


def wait_idle_and_check_no_leak(engine: LLMEngine, timeout: float = 10.0) -> float:
    """Seconds until the engine had no work; then every page and running slot is back."""
    start = time.perf_counter()
    while engine.scheduler.has_work or engine.sequences:
        assert time.perf_counter() - start < timeout, "the engine still has work"
        time.sleep(0.01)
    bm = engine.block_manager
    assert all(r == 0 for r in bm.refcount)
    assert len(bm.free_pages) + len(bm.evictable) == engine.cfg.num_pages
    assert len(engine.scheduler.free_state_slots) == engine.cfg.max_num_seqs
    return time.perf_counter() - start


# ---- over the wire ---------------------------------------------------------------------------------------------


def test_models_list(server):
    models = server.client.models.list().data
    assert [m.id for m in models] == ["tiny"]


def test_metrics_report_running_and_snapshot_slots_apart(server):
    assert server.client.completions.create(model="tiny", prompt="ok", max_tokens=1).usage  # the stats refresh
    reply = httpx.get(server.url + "/metrics")
    assert reply.status_code == 200
    series = dict(line.rsplit(" ", 1) for line in reply.text.splitlines() if line and not line.startswith("#"))
    # the fixture's engine: max_num_seqs 4, snapshot_slots 8 (and the pools' one padding slot, in neither)
    assert float(series["fa4_state_slots_total"]) == 4 and float(series["fa4_state_snapshot_slots_total"]) == 8
    assert "# TYPE fa4_state_snapshot_slots_total gauge" in reply.text
    assert "running_slots 4, snapshot_slots 8" in server.engine.pool_summary  # as the start-up log says


def test_completion_equals_greedy_and_streaming_equals_it(server):
    prompt = server.tokenizer.encode("The quick brown fox")
    want = greedy_text(server, prompt, 12)
    args = dict(model="tiny", prompt=prompt, max_tokens=12, temperature=0, extra_body={"ignore_eos": True})
    out = server.client.completions.create(**args)
    assert out.choices[0].text == want
    assert out.choices[0].finish_reason == "length"
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (len(prompt), 12)
    chunks = list(server.client.completions.create(**args, stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == want
    assert chunks[-1].usage.completion_tokens == 12
    text_prompt = server.client.completions.create(**{**args, "prompt": "The quick brown fox"})
    assert text_prompt.choices[0].text == want
    wait_idle_and_check_no_leak(server.engine)


def test_ignore_eos_gives_exactly_max_tokens_and_a_seed_repeats_a_sample(server):
    args = dict(model="tiny", prompt="Hello", max_tokens=7, temperature=0.8, top_p=0.95, seed=3,
                extra_body={"ignore_eos": True, "top_k": 50})
    out = server.client.completions.create(**args)
    assert out.usage.completion_tokens == 7 and out.choices[0].finish_reason == "length"
    assert server.client.completions.create(**args).choices[0].text == out.choices[0].text


def test_stop_string_truncates_and_finishes(server):
    prompt = server.tokenizer.encode("Once upon a time")
    full = greedy_text(server, prompt, 24)
    stop = full[len(full) // 2:len(full) // 2 + 3]
    for stream in (False, True):
        out = server.client.completions.create(model="tiny", prompt=prompt, max_tokens=24, temperature=0,
                                               stop=[stop], stream=stream, extra_body={"ignore_eos": True})
        chunks = list(out) if stream else [out]
        text = "".join(c.choices[0].text for c in chunks)
        assert text == full[:full.index(stop)]
        assert chunks[-1].choices[0].finish_reason == "stop"
    wait_idle_and_check_no_leak(server.engine)


def test_chat_streaming_equals_non_streaming_and_reuses_the_prefix_cache(server):
    messages = [{"role": "system", "content": "You are a careful coding agent. " * 8},
                {"role": "user", "content": "List the files of the repository."}]
    args = dict(model="tiny", max_completion_tokens=10, temperature=0, tools=TOOLS, tool_choice="auto")
    first = server.client.chat.completions.create(messages=messages, **args)
    reply = first.choices[0].message
    assert reply.role == "assistant" and first.usage.completion_tokens <= 10
    chunks = list(server.client.chat.completions.create(messages=messages, stream=True, **args,
                                                        stream_options={"include_usage": True}))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed.strip() == (reply.content or "")
    assert chunks[-1].usage.completion_tokens == first.usage.completion_tokens
    follow_up = messages + [{"role": "assistant", "content": reply.content or ""},
                            {"role": "user", "content": "Now read README.md."}]
    second = server.client.chat.completions.create(messages=follow_up, **args)
    assert 0 < second.usage.prompt_tokens_details.cached_tokens < second.usage.prompt_tokens
    wait_idle_and_check_no_leak(server.engine)


def test_stop_string_in_a_chat_stream_and_stop_token_ids(server):
    messages = [{"role": "user", "content": "Tell me about foxes."}]
    prompt = server.tokenizer.apply_chat_template(messages)
    tokens = greedy(server.model, torch.tensor([prompt]), 16)[0].tolist()
    eos = server.tokenizer.eos_token_ids
    full = server.tokenizer.decode(t for t in tokens if t not in eos)
    stop = full[len(full) // 2:len(full) // 2 + 2]
    args = dict(model="tiny", messages=messages, max_tokens=16, temperature=0, extra_body={"ignore_eos": True})
    chunks = list(server.client.chat.completions.create(**args, stop=stop, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks).strip() == full[:full.index(stop)].strip()
    assert chunks[-1].choices[0].finish_reason == "stop"
    at = 5  # the first place of tokens[at]: generation ends there, and its text is not returned
    first = tokens.index(tokens[at])
    out = server.client.completions.create(model="tiny", prompt=prompt, max_tokens=16, temperature=0,
                                           extra_body={"ignore_eos": True, "stop_token_ids": [tokens[at]]})
    assert out.choices[0].finish_reason == "stop" and out.usage.completion_tokens == first + 1
    assert out.choices[0].text == server.tokenizer.decode(t for t in tokens[:first] if t not in eos)
    wait_idle_and_check_no_leak(server.engine)


def script_model_output(engine: LLMEngine, monkeypatch, prompt_ids: list[int], script: list[int]) -> None:
    """The request whose prompt is prompt_ids generates `script` instead of the model's tokens (run it with
    max_tokens=len(script) and ignore_eos, so that the engine ends it where the script does)."""
    real_step = engine.step

    def step():
        outputs = real_step()
        later = Counter(out.seq_id for out in outputs)  # an interleaved step holds several tokens of a sequence
        for out in outputs:
            seq = engine.sequences[out.seq_id]
            later[out.seq_id] -= 1
            if seq.prompt_ids == prompt_ids:
                i = len(seq.output_ids) - 1 - later[out.seq_id]
                seq.output_ids[i] = out.token = script[i]
        return outputs

    monkeypatch.setattr(engine, "step", step)


def test_tool_call_output_becomes_tool_calls(server, monkeypatch):
    tok = server.tokenizer
    messages = [{"role": "user", "content": "What does README.md say?"}]
    body = "\n<function=read_file>\n<parameter=path>\nREADME.md\n</parameter>\n</function>\n"
    script = (tok.encode("Let me look.\n\n") + [tok.encode_special("<tool_call>")] + tok.encode(body)
              + [tok.encode_special("</tool_call>"), tok.im_end_id])
    script_model_output(server.engine, monkeypatch, tok.apply_chat_template(messages, tools=TOOLS), script)
    args = dict(model="tiny", messages=messages, tools=TOOLS, max_tokens=len(script),
                extra_body={"ignore_eos": True})
    client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)

    async def both():  # at once: one batch
        streamed = await client.chat.completions.create(**args, stream=True)
        out, chunks = await asyncio.gather(client.chat.completions.create(**args), collect(streamed))
        await client.close()
        return out, chunks

    async def collect(stream):
        return [chunk async for chunk in stream]

    out, chunks = asyncio.run(both())
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me look."
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id
    assert call.function.name == "read_file" and json.loads(call.function.arguments) == {"path": "README.md"}
    assert "".join(c.choices[0].delta.content or "" for c in chunks).strip() == "Let me look."
    (streamed,) = [tc for c in chunks for tc in c.choices[0].delta.tool_calls or []]
    assert streamed.index == 0 and streamed.function.name == "read_file"
    assert json.loads(streamed.function.arguments) == {"path": "README.md"}
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    wait_idle_and_check_no_leak(server.engine)


def test_chat_thinking_goes_to_reasoning_content(server):
    out = server.client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=5, temperature=0,
        extra_body={"chat_template_kwargs": {"enable_thinking": True}, "ignore_eos": True})
    message = out.choices[0].message.model_dump()
    assert message["reasoning_content"] or message["content"]


@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", b"{not json", None),
    ("/v1/completions", {"model": "tiny", "prompt": [1] * (MAX_MODEL_LEN + 1)}, "prompt"),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": MAX_MODEL_LEN}, "max_tokens"),
    ("/v1/completions", {"model": "tiny", "prompt": [1, 10**9]}, "prompt"),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "temperature": "hot"}, "temperature"),
    ("/v1/completions", {"model": "tiny"}, "prompt"),
    ("/v1/chat/completions", {"model": "tiny", "messages": []}, "messages"),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "wizard", "content": "x"}]}, "messages"),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "n": 2}, "n"),
])
def test_bad_requests_get_400_with_openai_error_json(server, path, body, param):  # more in test_serving_faults
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    response = httpx.post(server.url + path, content=content, headers={"Content-Type": "application/json"})
    assert response.status_code == 400
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["param"] == param
    wait_idle_and_check_no_leak(server.engine)


def test_disconnected_stream_is_aborted_without_leaking_pages(server):
    body = {"model": "tiny", "prompt": "Count to a thousand:", "max_tokens": 900, "stream": True,
            "ignore_eos": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body) as response:
        lines = response.iter_lines()
        assert next(line for line in lines if line).startswith("data: ")
    assert wait_idle_and_check_no_leak(server.engine) < 3.0  # far less than 900 tokens take
    assert server.client.completions.create(model="tiny", prompt="still alive", max_tokens=2).usage


def test_abort_of_running_waiting_and_unsubmitted_requests_frees_everything(server):
    cfg = EngineConfig(num_pages=16, page_size=16, max_num_seqs=1, snapshot_slots=2)
    engine = LLMEngine(server.model, cfg)

    async def run():
        aengine = AsyncEngine(engine)
        await aengine.start()
        params = SamplingParams(max_tokens=50, ignore_eos=True)
        running, waiting = aengine.submit([1, 2, 3], params), aengine.submit([4, 5, 6], params)
        await anext(running.__aiter__())
        assert (await aengine.abort(waiting)).output_ids == []  # one slot: it never ran
        assert (await aengine.abort(running)).finish_reason == "abort"
        assert await aengine.abort(aengine.submit([7], params)) is None  # cancelled before it reached the engine
        await aengine.stop()

    asyncio.run(run())
    wait_idle_and_check_no_leak(engine)


# ---- the text side, on canned output ---------------------------------------------------------------------------

CANNED = ("Let me look.\n<tool_call>\n<function=read_file>\n<parameter=path>\nREADME.md\n</parameter>\n"
          "<parameter=lines>\n20\n</parameter>\n</function>\n</tool_call>")


def test_tool_calls_are_parsed_from_a_whole_text():
    message, called = chat_message(CANNED, TOOLS, enable_thinking=False)
    assert called and message["content"] == "Let me look."
    call = message["tool_calls"][0]["function"]
    assert call["name"] == "read_file" and json.loads(call["arguments"]) == {"path": "README.md", "lines": 20}


def test_tool_calls_and_reasoning_stream_in_pieces():
    deltas = ChatDeltas(TOOLS, enable_thinking=True)
    text = "I should read it.\n</think>\n\n" + CANNED
    out = [d for i in range(0, len(text), 3) for d in deltas.push(text[i:i + 3])]
    last, called = deltas.finish()
    out += last
    assert called
    assert "".join(d.get("reasoning_content", "") for d in out) == "I should read it.\n"
    assert "".join(d.get("content", "") for d in out).strip() == "Let me look."
    (calls,) = [d["tool_calls"] for d in out if "tool_calls" in d]
    assert calls[0]["index"] == 0 and calls[0]["function"]["name"] == "read_file"


def test_marker_splitter_holds_back_a_partial_stop_string():
    splitter = MarkerSplitter(("STOP",))
    assert [splitter.push(p) for p in ("abcST", "O", "xyzS", "TOP tail")] == ["abc", "", "STOxyz", ""]
    assert splitter.found == "STOP" and splitter.rest == " tail"


def test_detokenizer_drops_eos_text():
    tokenizer = load_tokenizer()
    detok = Detokenizer(tokenizer, ())
    ids = tokenizer.encode("héllo") + [tokenizer.im_end_id]
    assert "".join(detok.push(t) for t in ids) + detok.flush() == "héllo"
