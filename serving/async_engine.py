"""LLMEngine behind asyncio: one background task owns the engine, handlers talk to it through queues.

Handlers `submit` requests and `cancel` them; both only queue a command. The loop task applies the commands
between steps, runs `engine.step()` in a one-thread executor and hands each token to its request's queue. So the
engine is touched by one step at a time and never while a step runs. An abort finishes the sequence through the
scheduler's own release path (its pages and state slot go back), then pops it from the engine.

A step that raises fails only the request that caused it. Every running sequence may then hold a half-updated
GDN state, so all of them are preempted (they are recomputed, mostly from the prefix cache). If more than one
was running, each is then run alone, the others parked outside the scheduler, until it produces a token
(cleared) or its step raises again (it alone fails); then everyone resumes. A request that fails gets an
EngineFailure; the rest never see the fault.
"""
import asyncio
import contextlib
import logging
import time
from concurrent.futures import ThreadPoolExecutor

from serving.engine import LLMEngine, RequestOutput
from serving.metrics import EngineStats, ServingMetrics
from serving.sequence import SamplingParams, SequenceStatus

log = logging.getLogger(__name__)


class RequestRejected(ValueError):
    """The engine refused the request when it was added (it can never fit, or its token ids are bad)."""


class EngineFailure(RuntimeError):
    """The request failed inside the engine."""


class RequestStream:
    """One request's tokens, as an async iterator; `output` resolves to its RequestOutput when it ends
    (None when it was cancelled before it reached the engine, or failed)."""

    def __init__(self, prompt_ids: list[int], params: SamplingParams, cache_point: int = 0):
        self.prompt_ids, self.params, self.cache_point = prompt_ids, params, cache_point
        self.seq_id: int | None = None
        self.cancelled = False
        self.cancel_reason = "abort"
        self.queue: asyncio.Queue = asyncio.Queue()
        self.output: asyncio.Future = asyncio.get_running_loop().create_future()
        self.arrival = time.perf_counter()
        self.last_token_time: float | None = None
        self.num_delivered = 0

    @property
    def done(self) -> bool:
        return self.output.done()

    async def __aiter__(self):
        while (item := await self.next_token()) is not None:
            yield item

    async def next_token(self, timeout: float | None = None) -> int | None:
        """The next token, or None once the request has ended; raises its failure, or TimeoutError when
        nothing came within timeout seconds (the request goes on)."""
        item = self.queue.get_nowait() if not self.queue.empty() else await asyncio.wait_for(self.queue.get(), timeout)
        if isinstance(item, Exception):
            raise item
        return item

    def finish(self, output: RequestOutput | None) -> None:
        if not self.done:
            self.output.set_result(output)
            self.queue.put_nowait(None)

    def fail(self, error: Exception) -> None:
        if not self.done:
            self.output.set_result(None)
            self.queue.put_nowait(error)


