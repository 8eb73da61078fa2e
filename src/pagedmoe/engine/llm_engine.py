"""The engine: requests in, one step at a time (schedule -> execute -> update), outputs out.

Start-up (config -> ExpertPlan -> model with its experts -> KV cache -> runner) is engine/startup.py.
"""
from __future__ import annotations

import functools
import logging
import time
import weakref
from typing import Optional, Union

import torch

from pagedmoe.chat_template import load_chat_template
from pagedmoe.config import EngineConfig, resolve_model
from pagedmoe.engine.async_step import AsyncScheduling, async_scheduling_applies
from pagedmoe.engine.expert_stats import expert_stats, traffic_summary
from pagedmoe.engine.output import OutputProcessor
from pagedmoe.engine.request import Request, RequestStatus
from pagedmoe.engine.scheduler import ScheduledRequest, Scheduler, SchedulerOutput
from pagedmoe.engine.startup import pick_device, start_engine
from pagedmoe.engine.structured import StructuredOutputs
from pagedmoe.experts.dynamic.start import save_expert_stats
from pagedmoe.generation_config import describe, sampling_defaults
from pagedmoe.oom import DeviceOutOfMemoryError, budget_text
from pagedmoe.sampling_params import RequestOutput, SamplingParams
from pagedmoe.worker.sampler import Sampler, prompt_logprobs

logger = logging.getLogger("pagedmoe")


def _name_oom_at_start(init):
    """LLMEngine.__init__: running out of device memory while starting says what was being built (the loader,
    the KV cache, graph capture name it: pagedmoe/oom.py) and the budget, never a corrupt checkpoint."""
    @functools.wraps(init)
    def wrapper(self, config: EngineConfig) -> None:
        try:
            init(self, config)
        except DeviceOutOfMemoryError as e:
            raise e.with_budget(budget_text(config.gpu_memory_gb, _device_of(config))) from e
        except torch.OutOfMemoryError as e:
            raise DeviceOutOfMemoryError("starting the engine", None, budget_text(
                config.gpu_memory_gb, _device_of(config))) from e
    return wrapper


def _device_of(config: EngineConfig) -> torch.device:
    """The device start-up picked (it ran out of memory there, so picking it again succeeds)."""
    try:
        return pick_device(config.device)
    except ValueError:
        return torch.device("cpu")


