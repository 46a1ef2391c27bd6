"""LLMEngine: add requests, step (schedule -> run -> update), read outputs.

Everything about a request is checked in add_request() before any block is allocated (an
InvalidParam naming the parameter: kvserve/engine/input_processor.py); a step then never fails on a request's account, so an
exception out of step() is the engine's own failure. A step that can schedule nothing while
requests wait, with nothing running that could free blocks, raises EngineStalledError instead
of returning nothing forever. Not thread-safe: AsyncEngine owns it from one thread.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

from kvserve.config import SchedulerConfig, SpeculativeConfig
from kvserve.engine.drafter import Drafter
from kvserve.engine.input_processor import InputProcessor
from kvserve.engine.postprocess import append_token, make_output
from kvserve.engine.request import Request, SeqStatus, Sequence
from kvserve.engine.runner import ModelRunner, RunnerOutput
from kvserve.engine.sampler import NO_TOKEN, Sampler
from kvserve.engine.scheduler import Scheduler, SchedulerOutput
from kvserve.engine.speculative import Speculator
from kvserve.engine.timeline import TimelineRecorder
from kvserve.errors import EngineStalledError, InvalidParam, shown
from kvserve.kv.disk_tier import DiskStats
from kvserve.kv.manager import KVCacheManager
from kvserve.outputs import OutputKind, RequestMetrics, RequestOutput
from kvserve.sampling_params import SamplingParams
from kvserve.structured import grammar
from kvserve.tokenizer import IncrementalDetokenizer, Tokenizer


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    kv_blocks_total: int
    kv_blocks_used: int
    prefix_cache_queries: int  # tokens looked up
    prefix_cache_hits: int  # tokens found
    num_preemptions: int
    prompt_tokens: int  # computed prompt tokens (prefix hits excluded)
    generation_tokens: int
    prefix_cache_disk_hits: int = 0  # of prefix_cache_hits, tokens read from the disk tier
    disk: DiskStats | None = None  # the disk tier's counters; None without one
    spec_draft_tokens: int = 0  # drafted tokens verified (speculative decoding)
    spec_accepted_tokens: int = 0  # of which accepted

    @property
    def spec_acceptance_rate(self) -> float:
        return self.spec_accepted_tokens / self.spec_draft_tokens if self.spec_draft_tokens else 0.0

    @property
    def kv_usage(self) -> float:
        return self.kv_blocks_used / self.kv_blocks_total


class LLMEngine:
    def __init__(
        self,
        tokenizer: Tokenizer,
        runner: ModelRunner,
        manager: KVCacheManager,
        scheduler_config: SchedulerConfig,
        vocab_size: int,
        max_model_len: int,
        eos_token_ids: frozenset[int],
        speculative: SpeculativeConfig | None = None,
        drafter: Drafter | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.runner = runner
        self.manager = manager
        # Drafts verified in the batch (engine/speculative.py); None: one token per sequence per step.
        # drafter: None for prompt lookup; a DraftModelDrafter for method "draft" (LLM builds it).
        self.speculator = Speculator(speculative, max_model_len, drafter) if speculative else None
        self.scheduler = Scheduler(scheduler_config, manager, self.speculator)
        self.sampler = runner.sampler
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.eos_token_ids = eos_token_ids
        self.grammars = grammar.GrammarCompiler(tokenizer, vocab_size, eos_token_ids)
        self.inputs = InputProcessor(tokenizer, vocab_size, max_model_len, manager, self.grammars)
        self.requests: dict[str, Request] = {}
        self._generation_tokens = 0
        self.timeline = TimelineRecorder()  # read from other threads through its lock

    def use_tokenizer(self, tokenizer: Tokenizer) -> None:
        """Tokenize and detokenize with `tokenizer` (another chat template); its end-of-turn tokens
        stop generation too."""
        self.tokenizer = tokenizer
        self.eos_token_ids = self.eos_token_ids | tokenizer.eos_token_ids
        self.grammars = grammar.GrammarCompiler(tokenizer, self.vocab_size, self.eos_token_ids)
        self.inputs = InputProcessor(tokenizer, self.vocab_size, self.max_model_len, self.manager, self.grammars)

    # -- admission ------------------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        arrival_time: float | None = None,
        output_kind: OutputKind = OutputKind.CUMULATIVE,
        pooling: bool = False,
        prompt: str | None = None,
    ) -> None:
        """Queue a request: its prompt's token ids (text goes through `self.inputs.process` first),
        checked again here (`InputProcessor.check`: cheap on ids). `prompt`: the text they came
        from, if any, for the outputs. `pooling`: an embedding request (pass params with
        max_tokens=0): its output's `embedding` is the mean of the prompt's final hidden states,
        L2-normalised."""
        if isinstance(prompt_token_ids, str):
            raise TypeError("add_request takes token ids: tokenize text with engine.inputs.process(text, params)")
        if pooling and params.max_tokens != 0:
            raise InvalidParam("max_tokens", "an embedding request generates nothing: max_tokens must be 0")
        if request_id in self.requests:
            raise InvalidParam("request_id", f"request id {shown(request_id)} is already in the engine")
        ids = self.inputs.check(list(prompt_token_ids), params)
        req = Request(
            request_id=request_id,
            prompt=prompt,
            prompt_token_ids=ids,
            params=params,
            metrics=RequestMetrics(arrival_time=arrival_time if arrival_time is not None else time.monotonic()),
            max_output_tokens=params.max_tokens if params.max_tokens is not None else self.max_model_len - len(ids),
            output_kind=output_kind,
            pooling=pooling,
        )
        for i in range(params.n):
            seq = Sequence(
                seq_id=f"{request_id}#{i}",
                index=i,
                request=req,
                token_ids=list(ids),
                num_prompt_tokens=len(ids),
                detokenizer=IncrementalDetokenizer(self.tokenizer, params.skip_special_tokens, prompt_ids=ids),
                generator=Sampler.make_generator(params.seed + i) if params.seed is not None else None,
                matcher=self.grammars.matcher(params.constraint) if params.constraint is not None else None,
            )
            req.seqs.append(seq)
            self.scheduler.add(seq)
        self.requests[request_id] = req
        self.timeline.add(req)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Stop a request and free its blocks; harmless for an unknown or finished one."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return None
        for seq in req.seqs:
            if not seq.finished:
                seq.finish_reason = "abort"
                self._finish(seq)
        req.metrics.finished_time = time.monotonic()
        self.timeline.finish(req)
        return make_output(req, {})

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    # -- the step -------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        planned = time.monotonic()  # scheduling includes drafting (a draft model's forwards)
        sched = self.scheduler.schedule()
        if sched.is_empty:
            if not sched.preempted:  # a step that only preempted may admit next time
                self._check_progress()
            return []
        started = time.monotonic()
        result = self.runner.execute(sched)
        ended = time.monotonic()
        accepted = {seq: v.num_accepted for seq, v in zip(result.spec_seqs, result.verified)}
        self.timeline.step(sched, started, ended, accepted)
        if self.speculator and all(n == 1 + len(sched.drafts.get(seq, ())) for seq, n in sched.scheduled):
            # what a decode step of these rows costs, drafting included
            self.speculator.record_step(sched.num_tokens, ended - planned)
        self.scheduler.update(sched, accepted)
        return self._update(result, sched)

    def _update(self, result: RunnerOutput, sched: SchedulerOutput) -> list[RequestOutput]:
        """Collect prompt outputs, append each sampled token, finish what stopped (a prefill-only
        request once its prompt is computed), and snapshot the requests that changed."""
        now = time.monotonic()
        touched: dict[str, dict[Sequence, int]] = {}
        for po in result.prompt_outputs:
            po.seq.request.add_prompt_outputs(po.logprobs, po.hidden_sum)
        for seq, _ in sched.scheduled:
            if not seq.prompt_done:
                continue
            req = seq.request
            if seq.wants_prompt_outputs:
                req.finish_prompt_outputs()
            if req.prefill_only and not seq.finished:
                seq.finish_reason = "length"  # as max_tokens ends any request
                seq.text += seq.detokenizer.flush()
                self._finish(seq)
                touched.setdefault(req.request_id, {})[seq] = 0
        for seq, v in zip(result.spec_seqs, result.verified):
            if self.speculator is not None:  # (drafts come from it)
                self.speculator.observe(seq, len(sched.drafts[seq]), v.num_accepted)
            got = 0
            for token, lp in zip(v.token_ids, v.logprobs):  # one at a time: a stop ends the run there
                append_token(seq, token, lp, self.eos_token_ids, self.max_model_len, now)
                got += int(token != NO_TOKEN)
                if seq.finish_reason:
                    break
            self._generation_tokens += got
            if seq.finish_reason:
                self._finish(seq)
            touched.setdefault(seq.request.request_id, {})[seq] = got
        for seq, token, lp in zip(result.seqs, result.token_ids, result.logprobs):
            got = 0  # none when the logits were not finite, or the grammar refused the token
            if token == NO_TOKEN or grammar.advance(seq, token):
                append_token(seq, token, lp, self.eos_token_ids, self.max_model_len, now)
                got = int(token != NO_TOKEN)
            if not seq.finish_reason and grammar.stuck(seq):
                seq.finish_reason = grammar.FINISH_REASON
            self._generation_tokens += got
            if seq.finish_reason:
                self._finish(seq)
            touched.setdefault(seq.request.request_id, {})[seq] = got
        outputs = []
        for rid, new in touched.items():
            req = self.requests[rid]
            if req.finished:
                req.metrics.finished_time = now
                del self.requests[rid]
                self.timeline.finish(req)
            elif req.output_kind is OutputKind.FINAL_ONLY:
                continue
            outputs.append(make_output(req, new))
        return outputs

    def _check_progress(self) -> None:
        if not self.scheduler.stalled():
            return
        pool = self.manager.pool
        head = self.scheduler.waiting[0]
        raise EngineStalledError(
            f"no request can run: the next one needs up to {self.manager.blocks_needed(len(head.token_ids))} KV "
            f"blocks but only {pool.num_free_blocks} of {pool.num_blocks} are free, and the other "
            f"{pool.num_used_blocks} are held outside the engine's requests (e.g. by LLM.prefill caches): "
            "close those first"
        )

    def _finish(self, seq: Sequence) -> None:
        seq.status = SeqStatus.FINISHED
        self.scheduler.remove(seq)
        if self.speculator:
            self.speculator.forget(seq)

    def stats(self) -> EngineStats:
        pool = self.manager.pool
        ps = self.manager.prefix_stats
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            kv_blocks_total=pool.num_blocks,
            kv_blocks_used=pool.num_used_blocks,
            prefix_cache_queries=ps.queries,
            prefix_cache_hits=ps.hits,
            num_preemptions=self.scheduler.num_preemptions,
            prompt_tokens=self.scheduler.num_prompt_tokens_computed,
            generation_tokens=self._generation_tokens,
            prefix_cache_disk_hits=ps.disk_hits,
            disk=self.manager.disk.stats() if self.manager.disk is not None else None,
            spec_draft_tokens=self.speculator.num_drafted if self.speculator else 0,
            spec_accepted_tokens=self.speculator.num_accepted if self.speculator else 0,
        )
