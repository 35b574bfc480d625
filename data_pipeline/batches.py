"""Per-step sample positions and batch assembly: `batch_indices` (which samples one micro-batch of
one data-parallel rank reads), `DataPosition` (a run's place in its sample stream, kept in
checkpoints) and `get_batch` (samples into tensors). Pure functions of indices and counts, apart
from building the datasets (data_pipeline/dataset.py), so no loader state exists: a resume under
any global batch continues at the next unconsumed sample.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

import torch


def batch_indices(first_sample: int, micro_step: int, grad_accum_steps: int, dp_rank: int,
                  dp_size: int, micro_batch_size: int) -> List[int]:
    """Global sample indices of one micro-batch on one data-parallel rank, in the optimizer step
    whose first sample is `first_sample` (`DataPosition.next_sample()`).

    With G = micro_batch_size * grad_accum_steps * dp_size, the step consumes samples
    [first_sample, first_sample + G), ordered micro-step-major, then dp rank, then sample:

        start = first_sample + (micro_step*dp_size + dp_rank) * micro_batch_size
        indices = [start, start + micro_batch_size)

    so the union over dp ranks and micro-steps of a step is exactly what a dp=1 run with
    dp_size*grad_accum_steps micro-batches sees (its micro-step m' = micro_step*dp_size + dp_rank).
    """
    if not (0 <= micro_step < grad_accum_steps and 0 <= dp_rank < dp_size and micro_batch_size > 0
            and first_sample >= 0):
        raise ValueError(
            f"batch_indices: need 0 <= micro_step ({micro_step}) < grad_accum_steps "
            f"({grad_accum_steps}), "
            f"0 <= dp_rank ({dp_rank}) < dp_size ({dp_size}), micro_batch_size "
            f"({micro_batch_size}) > 0, "
            f"first_sample ({first_sample}) >= 0"
        )
    start = first_sample + (micro_step * dp_size + dp_rank) * micro_batch_size
    return list(range(start, start + micro_batch_size))


class DataPosition:
    """A run's place in its stream of training samples: the sampler's whole state, kept in every
    checkpoint's trainer_state.json.

    * `consumed_samples`, `consumed_tokens`: what the run's optimizer steps have drawn (a step whose
      update the `skip` policy dropped counts: its batch was drawn), summed step by step, so they
      stay right across resumes under another global batch.
    * `skipped`: [start, end) sample ranges passed over by the `rewind` policy (a bad step's batch).
    * `next_sample()`: the first sample of the next step: `consumed_samples` plus every skipped
      range at or before it. A resume continues from exactly there whatever its global batch
      (another layout, micro-batch size or accumulation); `step x global batch` would skip or repeat
      samples.
    * `schedule_batch`: the global batch of the run's first step, kept across resumes. The LR
      schedule's step counts are measured in it and the LR follows `schedule_step()` = consumed
      samples / schedule_batch, so it stays in step with the tokens seen when the global batch
      changes (it equals the step number while the global batch does not).
    """

    def __init__(self, global_batch: int, seq_len: int):
        self.global_batch, self.seq_len = int(global_batch), int(seq_len)
        self.consumed_samples = 0
        self.consumed_tokens = 0
        self.schedule_batch = self.global_batch
        self.skipped: List[Tuple[int, int]] = []

    def next_sample(self) -> int:
        position = self.consumed_samples
        for start, end in self.skipped:  # sorted
            if start <= position:
                position += end - start
        return position

    def next_batch(self) -> Tuple[int, int]:
        """[start, end) of the samples the next step reads."""
        start = self.next_sample()
        return start, start + self.global_batch

    def advance(self) -> None:
        """An optimizer step drew its global batch."""
        self.consumed_samples += self.global_batch
        self.consumed_tokens += self.global_batch * self.seq_len

    def skip(self, ranges) -> None:
        """Pass over these [start, end) sample ranges when the stream reaches them."""
        self.skipped = sorted(set(self.skipped) | {(int(a), int(b)) for a, b in ranges})

    def schedule_step(self) -> float:
        """Position in the LR schedule, in steps of `schedule_batch` samples."""
        return self.consumed_samples / self.schedule_batch

    def resume_note(self, saved: dict) -> str:
        """What a resume from trainer state `saved` changes about the data, for its start-up line:
        empty under the same global batch."""
        old = int(saved.get("global_batch", self.schedule_batch))
        if old == self.global_batch:
            return ""
        return (f"; global batch {old} -> {self.global_batch} samples: data continues at sample "
                f"{self.next_sample()}, the LR at schedule step {self.schedule_step():g} "
                f"({self.consumed_samples} samples / {self.schedule_batch} per schedule step)")

    def state(self) -> dict:
        return {"consumed_samples": self.consumed_samples, "consumed_tokens": self.consumed_tokens,
                "global_batch": self.global_batch, "schedule_global_batch": self.schedule_batch,
                "skipped_samples": [list(r) for r in self.skipped]}

    def load_state(self, state: dict) -> None:
        """Restore from a checkpoint's trainer state. One written before consumed samples were kept
        holds its step count, `tokens_seen` (step x global batch x seq_len) and skipped batch
        numbers: converted at the global batch it ran with."""
        if "consumed_samples" in state:
            self.consumed_samples, self.consumed_tokens = (
                int(state["consumed_samples"]),
                int(state["consumed_tokens"]),
            )
            self.schedule_batch = int(state["schedule_global_batch"])
            self.skipped = []
            self.skip(state["skipped_samples"])
            return
        step, tokens = int(state.get("step", 0)), int(state.get("tokens_seen", 0))
        batch = tokens // (step * self.seq_len) if step and tokens else self.global_batch
        self.consumed_samples, self.consumed_tokens, self.schedule_batch = (
            step * batch,
            tokens,
            batch,
        )
        self.skipped = []
        self.skip((b * batch, (b + 1) * batch) for b in state.get("skipped_batches", []))


def _eod_of(dataset) -> int:
    config = getattr(dataset, "config", None)
    tok = getattr(config, "tokenizer", None)
    if tok is None:
        raise ValueError(
            "get_batch: pass eod_id= for a dataset without a megatron config tokenizer"
        )
    return int(tok.eod)


def get_batch(dataset, sample_indices: Sequence[int],
              eod_id: Optional[int] = None) -> Dict[str, torch.Tensor]:
    """Collate samples `sample_indices` (taken modulo len(dataset)) into CPU tensors.

    * `tokens`    LongTensor [B, seq_len+1]: the full window
                  (inputs are tokens[:, :-1], targets tokens[:, 1:])
    * `loss_mask` FloatTensor [B, seq_len]: 1 where target t (tokens[:, t+1]) counts. Megatron
      semantics: 0 for padding, and with `eod_mask_loss` 0 where the *input* token tokens[:, t] is
      EOD.
    * `doc_ids`   LongTensor [B, seq_len+1]: number of EOD tokens strictly before each position in
                  the
      window; positions i, j belong to the same document iff doc_ids are equal. Samples that carry
          their
      own `doc_ids` (chat records, a loss-mask channel: record boundaries, not EOD counts) keep
          them.

    A pure function of the indices: no loader state.
    """
    n = len(dataset)
    samples = [dataset[int(i) % n] for i in sample_indices]
    tokens_t = torch.stack([torch.cat([s["tokens"], s["labels"][-1:]]) for s in samples]).long()
    if all("doc_ids" in s for s in samples):
        doc_ids = torch.stack([s["doc_ids"] for s in samples]).long()
    else:
        is_eod = (tokens_t == (_eod_of(dataset) if eod_id is None else eod_id)).long()
        doc_ids = torch.cumsum(is_eod, dim=1) - is_eod
    return {"tokens": tokens_t, "loss_mask": torch.stack([s["loss_mask"] for s in samples]).float(),
            "doc_ids": doc_ids}
