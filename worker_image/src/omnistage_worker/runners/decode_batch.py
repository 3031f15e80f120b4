"""Continuous batching for a transformers causal LM: requests that arrive while others decode
join the running batch within a few steps, each with its own sampling, stops and stream.

Why not transformers' own continuous batching (``init_continuous_batching`` /
``generate_batch``): its sampler draws every row from one generator, so a request's sampled
output depends on what else is in the batch (no per-request seed); per-request temperature and
top-p exist only in later 5.x releases than the GPU host's 5.17; it reports no log
probabilities; and its paged KV pool is allocated once on the device when the manager starts,
which a stage that sleeps would have to tear down and rebuild around every weight move.

Here the running batch is one :class:`.BucketCache` (``[slots, heads, columns, dim]`` per
layer, with a ``[slots, columns]`` mask): every step feeds each running row its pending token and
each joining row its whole prompt, left-padded to the longest feed (its width rounded up to a
bucket), in one forward pass (a joining row's past is all padding; a running row gets masked
holes when prompts join). Positions are per row, so a row sees exactly the tokens it would see
alone. Waiting requests join at the next step while that pads the running rows little, else
joins are gathered; the holes they leave are compacted away once they outnumber the longest row
(:mod:`.decode_policy` decides both). A finished row frees its slot at once; columns no row uses
any more are dropped when the cache is laid out anew, and when the last request ends the cache is
gone: nothing of a batch stays on the device for a sleep to find.

A step waits for the device once: its inputs go up without a wait (:func:`.to_device`), the
token choice is batched over the rows (:mod:`.token_choice`), and the host reads the step's
tokens and log probabilities back in one copy; what the host needs to trim the cache (each
row's first column) it tracks itself.

Shapes: with a padding mask, PyTorch's cuDNN attention builds a graph for each new shape
(slots, fed width, columns), about 1 ms of host time per layer on an H200 (a 16-row step at
cache lengths never seen took 64 ms against 25 ms; bench/results/README.md). So slots, columns
and fed widths come in buckets (:mod:`.kv_buckets`) and the shapes recur. With ``max_batch`` 1
(what the runner sets for a model with sliding-window layers) the one row runs in the model's
own cache instead, unpadded and unmasked, so its layers keep their windows.
"""

from __future__ import annotations

import concurrent.futures
import inspect
import logging
import random
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import torch

from omnistage.worker.v1 import inference_service_pb2
from omnistage_worker.runners import decode_policy
from omnistage_worker.runners.chunk_hop import hand_over
from omnistage_worker.runners.kv_buckets import (
    BucketCache,
    column_bucket,
    row_bucket,
    width_bucket,
)
from omnistage_worker.runners.sampling import Sampling
from omnistage_worker.runners.serving_thread import ServingThread
from omnistage_worker.runners.step_graphs import StepGraphs
from omnistage_worker.runners.text_output import TextOutput
from omnistage_worker.runners.token_choice import choose, new_generator, read_step, to_device

log = logging.getLogger(__name__)

FINISH_STOP = inference_service_pb2.FINISH_REASON_STOP
FINISH_LENGTH = inference_service_pb2.FINISH_REASON_LENGTH

Response = inference_service_pb2.GenerateResponse
TextChunkSink = Any  # Callable[[inference_service_pb2.TextChunk], None]


@dataclass
class Job:
    """One request as the batcher runs it."""

    request: inference_service_pb2.GenerateRequest
    prompt_ids: list[int]
    max_new_tokens: int
    sampling: Sampling
    sink: TextChunkSink | None
    future: concurrent.futures.Future[Response] = field(default_factory=concurrent.futures.Future)
    submitted: float = field(default_factory=time.monotonic)


@dataclass
class Row:
    """A request in the running batch."""

    job: Job
    output: TextOutput
    generator: random.Random | None
    slot: int = -1
    """The row's slot in the cache."""
    seen: int = 0
    """Real (unmasked) tokens of this row in the cache: the position of its pending token."""
    first: int = 0
    """The cache column of this row's first token (columns before it are its padding)."""
    pending: int = -1
    """The token sampled last, fed at the next step."""
    logprobs: list[inference_service_pb2.TokenLogprob] = field(default_factory=list)
    batch_size: int = 0
    finish: inference_service_pb2.FinishReason.ValueType = (
        inference_service_pb2.FINISH_REASON_UNSPECIFIED
    )