class LLMEngine:
    # Out of memory in a step fails that step's requests and the engine serves on (fail_step); the benchmarks
    # turn this off: a run with failed requests measures nothing, so their OOM propagates.
    survive_step_oom = True

    @_name_oom_at_start
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        # the model's generation_config.json (or --generation-config's): read and checked before the long load
        self.default_sampling_params, source = sampling_defaults(
            config.generation_config, config.override_generation_config, resolve_model(config.model))
        chat_template = load_chat_template(config.chat_template)   # a bad file or template: before the load too
        parts = start_engine(config)
        self.model_path, self.hf_config, self.tokenizer = parts.model_path, parts.hf_config, parts.tokenizer
        if chat_template is not None:
            if self.tokenizer is None:
                raise ValueError("--chat-template needs the model's tokenizer; this model was loaded without one")
            self.tokenizer.chat_template = chat_template   # every chat path reads the tokenizer's
        self.device, self.dtype, self.max_model_len = parts.device, parts.dtype, parts.max_model_len
        self.served_model_name = parts.served_model_name
        self.expert_plan = parts.expert_plan
        self.placement_plan = parts.expert_plan.placement_plan   # the planner's, when it chose the placement
        self.host_compression = parts.expert_plan.host_compression
        self.quantized_gemm = parts.expert_plan.quantized_gemm
        self.model, self.activity, self.plan = parts.model, parts.activity, parts.plan
        self.expert_store, self.pager = self.model.expert_store, self.model.pager
        self.kv, self.runner, self.precision = parts.kv, parts.runner, parts.precision
        self.memory = parts.memory   # the process's device memory (worker/device_memory.py); None off CUDA
        if config.expert_stats:
            self._stats_saver = weakref.finalize(self, save_expert_stats, config.expert_stats, self.activity,
                                                 self.precision)
        self.scheduler = Scheduler(self.kv, config.max_num_seqs, config.max_num_batched_tokens, parts.swap)
        self.sampler = Sampler(config.seed, self.device)
        self.outputs = OutputProcessor(self.tokenizer, self.hf_config, self.model_path)
        self.structured = StructuredOutputs(self.tokenizer, self.outputs.eos_token_ids)
        self.requests: dict[str, Request] = {}
        self._generators: dict[str, torch.Generator] = {}
        self.num_steps = 0
        # Wall time of steps that carry prefill tokens vs decode-only steps (each step ends with a sync).
        self.step_time = {"prefill_s": 0.0, "decode_s": 0.0, "prefill_steps": 0, "decode_steps": 0,
                          "decode_tokens": 0, "prefill_tokens": 0}
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        # --async-scheduling (engine/async_step.py): the next step is prepared while this one runs; by default
        # wherever it can take effect (asked for explicitly where it cannot, it fails loudly)
        self._async = AsyncScheduling(self) if async_scheduling_applies(self, config.async_scheduling) else None
        logger.info("async scheduling %s", "on" if self._async is not None else
                    "off" + (" (--no-async-scheduling)" if config.async_scheduling is False else ""))
        if self.default_sampling_params:
            logger.info("default sampling parameters from %s: %s (a request's own values win; "
                        "--generation-config vllm ignores the model's file)", source,
                        describe(self.default_sampling_params))

    # -- requests --------------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: Union[str, list[int], None], params: SamplingParams,
                    prompt_token_ids: Optional[list[int]] = None) -> Request:
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be SamplingParams, got {type(params).__name__}")
        params.validate()
        if params.n != 1:
            raise ValueError("the engine runs one sequence per request: give each of n samples its own request "
                             "(SamplingParams.for_sample; LLM.generate and the server do)")
        if params.prompt_logprobs is not None and self.runner.control is not None:
            raise ValueError("prompt_logprobs is not supported with --tensor-parallel-size > 1 yet")
        if params.logit_bias and max(params.logit_bias) >= self.model.dims.vocab_size:
            raise ValueError(f"logit_bias token ids must be below the vocabulary size {self.model.dims.vocab_size}")
        text = None
        if prompt_token_ids is None:
            if isinstance(prompt, str):
                if self.tokenizer is None:
                    raise ValueError("this model has no tokenizer: pass prompt token ids")
                text = prompt
                prompt_token_ids = self.tokenizer.encode(prompt)
            elif isinstance(prompt, (list, tuple)):
                prompt_token_ids = list(prompt)
            else:
                raise TypeError(f"prompt must be a string or a list of token ids, got {type(prompt).__name__}")
        ids = list(prompt_token_ids)
        if not ids:
            raise ValueError("the prompt is empty")
        vocab = self.model.dims.vocab_size
        bad = [t for t in ids if not isinstance(t, int) or not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token ids out of range [0, {vocab}): {bad[:5]}")
        if len(ids) >= self.max_model_len:
            raise ValueError(f"the prompt has {len(ids)} tokens; with max_model_len={self.max_model_len} it "
                             f"must be at most {self.max_model_len - 1} to leave room for one new token")
        room = self.max_model_len - len(ids)
        max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        request = Request(request_id, ids, params, prompt=text, max_tokens=max_tokens)
        if params.seed is not None:  # before storing anything: a seed torch refuses leaves no trace
            self._generators[request_id] = self.sampler.request_generator(params.seed)
        if params.structured_outputs is not None:
            try:
                self.structured.start(request)  # its matcher (a grammar llguidance cannot build fails here)
            except Exception:
                self._generators.pop(request_id, None)
                raise
        self.requests[request_id] = request
        self.scheduler.add_request(request)
        return request

    def generators_of(self, requests: list[Request]) -> list[Optional[torch.Generator]]:
        """Each request's own sampling generator (seeded), else None."""
        return [self._generators.get(r.request_id) for r in requests]

    def abort_request(self, request_id: str) -> bool:
        request = self.requests.pop(request_id, None)
        if request is None:
            return False
        self.scheduler.finish_request(request, RequestStatus.FINISHED_ABORTED)
        self._forget(request_id)
        return True

    def _forget(self, request_id: str) -> None:
        """A finished request's per-request state: its generator, its structured-outputs entry."""
        self.requests.pop(request_id, None)
        self._generators.pop(request_id, None)
        self.structured.finished(request_id)

    def reset_prefix_cache(self) -> None:
        """Forget the cached prefixes (vLLM's name): later requests compute every token again."""
        self.kv.reset_prefix_cache()

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers (parallel/launch.py); nothing to do on one process. The engine
        runs no step after this."""
        if self.runner.control is not None:
            self.runner.control.close()

    def check_health(self) -> None:
        """RuntimeError when the engine can run no more steps: a tensor-parallel rank has exited (vLLM's name)."""
        if self.runner.control is not None:
            self.runner.control.check()

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    # -- one step --------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        if self._async is not None:
            return self._async.step()
        t0 = time.perf_counter()
        if self.precision is not None:
            self.precision.tick()  # publish / start precision moves between steps (lends KV blocks)
        sched = self.scheduler.schedule()
        if sched.is_empty:
            return []
        try:
            logits, rows = self.runner.execute(sched, self.kv)
            try:
                return self._finish_step(sched, logits, rows)
            finally:
                self.record_step_time(sched, time.perf_counter() - t0)
        except torch.OutOfMemoryError:
            if not self.survive_step_oom:
                raise
            # failed below, once the traceback (and the step's tensors it holds) is gone
        return self.fail_step(sched)

    def fail_step(self, sched) -> list[RequestOutput]:
        """Out of device memory inside a step: the step's requests finish with status "error" and the reason,
        their KV blocks are freed, and the engine serves on (the next step allocates afresh; the memory the
        failed one held is back in torch's pool)."""
        n, tokens = len(sched.scheduled), sched.num_batched_tokens
        what = f"running a step of {n} request{'s' * (n != 1)} ({tokens} token{'s' * (tokens != 1)})"
        error = (f"{DeviceOutOfMemoryError(what)}, "
                 f"{budget_text(self.config.gpu_memory_gb, self.device)}: the step's requests failed (lower "
                 "--max-num-batched-tokens / --max-num-seqs, or raise --gpu-memory-gb)")
        logger.error("%s", error)
        if self.pager is not None:
            self.pager.abort_step()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        now, outputs = time.monotonic(), []
        for s in sched.scheduled:
            request = s.request
            request.error, request.finish_time = error, now
            self.scheduler.finish_request(request, RequestStatus.FINISHED_ERROR)
            self._forget(request.request_id)
            outputs.append(self.outputs.make_output(request))
        return outputs

    def record_step_time(self, sched, seconds: float) -> None:
        st = self.step_time
        if all(s.num_new_tokens == 1 for s in sched.scheduled):
            st["decode_s"] += seconds
            st["decode_steps"] += 1
            st["decode_tokens"] += len(sched.scheduled)
        else:
            st["prefill_s"] += seconds
            st["prefill_steps"] += 1
            st["prefill_tokens"] += sched.num_batched_tokens

    def _finish_step(self, sched, logits, rows) -> list[RequestOutput]:
        logits = self.take_prompt_logprobs(sched, logits, len(rows))
        self.scheduler.update(sched.scheduled)
        self.activity.end_step()
        self.num_steps += 1
        if not rows:
            return []
        sampling = [sched.scheduled[r].request for r in rows]
        masked = self.outputs.mask_min_tokens(logits, sampling)
        logits = self.structured.mask(masked, sampling, logits)   # structured outputs; nothing when none is constrained
        params = [r.params for r in sampling]
        histories = ([(r.prompt_token_ids, r.output_token_ids) for r in sampling]
                     if any(p.penalised for p in params) else None)
        sample = self.sampler.sample(logits, params, self.generators_of(sampling), histories)
        if self.pager is not None:
            self.pager.end_step()  # the sample reached the host: every event of the step is done
        return self.emit(sampling, sample)

    def take_prompt_logprobs(self, sched: SchedulerOutput, logits: torch.Tensor, num_sampling: int) -> torch.Tensor:
        """SamplingParams.prompt_logprobs: the step's logits rows after the sampling ones (ModelRunner.execute) become
        prompt logprob entries of their requests (read back now); the sampling rows' logits are returned."""
        spans = sched.prompt_logprob_spans()
        if not spans:
            return logits
        targets, wants = [], []
        for s, positions in spans:
            targets += s.request.prompt_token_ids[positions.start + 1:positions.stop + 1]
            wants += [s.request.params.prompt_logprobs] * len(positions)
        entries = prompt_logprobs(logits[num_sampling:], targets, wants)
        row = 0
        for s, positions in spans:
            self.outputs.append_prompt_logprobs(s.request, positions.start + 1, entries[row:row + len(positions)])
            row += len(positions)
        return logits[:num_sampling]

    def emit(self, sampling: list[Request], sample) -> list[RequestOutput]:
        """Append each sampled token, check stops, and build the outputs (engine/output.py). Requests that
        finished meanwhile (--async-scheduling: stopped at the step before, or aborted) get nothing."""
        results = []
        now = time.monotonic()
        for i, request in enumerate(sampling):
            if request.is_finished:
                continue
            if request.first_token_time is None:
                # vLLM's prompt_tokens_total: the whole prompt (cached tokens too) once its prefill is done, i.e. at
                # its first token; never for a request aborted or failed before that, nor again after a preemption
                self.prompt_tokens_total += request.num_prompt_tokens
            self.generation_tokens_total += 1
            status = self.outputs.append_token(request, sample.token_ids[i], sample.logprobs[i],
                                               sample.sampled_logprob[i], now)
            if status is not None:
                self.scheduler.finish_request(request, status)
                self._forget(request.request_id)
            elif request.params.output_kind == "final_only":
                continue
            results.append(self.outputs.make_output(request))
        return results

    @torch.inference_mode()
    def score(self, token_ids: list[int]) -> torch.Tensor:
        """Logits [n, V] (float32, on the host) at every position of one sequence, for evaluation.
        Runs alone, outside the scheduler: call it only while no requests are running."""
        if self.has_unfinished_requests():
            raise RuntimeError("score() needs an idle engine")
        if self.runner.control is not None:
            raise ValueError("score() (perplexity) does not support --tensor-parallel-size > 1 yet")
        if not 0 < len(token_ids) <= self.max_model_len:
            raise ValueError(f"score() takes 1..{self.max_model_len} tokens, got {len(token_ids)}")
        req = Request("__score__", list(token_ids), SamplingParams(max_tokens=1))
        if not self.kv.allocate(req.request_id, len(token_ids)):
            raise MemoryError("not enough KV blocks to score this sequence")
        try:
            out = SchedulerOutput([ScheduledRequest(req, len(token_ids), 0)])
            inputs = self.runner.prepare(out, self.kv)
            positions = torch.arange(len(token_ids), device=self.device)
            logits = self.model(inputs.input_ids, inputs.positions, inputs.meta, positions)
            self.activity.end_step()
            return logits.cpu()
        finally:
            self.kv.free(req.request_id)

    def get_stats(self) -> dict:
        return {
            "num_requests_running": self.scheduler.num_running,
            "num_requests_waiting": self.scheduler.num_waiting,
            "kv_cache_usage_perc": self.kv.usage(),
            "num_kv_blocks": self.kv.num_blocks,
            "num_free_kv_blocks": self.kv.num_free_blocks,
            "num_preemptions_total": self.scheduler.num_preemptions_total,
            "num_swapped_preemptions_total": self.scheduler.num_swapped_total,
            "num_requests_swapped": self.scheduler.swap.num_swapped if self.scheduler.swap is not None else 0,
            "swap_space_usage_perc": self.scheduler.swap.usage() if self.scheduler.swap is not None else 0.0,
            "prefix_cache_queries_total": self.kv.prefix_cache_queries,
            "prefix_cache_hits_total": self.kv.prefix_cache_hits,
            "prompt_tokens_total": self.prompt_tokens_total,
            "generation_tokens_total": self.generation_tokens_total,
            "num_steps": self.num_steps,
            **{f"step_{k}": v for k, v in self.step_time.items()},
            **self.expert_stats(),
            **self.device_memory_stats(),
        }

    def device_memory_stats(self) -> dict:
        """The process's device memory now and at its peak since start-up, beside the budget (bytes; the
        driver's count: worker/device_memory.py). Empty off CUDA."""
        if self.memory is None:
            return {}
        return {"device_memory_used_bytes": self.memory.used_bytes(),
                "device_memory_peak_bytes": self.memory.peak_bytes, "gpu_memory_budget_bytes": self.plan.budget_bytes}

    def expert_traffic_summary(self, since: Optional[dict] = None) -> Optional[str]:
        """One line on the pager's work since the `expert_stats()` snapshot `since` (engine/expert_stats.py);
        None when nothing is paged."""
        if self.pager is None:
            return None
        return traffic_summary(self.expert_stats(), since, self.device.type == "cuda")

    def expert_stats(self) -> dict:
        return expert_stats(self.expert_store, self.pager, self.precision)