class AsyncEngine:
    def __init__(self, engine: LLMEngine, metrics: ServingMetrics | None = None):
        self.engine = engine
        self.metrics = metrics or ServingMetrics()
        self._adds: list[RequestStream] = []
        self._aborts: list[RequestStream] = []
        self._live: dict[int, RequestStream] = {}
        self._wake = asyncio.Event()
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="engine-step")
        self._task: asyncio.Task | None = None
        # fault isolation: sequences under suspicion, the one running alone, the ones parked meanwhile
        self._suspects: list[int] = []
        self._solo: int | None = None
        self._parked: list = []
        self.consecutive_failures = 0  # failed steps since the last good one
        # tensor parallel: a failed step may leave a rank inside a collective the others never join, so the group
        # cannot be trusted again: the loop fails every request and stops (/health: "engine stopped"); the server
        # then kills the workers instead of asking them to stop (asking could hang, with /health still "ok")
        self.broken: Exception | None = None
        self.stats = EngineStats()
        self._refresh_stats()

    async def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        """Stop the loop, wait for the step in flight to end (not for a broken group's: it may never return, and a
        group that breaks meanwhile, group_failed on this loop, ends the wait) and fail what remains."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        drained = asyncio.get_running_loop().run_in_executor(None, self._executor.shutdown)
        while self.broken is None and not drained.done():
            await asyncio.wait([drained], timeout=0.1)
        for stream in [*self._adds, *self._live.values()]:
            stream.fail(EngineFailure("the server is shutting down"))

    @property
    def running(self) -> bool:
        """Whether the loop task is alive."""
        return self._task is not None and not self._task.done()

    @property
    def num_queued(self) -> int:
        """Requests that will wait: those submitted but not yet running (a burst lands in _adds, then in the
        scheduler's waiting list, before a step runs it), less the run slots free for them: the queue that a limit
        bounds."""
        free_slots = max(0, self.engine.cfg.max_num_seqs - self.stats.requests_running)
        return max(0, len(self._adds) + self.stats.requests_waiting - free_slots)

    def submit(self, prompt_ids: list[int], params: SamplingParams, cache_point: int = 0) -> RequestStream:
        """Queue a request (LLMEngine.add_request's arguments) and return its stream."""
        stream = RequestStream(prompt_ids, params, cache_point)
        if self.broken is not None:
            stream.fail(EngineFailure(f"the engine has stopped: {self.broken!r}"))
            return stream
        self._adds.append(stream)
        self._wake.set()
        return stream

    def group_failed(self, error: Exception) -> None:
        """The tensor-parallel group cannot go on (a step failed, or a worker died): fail every request, refuse new
        ones and stop the loop (/health: "engine stopped"). Call it on the loop's thread. The engine's state is
        not touched: its step thread may be blocked in a collective for good."""
        if self.broken is not None:
            return
        log.error("the tensor-parallel group failed (%r): failing every request and stopping", error)
        self.broken = error
        streams, self._adds, self._live = [*self._adds, *self._live.values()], [], {}
        for stream in streams:
            self.metrics.requests.inc(label_value="error")
            stream.fail(EngineFailure(f"the engine has stopped: {error!r}"))
        if self._task is not None and self._task is not asyncio.current_task():
            self._task.cancel()

    def cancel(self, stream: RequestStream, reason: str = "abort") -> None:
        """End the request at the next step boundary with finish reason `reason`; a no-op once it has ended."""
        if not stream.done and not stream.cancelled:
            stream.cancelled, stream.cancel_reason = True, reason
            self._aborts.append(stream)
            self._wake.set()

    async def abort(self, stream: RequestStream, reason: str = "abort") -> RequestOutput | None:
        """Cancel and wait: the RequestOutput as far as it got (or as it ended, if it ended first)."""
        self.cancel(stream, reason)
        return await stream.output

    # ---- the loop task -----------------------------------------------------------------------------------

    async def _run(self) -> None:
        while self.broken is None:
            try:
                await self._iteration()
            except Exception as error:  # noqa: BLE001 - a bug here must not leave requests hanging forever
                log.exception("the engine loop failed; failing every request in flight")
                self._fail_everything(error)

    async def _iteration(self) -> None:
        self._apply_commands()
        self._advance_isolation()
        self._refresh_stats()
        if not self.engine.has_unfinished:
            self._wake.clear()
            await self._wake.wait()
            return
        try:
            outputs = await asyncio.get_running_loop().run_in_executor(self._executor, self.engine.step)
        except Exception as error:  # noqa: BLE001 - one request's fault must not stop the server
            self.consecutive_failures += 1
            if self.engine.link is not None:
                log.error("a tensor-parallel step failed (%r): the ranks may be out of step", error)
                self.group_failed(error)
                return
            self._step_failed(error)
            return
        self.consecutive_failures = 0
        for out in outputs:
            self._dispatch(out.seq_id, out.token, out.finished)
        if self._solo is not None and any(out.seq_id == self._solo for out in outputs):
            self._clear_solo()

    def _apply_commands(self) -> None:
        adds, self._adds = self._adds, []
        for stream in adds:
            if stream.cancelled:
                stream.finish(None)
                continue
            try:
                stream.seq_id = self.engine.add_request(stream.prompt_ids, stream.params, stream.cache_point)
            except Exception as error:  # noqa: BLE001 - a refused request fails alone
                stream.fail(RequestRejected(str(error)))
                continue
            self._live[stream.seq_id] = stream
        aborts, self._aborts = self._aborts, []
        for stream in aborts:
            if self._live.pop(stream.seq_id, None) is not None:
                self._end(stream, self._finish_sequence(stream.seq_id, stream.cancel_reason))

    def _dispatch(self, seq_id: int, token: int, finished: bool) -> None:
        stream = self._live.get(seq_id)
        if stream is None:
            return
        now = time.perf_counter()
        if stream.last_token_time is None:
            self.metrics.ttft.observe(now - stream.arrival)
        else:
            self.metrics.itl.observe(now - stream.last_token_time)
        stream.last_token_time = now
        stream.num_delivered += 1
        self.metrics.generation_tokens.inc()
        stream.queue.put_nowait(token)
        if finished:
            del self._live[seq_id]
            self._end(stream, self.engine.pop_output(seq_id))

    def _end(self, stream: RequestStream, output: RequestOutput) -> None:
        self.metrics.observe_finish(output.finish_reason, output.prompt_tokens, output.cached_tokens,
                                    time.perf_counter() - stream.arrival)
        stream.finish(output)

    def _finish_sequence(self, seq_id: int, reason: str) -> RequestOutput:
        """Finish a running, waiting or parked sequence now, releasing its pages and slot, and pop it."""
        seq = self.engine.sequences[seq_id]
        scheduler = self.engine.scheduler
        if seq.status is SequenceStatus.RUNNING:
            scheduler.finish(seq, reason)
        elif seq.status is SequenceStatus.WAITING:
            if seq in self._parked:
                self._parked.remove(seq)
            else:
                scheduler.waiting.remove(seq)
            seq.status, seq.finish_reason = SequenceStatus.FINISHED, reason
        return self.engine.pop_output(seq_id)

    def _refresh_stats(self) -> None:
        engine = self.engine
        bm, scheduler = engine.block_manager, engine.scheduler
        spec = engine.speculator
        self.stats = EngineStats(
            requests_waiting=len(scheduler.waiting) + len(self._parked),
            requests_running=len(scheduler.running),
            kv_blocks_total=bm.num_pages, kv_blocks_free=bm.num_available_pages, kv_blocks_cached=len(bm.evictable),
            state_slots_total=engine.cfg.max_num_seqs, state_slots_free=len(scheduler.free_state_slots),
            state_snapshot_slots_total=engine.cfg.snapshot_slots,
            state_snapshots=len(engine.state_cache), preemptions=scheduler.num_preemptions,
            draft_tokens=spec.num_verified if spec else 0, accepted_draft_tokens=spec.num_accepted if spec else 0)

    # ---- fault isolation -----------------------------------------------------------------------------------

    def _step_failed(self, error: Exception) -> None:
        self.metrics.engine_failures.inc()
        scheduler = self.engine.scheduler
        suspects = [seq.id for seq in scheduler.running]
        if not suspects and scheduler.waiting:  # the failure came before anything ran: blame the queue's head
            suspects = [scheduler.waiting[0].id]
        log.warning("engine step failed (%d suspect requests): %r", len(suspects), error)
        self._deliver_lost_tokens()
        self._reset_running()
        if self._solo is not None or len(suspects) == 1:
            culprit = self._solo if self._solo is not None else suspects[0]
            self._solo = None
            self._fail_request(culprit, error)
        else:
            self._suspects = [i for i in suspects if i not in self._suspects] + self._suspects
        self._advance_isolation()

    def _deliver_lost_tokens(self) -> None:
        """Tokens a failed step appended before it raised (and requests it finished) still reach their streams."""
        for seq_id, stream in list(self._live.items()):
            seq = self.engine.sequences.get(seq_id)
            if seq is None:
                continue
            for token in seq.output_ids[stream.num_delivered:]:
                self._dispatch(seq_id, token, False)
            if seq.is_finished:
                del self._live[seq_id]
                self._end(stream, self.engine.pop_output(seq_id))

    def _reset_running(self) -> None:
        """Preempt every running sequence: a failed step may have half-updated their GDN states."""
        scheduler = self.engine.scheduler
        for seq in reversed(list(scheduler.running)):  # preempt() queues at the front: keep the oldest first
            with contextlib.suppress(Exception):
                scheduler.preempt(seq)

    def _fail_request(self, seq_id: int, error: Exception) -> None:
        log.error("request %d failed in the engine: %r", seq_id, error)
        self.metrics.requests.inc(label_value="error")
        stream = self._live.pop(seq_id, None)
        if seq_id in self.engine.sequences:
            with contextlib.suppress(Exception):
                self._finish_sequence(seq_id, "error")
            self.engine.sequences.pop(seq_id, None)
        if stream is not None:
            stream.fail(EngineFailure(f"the request failed in the engine: {error!r}"))

    def _advance_isolation(self) -> None:
        """Keep exactly one suspect in the scheduler while any remain; release everyone when none do."""
        scheduler = self.engine.scheduler
        if self._solo is not None and self._solo not in self.engine.sequences:
            self._solo = None  # it ended (aborted, or finished with its first token)
        while self._solo is None and self._suspects:
            seq_id = self._suspects.pop(0)
            if seq_id in self.engine.sequences and not self.engine.sequences[seq_id].is_finished:
                self._solo = seq_id
        if self._solo is None:
            if self._parked:
                scheduler.waiting.extendleft(reversed(self._parked))
                self._parked = []
            return
        for seq in list(scheduler.waiting):  # newcomers and the parked wait until the suspect is judged
            if seq.id != self._solo:
                scheduler.waiting.remove(seq)
                self._parked.append(seq)
        solo = self.engine.sequences[self._solo]
        if solo in self._parked:
            self._parked.remove(solo)
            scheduler.waiting.appendleft(solo)

    def _fail_everything(self, error: Exception) -> None:
        """Last resort: end every request in the engine and every stream, so that the loop can go on."""
        live, self._live = self._live, {}
        self._suspects, self._solo = [], None
        scheduler = self.engine.scheduler
        scheduler.waiting.extend(self._parked)
        self._parked = []
        for seq_id in list(self.engine.sequences):
            with contextlib.suppress(Exception):
                self._finish_sequence(seq_id, "error")
            self.engine.sequences.pop(seq_id, None)
        for stream in live.values():
            self.metrics.requests.inc(label_value="error")
            stream.fail(EngineFailure(f"the engine loop failed: {error!r}"))

    def _clear_solo(self) -> None:
        """The suspect running alone produced a token: it is innocent; park it too and judge the next one."""
        seq = self.engine.sequences.get(self._solo)
        self._solo = None
        if seq is not None and seq.status is SequenceStatus.RUNNING:
            self.engine.scheduler.preempt(seq)
            self.engine.scheduler.waiting.remove(seq)
            self._parked.insert(0, seq)
        self._advance_isolation()
