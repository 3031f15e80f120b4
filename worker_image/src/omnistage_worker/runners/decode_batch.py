"""Continuous batching for a transformers causal LM: requests that arrive while others decode
join the running batch within a few steps, each with its own sampling, stops and stream.

Why not transformers' own continuous batching (``init_continuous_batching`` /
``generate_batch``): its sampler draws every row from one generator, so a request's sampled
output depends on what else is in the batch (no per-request seed); per-request temperature and
top-p exist only in later 5.x releases than the GPU host's 5.17; it reports no log
probabilities; and its paged KV pool is allocated once on the device when the manager starts,
which a stage that sleeps would have to tear down and rebuild around every weight move.

Here the running batch is one ``DynamicCache`` of shape ``[rows, heads, slots, dim]`` with a
``[rows, slots]`` attention mask: every step feeds each running row its pending token and each
joining row its whole prompt, left-padded to the longest feed, in one forward pass (a joining
row's past is all padding; a running row gets masked holes when prompts join). Positions are per
row, so a row sees exactly the tokens it would see alone. Waiting requests join at the next step
while that pads the running rows little, else joins are gathered (:func:`join_now`); the holes
they leave are compacted away once they outnumber the longest row. Finished rows are dropped
from the cache at once and columns no row uses any more are trimmed, so when the last request
ends the cache is gone: nothing of a batch stays on the device for a sleep to find.

A step waits for the device once: its inputs go up without a wait (:func:`.to_device`), the
token choice is batched over the rows (:mod:`.token_choice`), and the host reads the step's
tokens and log probabilities back in one copy; what the host needs to trim the cache (each
row's first column) it tracks itself.

Known cost (measured on an H200, bench/results/README.md): with a padding mask, PyTorch's
cuDNN attention builds a graph for each new shape (rows, cache length), about 1 ms of host time
per layer: a 16-row step with holes at lengths never seen took 64 ms against 25 ms without
holes. Shapes that recur hit its cache; a run with cuDNN left out served 16 clients worse
(0.59 of batched ``generate`` against 0.75, and its steady state ran 1.24 x slower than the
hole-free restart after a wake), so it stays in.
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
from omnistage_worker.runners.sampling import Sampling
from omnistage_worker.runners.serving_thread import ServingThread
from omnistage_worker.runners.text_output import TextOutput
from omnistage_worker.runners.token_choice import choose, new_generator, read_step, to_device

log = logging.getLogger(__name__)

FINISH_STOP = inference_service_pb2.FINISH_REASON_STOP
FINISH_LENGTH = inference_service_pb2.FINISH_REASON_LENGTH

Response = inference_service_pb2.GenerateResponse
TextChunkSink = Any  # Callable[[inference_service_pb2.TextChunk], None]

JOIN_EVERY = 8
"""Steps a waiting request may wait for the next join while the batch runs ..."""
JOIN_PADDING = 512
"""... unless its join pads the running rows with at most this many tokens in all: then it joins
at the next step (a step that small costs what a plain one does while the host, not the
device, sets the pace; a request that waits leaves its slot idle). See :func:`join_now`."""
MIN_HOLES = 64
"""Padding columns the cache may hold beyond its longest row before it is compacted ..."""
HOLE_RATIO = 1.0
"""... and as a share of the longest row."""


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
    ) -> None:
        self._model = model
        self._tokenizer = tokenizer
        self._device = device
        self.max_batch = max(1, max_batch)
        self._eos = eos_ids
        self._pad = pad_id
        self._keeps_logits = "logits_to_keep" in inspect.signature(model.forward).parameters
        super().__init__("omnistage-decode-batch")
        self._pending: deque[Job] = deque()
        self._rows: list[Row] = []
        self._cache: Any = None
        self._mask: torch.Tensor | None = None
        self.steps = 0
        self.compactions = 0
        self.row_steps = 0
        """Rows summed over steps (``row_steps / steps``: the mean batch)."""
        self.join_steps = 0
        self.step_seconds = 0.0
        self._joined_at = -JOIN_EVERY

    # -- callers' side ----------------------------------------------------------------------

    def submit(self, job: Job) -> concurrent.futures.Future[Response]:
        """Queue ``job``; it joins the running batch within a few steps."""
        self._enqueue(lambda: self._pending.append(job))
        return job.future

    def cache_bytes(self) -> int:
        """Bytes the running batch holds in its KV cache and mask (0 when idle)."""
        cache, mask = self._cache, self._mask
        total = 0 if mask is None else mask.numel() * mask.element_size()
        for layer in getattr(cache, "layers", None) or ():
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
        """The waiting requests that join at this step (under the lock), as :func:`join_now`
        decides."""
        room = self.max_batch - len(self._rows)
        if not self._pending or room <= 0:
            return []
        waiting = [len(job.prompt_ids) for job in list(self._pending)[:room]]
        if not join_now(waiting, len(self._rows), room, self.steps - self._joined_at):
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
            failed = [row.job.future for row in self._rows] + [job.future for job in joining]
            self._rows, self._cache, self._mask = [], None, None
            return [(future, exc) for future in failed]
        finally:
            self.step_seconds += time.perf_counter() - began

    def _step(
        self, joining: list[Job]
    ) -> list[tuple[concurrent.futures.Future[Response], Response | BaseException]]:
        new_rows = [self._new_row(job) for job in joining]
        feeds = [[row.pending] for row in self._rows] + [job.prompt_ids for job in joining]
        self._grow(len(new_rows))
        rows = self._rows = self._rows + new_rows
        logits = self._forward(rows, feeds)
        self.steps += 1
        self.row_steps += len(rows)
        self.join_steps += bool(joining)
        tokens = choose(logits, [r.job.sampling for r in rows], [r.generator for r in rows])
        tops = [r.job.sampling.top_logprobs for r in rows]
        results = read_step(tokens, logits, tops, self._decode_one)  # the step's one wait
        del logits, tokens
        for row, feed, (token, logprob) in zip(rows, feeds, results, strict=True):
            row.seen += len(feed)
            row.batch_size = max(row.batch_size, len(rows))
            self._take(row, token, logprob)
        finished = self._drop_finished()
        self._compact()
        return finished

    def _new_row(self, job: Job) -> Row:
        streamed = job.sink is not None
        output = TextOutput(self._decode, list(job.request.stop), streamed)
        sampling = job.sampling
        generator = None if sampling.greedy else new_generator(sampling.seed)
        return Row(job=job, output=output, generator=generator)

    def _grow(self, joining: int) -> None:
        """Give joining rows an all-padding past as long as the running rows'."""
        if not joining or self._cache is None or self._mask is None:
            return
        for layer in self._cache.layers:
            layer.keys = _pad_rows(layer.keys, joining)
            layer.values = _pad_rows(layer.values, joining)
        self._mask = _pad_rows(self._mask, joining)

    def _forward(self, rows: list[Row], feeds: list[list[int]]) -> torch.Tensor:
        """Feed each row its tokens (left-padded to the longest); the last position's logits."""
        width = max(len(f) for f in feeds)
        columns = 0 if self._mask is None else self._mask.shape[1]
        ids, mask, positions = [], [], []
        for row, feed in zip(rows, feeds, strict=True):
            pad = width - len(feed)
            if row.seen == 0:
                row.first = columns + pad
            ids.append([self._pad] * pad + feed)
            mask.append([0] * pad + [1] * len(feed))
            positions.append([0] * pad + list(range(row.seen, row.seen + len(feed))))
        # One copy up for the three, queued without waiting.
        inputs = to_device(torch.tensor([ids, mask, positions], dtype=torch.long), self._device)
        new_mask = inputs[1]
        full_mask = new_mask if self._mask is None else torch.cat([self._mask, new_mask], dim=1)
        kwargs: dict[str, Any] = {
            "input_ids": inputs[0],
            "attention_mask": full_mask,
            "position_ids": inputs[2],
            "past_key_values": self._cache,
            "use_cache": True,
        }
        if self._keeps_logits:
            kwargs["logits_to_keep"] = 1
        out = self._model(**kwargs)
        self._cache, self._mask = out.past_key_values, full_mask
        logits: torch.Tensor = out.logits[:, -1, :].float()
        return logits

    def _take(
        self, row: Row, token: int, logprob: inference_service_pb2.TokenLogprob | None
    ) -> None:
        """Append ``token`` to ``row``, stream it, and decide whether the row is done."""
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
        if job.sink is not None:
            chunk = inference_service_pb2.TextChunk(token_ids=[token], text=delta)
            if logprob is not None:
                chunk.logprobs.append(logprob)
            try:
                job.sink(chunk)
            except Exception:  # a receiver gone (its loop closed) must not fail the batch
                log.exception(
                    "request %r: its stream failed; it goes on unstreamed", job.request.request_id
                )
                job.sink = None

    def _drop_finished(
        self,
    ) -> list[tuple[concurrent.futures.Future[Response], Response | BaseException]]:
        """Answer finished rows and drop them (and padding no row needs) from the cache."""
        done = [row for row in self._rows if row.finish]
        if not done:
            return []
        keep = [i for i, row in enumerate(self._rows) if not row.finish]
        self._rows = [self._rows[i] for i in keep]
        if not keep:
            self._cache, self._mask = None, None
        else:
            assert self._mask is not None
            index = to_device(torch.tensor(keep), self._mask.device)
            mask = self._mask.index_select(0, index)
            start = min(row.first for row in self._rows)  # the first column a row still uses
            for row in self._rows:
                row.first -= start
            self._mask = mask[:, start:]
            for layer in self._cache.layers:
                layer.keys = layer.keys.index_select(0, index)[:, :, start:]
                layer.values = layer.values.index_select(0, index)[:, :, start:]
        return [(row.job.future, self._response(row)) for row in done]

    def _compact(self) -> None:
        """Drop the padding columns that joins left inside running rows once they outnumber
        the longest row: each row's tokens keep their order and move to the right end."""
        mask = self._mask
        if mask is None or self._cache is None:
            return
        width = max(row.seen for row in self._rows)
        holes = mask.shape[1] - width
        if holes < MIN_HOLES or holes < HOLE_RATIO * width:
            return
        self.compactions += 1
        # Stable: a row's padding columns first, then its tokens in their order.
        index = torch.argsort(mask, dim=1, stable=True)[:, -width:]
        self._mask = mask.gather(1, index)
        for row in self._rows:
            row.first = width - row.seen
        for layer in self._cache.layers:
            heads, dim = layer.keys.shape[1], layer.keys.shape[3]
            spread = index[:, None, :, None].expand(-1, heads, -1, dim)
            layer.keys = layer.keys.gather(2, spread)
            layer.values = layer.values.gather(2, spread)

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


def join_now(waiting: list[int], running: int, room: int, since_join: int) -> bool:
    """Whether requests waiting with prompts of ``waiting`` tokens (those that fit) join at this
    step: at once when nothing runs, when they fill the ``room`` left, when their join pads the
    ``running`` rows with at most ``JOIN_PADDING`` tokens, or ``JOIN_EVERY`` steps after the
    last join (``since_join`` steps ago); else they are gathered for a later join."""
    if not waiting:
        return False
    padding = running * (max(waiting) - 1)
    return (
        not running or len(waiting) >= room or padding <= JOIN_PADDING or since_join >= JOIN_EVERY
    )


def _pad_rows(tensor: torch.Tensor, rows: int) -> torch.Tensor:
    """``tensor`` with ``rows`` zero rows appended along the batch dimension."""
    shape = (rows, *tensor.shape[1:])
    return torch.cat([tensor, tensor.new_zeros(shape)], dim=0)
