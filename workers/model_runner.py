"""Turns one `SchedulerOutput` into a forward pass over the paged KV cache and sampled tokens.

The runner applies the plan's diffs to its persistent batch, runs copy-on-write block copies,
builds flat inputs for a ragged batch (prefill chunks and decodes together), runs the model and,
on rank 0, samples the sequences whose every token is now computed.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future

import numpy as np
import torch

from pagedray.attention.interface import AttentionBackend
from pagedray.attention.metadata import AttentionMetadata
from pagedray.scheduler.messages import ModelRunnerOutput, SchedulerOutput, TokenLogprobs
from pagedray.workers.grammar_mask import apply_grammar_bitmask
from pagedray.workers.host_kv_buffer import HostKVBuffer
from pagedray.workers.input_batch import InputBatch
from pagedray.workers.kept_buffer import KeptBuffer
from pagedray.workers.lora import WorkerLoRA
from pagedray.workers.models.llama import LlamaForCausalLM
from pagedray.workers.sampler import Sampler, SamplingRow, token_logprobs

# Rows of prompt-logprob logits computed at once (each a full vocabulary of float32).
_PROMPT_LOGITS_SLICE = 256


class ModelRunner:
    """Owns the persistent batch and one rank's KV cache; stateless between steps otherwise."""

    def __init__(
        self,
        model: LlamaForCausalLM,
        kv_cache: torch.Tensor,  # [num_layers, 2, num_blocks, block_size, kv_heads, head_dim]
        attention: AttentionBackend,
        sampler: Sampler | None,  # None on ranks other than 0
        max_num_seqs: int,
        max_model_len: int,
        device: torch.device,
        host_tier: HostKVBuffer | None = None,
        disk_tier: HostKVBuffer | None = None,
        lora: WorkerLoRA | None = None,
    ) -> None:
        self.model = model
        self.lora = lora
        self.host_tier = host_tier
        self.disk_tier = disk_tier
        self.kv_cache = kv_cache
        self.attention = attention
        self.sampler = sampler
        self.device = device
        self.block_size = kv_cache.shape[3]
        self.batch = InputBatch(max_num_seqs, max_model_len, self.block_size)
        self._logits_buffer = KeptBuffer()  # see `_logits_out`

    @torch.inference_mode()
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        self._copy_seconds: dict[str, float] = {}
        output = self._execute_model(scheduler_output)
        output.tier_copy_seconds = self._copy_seconds
        return output

    def _execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        self._update_states(scheduler_output)
        if self.host_tier is not None:
            host, disk = self.host_tier, self.disk_tier
            self._tier_copy("host_tier_save", host.save, scheduler_output.blocks_to_save)
            self._tier_copy("host_tier_load", host.load, scheduler_output.blocks_to_load)
            if disk is not None:
                self._tier_copy(
                    "disk_tier_load", disk.load, scheduler_output.blocks_to_load_from_disk
                )
        unloaded = []  # slots whose adapter failed to load
        if self.lora is not None and scheduler_output.lora_loads:
            unloaded = self.lora.load_all(scheduler_output.lora_loads)
        if scheduler_output.blocks_to_copy:
            src, dst = zip(*scheduler_output.blocks_to_copy)
            self.attention.copy_blocks(self.kv_cache, list(src), list(dst))
        empty = ModelRunnerOutput(scheduler_output.step_id, [], [], [])
        empty.lora_load_failures = unloaded
        if scheduler_output.total_num_scheduled_tokens == 0:
            return empty
        input_ids, positions, metadata, sample_idx, sample_req_ids = self._prepare_inputs(
            scheduler_output
        )
        hidden = self.model(input_ids, positions, self.kv_cache, metadata)  # [num_tokens, hidden]
        if self.host_tier is not None:
            saves = scheduler_output.computed_blocks_to_save
            self._tier_copy("host_tier_save", self.host_tier.save, saves)
        prompt_logprobs = {}
        if self.batch.prompt_logprob_reqs:
            prompt_logprobs = self._prompt_logprobs(scheduler_output, hidden)
        empty.prompt_logprobs = prompt_logprobs
        if not sample_req_ids:
            return empty
        logits = self.model.compute_logits(  # [num_samples, vocab]
            hidden[sample_idx], self._logits_out(len(sample_idx))
        )
        if self.sampler is None:
            return empty
        bitmask = scheduler_output.grammar_bitmask
        if bitmask is not None:
            if isinstance(bitmask, Future):  # in-process: filled during the forward pass
                bitmask = bitmask.result()
            apply_grammar_bitmask(logits, sample_req_ids, bitmask)
        rows = [self._sampling_row(req_id) for req_id in sample_req_ids]
        sampled = self.sampler(logits, rows)
        ok = [i for i, row in enumerate(sampled) if row.error is None]
        return ModelRunnerOutput(
            step_id=scheduler_output.step_id,
            req_ids=[sample_req_ids[i] for i in ok],
            sampled_token_ids=[sampled[i].token_ids for i in ok],
            logprobs=[sampled[i].logprobs for i in ok],
            prompt_logprobs=prompt_logprobs,
            failed={
                req_id: row.error
                for req_id, row in zip(sample_req_ids, sampled)
                if row.error is not None
            },
            lora_load_failures=unloaded,
        )

    def _tier_copy(
        self,
        copy: str,
        method: Callable[[torch.Tensor, list[tuple[int, int]]], None],
        blocks: list[tuple[int, int]],
    ) -> None:
        """Run one of the step's tier copies (`TIER_COPIES`), timed: the seconds a tier costs
        the step are its operators' question."""
        if not blocks:
            return
        on_gpu = self.kv_cache.is_cuda  # copies queue on the stream: time them whole
        if on_gpu:
            torch.cuda.synchronize(self.kv_cache.device)
        start = time.perf_counter()
        method(self.kv_cache, blocks)
        if on_gpu:
            torch.cuda.synchronize(self.kv_cache.device)
        elapsed = time.perf_counter() - start
        self._copy_seconds[copy] = self._copy_seconds.get(copy, 0.0) + elapsed

    def _prompt_logprobs(
        self, scheduler_output: SchedulerOutput, hidden: torch.Tensor
    ) -> dict[str, tuple[int, list[TokenLogprobs]]]:
        """Logprobs of the prompt tokens this step's chunks predict, for sequences that asked.

        The hidden state at position j predicts token j + 1, so a chunk over positions
        [c, c + q) scores prompt tokens c + 1 .. min(c + q, prompt_len - 1). Every rank runs the
        (vocabulary-parallel) logits; rank 0 turns them into entries.
        """
        spans: list[tuple[str, int, int, int]] = []  # (req_id, first position, flat row, count)
        flat_start = 0
        for req_id, num_scheduled in scheduler_output.num_scheduled_tokens.items():
            if req_id in self.batch.prompt_logprob_reqs:
                state = self.batch.requests[req_id]
                start = state.num_computed_tokens
                end = min(start + num_scheduled, len(state.prompt_token_ids) - 1)
                if end > start:
                    spans.append((req_id, start + 1, flat_start, end - start))
                if start + num_scheduled >= len(state.prompt_token_ids):
                    self.batch.prompt_logprob_reqs.discard(req_id)  # the prompt is done
            flat_start += num_scheduled
        if not spans:
            return {}
        rows = [flat + k for _, _, flat, count in spans for k in range(count)]
        targets = [
            self.batch.requests[req_id].prompt_token_ids[first + k]
            for req_id, first, _, count in spans
            for k in range(count)
        ]
        num_top = [
            self.batch.requests[req_id].sampling_params.prompt_logprobs or 0
            for req_id, _, _, count in spans
            for _ in range(count)
        ]
        entries: list[TokenLogprobs] = []
        row_index = torch.tensor(rows, device=hidden.device)
        # In slices: a long prompt's full-vocabulary logits would otherwise be one huge tensor.
        for lo in range(0, len(rows), _PROMPT_LOGITS_SLICE):
            hi = min(lo + _PROMPT_LOGITS_SLICE, len(rows))
            logits = self.model.compute_logits(hidden[row_index[lo:hi]])  # [hi - lo, vocab]
            if self.sampler is not None:
                owner = list(range(hi - lo))
                entries += token_logprobs(logits, owner, targets[lo:hi], num_top[lo:hi])
        if self.sampler is None:
            return {}
        result, taken = {}, 0
        for req_id, first, _, count in spans:
            result[req_id] = (first, entries[taken : taken + count])
            taken += count
        return result

    def _update_states(self, scheduler_output: SchedulerOutput) -> None:
        for req_id in scheduler_output.finished_req_ids:
            self.batch.remove(req_id)
        for new in scheduler_output.scheduled_new_reqs:
            self.batch.add(new)
        self.batch.update(scheduler_output.scheduled_cached_reqs)

    def _prepare_inputs(
        self, scheduler_output: SchedulerOutput
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor, list[str]]:
        req_ids = list(scheduler_output.num_scheduled_tokens)
        states = [self.batch.requests[req_id] for req_id in req_ids]
        num_scheduled = np.fromiter(
            scheduler_output.num_scheduled_tokens.values(), dtype=np.int64, count=len(req_ids)
        )
        num_computed = np.array([s.num_computed_tokens for s in states], dtype=np.int64)
        num_tokens = np.array([s.num_tokens for s in states], dtype=np.int64)
        rows = np.array([s.row for s in states], dtype=np.int64)
        query_end = np.cumsum(num_scheduled)  # [num_seqs]
        query_start = query_end - num_scheduled
        total = int(query_end[-1])
        # Each token's absolute position: its offset in the step's flat batch, shifted per seq.
        token_seq = np.repeat(np.arange(len(req_ids)), num_scheduled)  # [num_tokens]
        positions = np.arange(total) + (num_computed - query_start)[token_seq]  # [num_tokens]
        token_rows = rows[token_seq]
        if self.lora is not None:
            slots = np.array([_no_slot(s.lora_slot) for s in states], dtype=np.int64)
            self.lora.step.set(slots[token_seq])
        input_ids = self.batch.token_ids[token_rows, positions]
        block_ids = self.batch.block_table[token_rows, positions // self.block_size]
        slot_mapping = block_ids.astype(np.int64) * self.block_size + positions % self.block_size
        seq_lens = num_computed + num_scheduled  # [num_seqs]
        max_seq_len = int(seq_lens.max())
        max_blocks = -(-max_seq_len // self.block_size)
        done = seq_lens >= num_tokens  # every token computed: sample the next one
        sample_idx = query_end[done] - 1
        sample_req_ids = [req_ids[i] for i in np.flatnonzero(done)]
        query_start_loc = np.concatenate([[0], query_end])
        metadata = AttentionMetadata(
            slot_mapping=self._to_device(slot_mapping),
            query_start_loc=self._to_device(query_start_loc.astype(np.int32)),
            seq_lens=self._to_device(seq_lens.astype(np.int32)),
            block_tables=self._to_device(
                np.ascontiguousarray(self.batch.block_table[rows, :max_blocks])
            ),
            max_query_len=int(num_scheduled.max()),
            max_seq_len=max_seq_len,
            query_start_loc_cpu=query_start_loc.tolist(),
            seq_lens_cpu=seq_lens.tolist(),
        )
        return (
            self._to_device(input_ids),
            self._to_device(positions),
            metadata,
            self._to_device(sample_idx),
            sample_req_ids,
        )

    def _logits_out(self, rows: int) -> torch.Tensor | None:
        """Where the float32 logits of the rows a step samples go when the LM head computes in
        another dtype: a `KeptBuffer`, valid until the next step's; None for a float32 head,
        whose logits are already the GEMM's own output. (Prompt logprobs, rarer and in slices of
        up to 256 rows, keep no buffer.)"""
        config = self.model.config
        if config.dtype == torch.float32:
            return None
        return self._logits_buffer.rows(rows, config.vocab_size, torch.float32, self.device)

    def _sampling_row(self, req_id: str) -> SamplingRow:
        state = self.batch.requests[req_id]
        params = state.sampling_params
        # An n > 1 prompt samples all n first tokens from its one prefill, then forks.
        num_samples = params.n if not state.output_token_ids else 1
        return SamplingRow(
            params=params,
            seed=params.seed,
            prompt_token_ids=state.prompt_token_ids,
            output_token_ids=state.output_token_ids,
            num_samples=num_samples,
            allowed_index=state.allowed_index,
        )

    def _to_device(self, array: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(array).to(self.device, non_blocking=True)


def _no_slot(slot: int | None) -> int:
    return -1 if slot is None else slot