class DecodeBatcher(ServingThread):
    """Runs requests in one growing and shrinking batch on a daemon thread of its own."""

    def __init__(
        self,
        model: Any,
        *,
        tokenizer: Any,
        device: torch.device,
        max_batch: int,
        eos_ids: set[int],
        pad_id: int,
        graphs: bool = True,
    ) -> None:
        self._model = model
        self._tokenizer = tokenizer
        self._device = device
        self.max_batch = max(1, max_batch)
        self._eos = eos_ids
        self._pad = pad_id
        self._keeps_logits = "logits_to_keep" in inspect.signature(model.forward).parameters
        config = getattr(model, "config", None)
        self._additive = getattr(config, "_attn_implementation", "sdpa") == "eager"
        self._dtype: torch.dtype = getattr(model, "dtype", torch.float32)
        self._graphs = StepGraphs(self._last_logits, device, graphs)
        super().__init__("omnistage-decode-batch")
        self._pending: deque[Job] = deque()
        self._rows: list[Row] = []
        self._cache: BucketCache | None = None
        self._alone: Any = None
        """With ``max_batch`` 1: the one row's cache, the model's own (no padding, no mask:
        what a model with sliding-window layers needs, whose windows the buckets' one mask
        cannot follow)."""
        self.steps = 0
        self.compactions = 0
        self.row_steps = 0
        """Rows summed over steps (``row_steps / steps``: the mean batch)."""
        self.join_steps = 0
        self.step_seconds = 0.0
        self._joined_at = -decode_policy.JOIN_EVERY

    # -- callers' side ----------------------------------------------------------------------

    def submit(self, job: Job) -> concurrent.futures.Future[Response]:
        """Queue ``job``; it joins the running batch within a few steps."""
        self._enqueue(lambda: self._pending.append(job))
        return job.future

    def cache_bytes(self) -> int:
        """Bytes the running batch holds in its KV cache and mask (0 when idle)."""
        cache = self._cache
        total = 0 if cache is None else cache.nbytes()
        for layer in getattr(self._alone, "layers", None) or ():
            for tensor in (getattr(layer, "keys", None), getattr(layer, "values", None)):
                if isinstance(tensor, torch.Tensor):
                    total += tensor.numel() * tensor.element_size()
        return total

    # -- the batch's thread -----------------------------------------------------------------

    def _serve(self) -> None:
        while True:
            with self._cond:
                while not self._pending and not self._rows:
                    if self._closed:
                        return
                    self._cond.wait()
                joining = self._joining()
            for future, outcome in self._step_or_fail(joining):
                if isinstance(outcome, BaseException):
                    future.set_exception(outcome)
                else:
                    future.set_result(outcome)

    def _joining(self) -> list[Job]:
        """The waiting requests that join at this step (under the lock), as
        :func:`.decode_policy.join_now` decides."""
        room = self.max_batch - len(self._rows)
        if not self._pending or room <= 0:
            return []
        waiting = [len(job.prompt_ids) for job in list(self._pending)[:room]]
        if not decode_policy.join_now(waiting, len(self._rows), room, self.steps - self._joined_at):
            return []
        self._joined_at = self.steps
        return [self._pending.popleft() for _ in range(min(room, len(self._pending)))]

    def _step_or_fail(
        self, joining: list[Job]
    ) -> list[tuple[concurrent.futures.Future[Response], Response | BaseException]]:
        """One step; on an error every request in the batch fails with it (and the batch's
        memory is dropped). Runs to completion before any future is resolved, so the tensors
        of the step are gone when a caller (or a draining sleep) sees its answer."""
        began = time.perf_counter()
        try:
            with torch.inference_mode():
                return self._step(joining)
        except Exception as exc:
            log.exception("a batch step failed (%d rows)", len(self._rows) + len(joining))
            futures = [row.job.future for row in self._rows] + [job.future for job in joining]
            failed = list({id(future): future for future in futures}.values())
            self._rows, self._cache, self._alone = [], None, None
            return [(future, exc) for future in failed]
        finally:
            self.step_seconds += time.perf_counter() - began

    def _step(
        self, joining: list[Job]
    ) -> list[tuple[concurrent.futures.Future[Response], Response | BaseException]]:
        new_rows = [self._new_row(job) for job in joining]
        feeds = [[row.pending] for row in self._rows] + [job.prompt_ids for job in joining]
        rows = self._rows + new_rows
        if self.max_batch == 1:
            logits = self._forward_alone(rows[0], feeds[0])
        else:
            width = width_bucket(max(len(feed) for feed in feeds))
            cache = self._place(self._rows, new_rows, width)
            logits = self._forward(cache, rows, feeds, width)
        self._rows = rows
        self.steps += 1
        self.row_steps += len(rows)
        self.join_steps += bool(joining)
        tokens = choose(logits, [r.job.sampling for r in rows], [r.generator for r in rows])
        tops = [r.job.sampling.top_logprobs for r in rows]
        results = read_step(tokens, logits, tops, self._decode_one)  # the step's one wait
        del logits, tokens
        streamed: list[tuple[Job, inference_service_pb2.TextChunk]] = []
        for row, feed, (token, logprob) in zip(rows, feeds, results, strict=True):
            row.seen += len(feed)
            row.batch_size = max(row.batch_size, len(rows))
            chunk = self._take(row, token, logprob)
            if chunk is not None:
                streamed.append((row.job, chunk))
        self._stream(streamed)
        return self._drop_finished()

    def _new_row(self, job: Job) -> Row:
        streamed = job.sink is not None
        output = TextOutput(self._decode, list(job.request.stop), streamed)
        sampling = job.sampling
        generator = None if sampling.greedy else new_generator(sampling.seed)
        return Row(job=job, output=output, generator=generator)

    def _place(self, running: list[Row], joining: list[Row], width: int) -> BucketCache:
        """The cache for a step of ``width`` columns: the running one, laid out anew when the
        step does not fit in it, the rows have shrunk to half its slots or holes are to be
        compacted; joining rows take free slots (their past all masked)."""
        cache, rows = self._cache, len(running) + len(joining)
        if cache is None or not running:
            spare = self._spare(running, joining)
            cache = BucketCache(
                row_bucket(rows), column_bucket(width + spare), self._device, self._additive
            )
        else:
            used = cache.at - min(row.first for row in running)
            compact = decode_policy.should_compact(used, max(row.seen for row in running))
            if compact or rows > cache.slots or 2 * row_bucket(rows) <= cache.slots:
                relayout = True
            else:
                relayout = not cache.fits(width)
            if relayout:
                cache, firsts = cache.relayout(
                    [row.slot for row in running],
                    [row.first for row in running],
                    [row.seen for row in running],
                    rows=rows,
                    width=width,
                    compact=compact,
                    spare=self._spare(running, joining),
                )
                self.compactions += compact
                for slot, (row, first) in enumerate(zip(running, firsts, strict=True)):
                    row.slot, row.first = slot, first
        taken = {row.slot for row in running}
        free = [slot for slot in range(cache.slots) if slot not in taken]
        for row, slot in zip(joining, free, strict=False):
            row.slot = slot
        cache.clear([row.slot for row in joining])
        self._cache = cache
        return cache

    def _spare(self, running: list[Row], joining: list[Row]) -> int:
        """Columns a new layout keeps free beyond the step: with CUDA graphs, room for the
        steps its rows still want, up to :data:`.decode_policy.GRAPH_SPARE`; else none."""
        if not self._graphs.enabled:
            return 0
        return decode_policy.spare_columns(
            [r.job.max_new_tokens - len(r.output.ids) for r in (*running, *joining)]
        )

    def _forward(
        self, cache: BucketCache, rows: list[Row], feeds: list[list[int]], width: int
    ) -> torch.Tensor:
        """Feed each row its tokens (left-padded to ``width``, free slots all padding) at the
        cache's next columns; the last position's logits, one row per request."""
        slots = cache.slots
        ids = [[self._pad] * width for _ in range(slots)]
        fed = [[0] * width for _ in range(slots)]
        positions = [[0] * width for _ in range(slots)]
        for row, feed in zip(rows, feeds, strict=True):
            pad = width - len(feed)
            if row.seen == 0:
                row.first = cache.at + pad
            ids[row.slot] = [self._pad] * pad + feed
            fed[row.slot] = [0] * pad + [1] * len(feed)
            positions[row.slot] = [0] * pad + list(range(row.seen, row.seen + len(feed)))
        # One copy up for the three, queued without waiting.
        inputs = to_device(torch.tensor([ids, fed, positions], dtype=torch.long), self._device)
        attention = cache.attention(inputs[1].bool(), self._dtype)
        if width == 1:
            last = self._graphs.step(cache, inputs[0], inputs[2], attention)
        else:
            last = self._last_logits(inputs[0], inputs[2], attention, cache)
        cache.advance(width)
        order = [row.slot for row in rows]
        if order != list(range(len(order))):
            last = last.index_select(0, to_device(torch.tensor(order), last.device))
        elif len(order) < slots:
            last = last[: len(order)]
        return last.float()

    def _last_logits(
        self, ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor, cache: BucketCache
    ) -> torch.Tensor:
        """The model's forward over ``cache``: the last position's logits, a row per slot."""
        kwargs: dict[str, Any] = {
            "input_ids": ids,
            "attention_mask": mask,
            "position_ids": positions,
            "past_key_values": cache,
            "use_cache": True,
        }
        if self._keeps_logits:
            kwargs["logits_to_keep"] = 1
        logits: torch.Tensor = self._model(**kwargs).logits[:, -1, :]
        return logits

    def _forward_alone(self, row: Row, feed: list[int]) -> torch.Tensor:
        """One row's step in the model's own cache, unpadded and unmasked."""
        positions = list(range(row.seen, row.seen + len(feed)))
        inputs = to_device(torch.tensor([feed, positions], dtype=torch.long), self._device)
        kwargs: dict[str, Any] = {
            "input_ids": inputs[:1],
            "position_ids": inputs[1:],
            "past_key_values": self._alone,
            "use_cache": True,
        }
        if self._keeps_logits:
            kwargs["logits_to_keep"] = 1
        out = self._model(**kwargs)
        self._alone = out.past_key_values
        logits: torch.Tensor = out.logits[:, -1, :].float()
        return logits

    def _take(
        self, row: Row, token: int, logprob: inference_service_pb2.TokenLogprob | None
    ) -> inference_service_pb2.TextChunk | None:
        """Append ``token`` to ``row`` and decide whether the row is done; the chunk to
        stream (None: the request does not stream)."""
        job = row.job
        row.pending = token
        if logprob is not None:
            row.logprobs.append(logprob)
        delta = row.output.add(token)
        if row.output.stopped or token in self._eos:
            row.finish = FINISH_STOP
        elif len(row.output.ids) >= job.max_new_tokens:
            row.finish = FINISH_LENGTH
        if row.finish:
            delta += row.output.finish()
        if job.sink is None:
            return None
        chunk = inference_service_pb2.TextChunk(token_ids=[token], text=delta)
        if logprob is not None:
            chunk.logprobs.append(logprob)
        return chunk

    def _stream(self, chunks: list[tuple[Job, inference_service_pb2.TextChunk]]) -> None:
        """Hand the step's chunks to their sinks: one hand-over per event loop for the whole
        step (:mod:`.chunk_hop`). A sink that fails (its loop closed) must not fail the batch:
        its request goes on unstreamed."""
        failed = hand_over([(job.sink, chunk) for job, chunk in chunks if job.sink is not None])
        for job, _ in chunks:
            if job.sink is not None and any(job.sink is sink for sink in failed):
                log.warning("request %r: its stream failed; it goes on unstreamed",
                            job.request.request_id)  # fmt: skip
                job.sink = None

    def _drop_finished(
        self,
    ) -> list[tuple[concurrent.futures.Future[Response], Response | BaseException]]:
        """Answer finished rows and free their slots (the cache goes with the last row)."""
        done = [row for row in self._rows if row.finish]
        if not done:
            return []
        self._rows = [row for row in self._rows if not row.finish]
        if not self._rows:
            self._cache = self._alone = None
        elif self._cache is not None:
            self._cache.clear([row.slot for row in done])
        return [(row.job.future, self._response(row)) for row in done]

    def _response(self, row: Row) -> Response:
        job = row.job
        ids = row.output.ids
        response = Response(
            request_id=job.request.request_id,
            text=inference_service_pb2.TextOutput(
                token_ids=ids,
                text=row.output.text,
                finish_reason=row.finish,
                logprobs=row.logprobs,
            ),
            usage=inference_service_pb2.Usage(
                prompt_tokens=len(job.prompt_ids), completion_tokens=len(ids)
            ),
            batch_size=row.batch_size,
        )
        response.duration.FromNanoseconds(int((time.monotonic() - job.submitted) * 1e9))
        return response

    def _decode(self, ids: list[int]) -> str:
        return str(self._tokenizer.decode(ids, skip_special_tokens=True))

    def _decode_one(self, token_id: int) -> str:
        return str(self._tokenizer.decode([token_id]))
