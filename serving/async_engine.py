"""LLMEngine behind asyncio: one background task owns the engine, handlers talk to it through queues.

Handlers `submit` requests and `cancel` them; both only queue a command. The loop task applies the commands
between steps, runs `engine.step()` in a one-thread executor and hands each token to its request's queue. So the
engine is touched by one step at a time and never while a step runs. An abort finishes the sequence through the
scheduler's own release path (its pages and state slot go back), then pops it from the engine.
"""
import asyncio
import contextlib
from concurrent.futures import ThreadPoolExecutor

from serving.engine import LLMEngine, RequestOutput
from serving.sequence import SamplingParams, SequenceStatus


class RequestStream:
    """One request's tokens, as an async iterator; `output` resolves to its RequestOutput when it ends
    (None when it was cancelled before it reached the engine or the engine failed)."""

    def __init__(self, prompt_ids: list[int], params: SamplingParams):
        self.prompt_ids, self.params = prompt_ids, params
        self.seq_id: int | None = None
        self.cancelled = False
        self.queue: asyncio.Queue = asyncio.Queue()
        self.output: asyncio.Future = asyncio.get_running_loop().create_future()

    @property
    def done(self) -> bool:
        return self.output.done()

    async def __aiter__(self):
        while (item := await self.queue.get()) is not None:
            if isinstance(item, Exception):
                raise item
            yield item

    def finish(self, output: RequestOutput | None) -> None:
        if not self.done:
            self.output.set_result(output)
            self.queue.put_nowait(None)

    def fail(self, error: Exception) -> None:
        if not self.done:
            self.output.set_result(None)
            self.queue.put_nowait(error)


class AsyncEngine:
    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self._adds: list[RequestStream] = []
        self._aborts: list[RequestStream] = []
        self._live: dict[int, RequestStream] = {}
        self._wake = asyncio.Event()
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="engine-step")
        self._task: asyncio.Task | None = None

    async def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        self._executor.shutdown(wait=True)

    def submit(self, prompt_ids: list[int], params: SamplingParams) -> RequestStream:
        stream = RequestStream(prompt_ids, params)
        self._adds.append(stream)
        self._wake.set()
        return stream

    def cancel(self, stream: RequestStream) -> None:
        """Abort the request at the next step boundary; a no-op once it has ended."""
        if not stream.done and not stream.cancelled:
            stream.cancelled = True
            self._aborts.append(stream)
            self._wake.set()

    async def abort(self, stream: RequestStream) -> RequestOutput | None:
        """Cancel and wait: the RequestOutput as far as it got (or as it ended, if it ended first)."""
        self.cancel(stream)
        return await stream.output

    # ---- the loop task -----------------------------------------------------------------------------------

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            self._apply_commands()
            if not self.engine.has_unfinished:
                self._wake.clear()
                await self._wake.wait()
                continue
            try:
                outputs = await loop.run_in_executor(self._executor, self.engine.step)
            except Exception as error:  # the engine failed: end every request with the error, keep serving
                self._fail_all(error)
                continue
            for out in outputs:
                self._dispatch(out.seq_id, out.token, out.finished)

    def _apply_commands(self) -> None:
        adds, self._adds = self._adds, []
        for stream in adds:
            if stream.cancelled:
                stream.finish(None)
                continue
            try:
                stream.seq_id = self.engine.add_request(stream.prompt_ids, stream.params)
            except ValueError as error:
                stream.fail(error)
                continue
            self._live[stream.seq_id] = stream
        aborts, self._aborts = self._aborts, []
        for stream in aborts:
            if self._live.pop(stream.seq_id, None) is not None:
                stream.finish(self._abort_sequence(stream.seq_id))

    def _dispatch(self, seq_id: int, token: int, finished: bool) -> None:
        stream = self._live.get(seq_id)
        if stream is None:
            return
        stream.queue.put_nowait(token)
        if finished:
            del self._live[seq_id]
            stream.finish(self.engine.pop_output(seq_id))

    def _abort_sequence(self, seq_id: int) -> RequestOutput:
        """Finish a running or waiting sequence now, releasing its pages and slot, and pop it."""
        seq = self.engine.sequences[seq_id]
        scheduler = self.engine.scheduler
        if seq.status is SequenceStatus.RUNNING:
            scheduler.finish(seq, "abort")
        elif seq.status is SequenceStatus.WAITING:
            scheduler.waiting.remove(seq)
            seq.status, seq.finish_reason = SequenceStatus.FINISHED, "abort"
        return self.engine.pop_output(seq_id)

    def _fail_all(self, error: Exception) -> None:
        live, self._live = self._live, {}
        for seq_id, stream in live.items():
            with contextlib.suppress(Exception):  # best effort: the engine is already in trouble
                self._abort_sequence(seq_id)
            stream.fail(error)
