"""Per-step sample positions and batch assembly: `batch_indices` (which samples one micro-batch of
one data-parallel rank reads), `DataPosition` (a run's place in its sample stream, kept in
checkpoints) and `get_batch` (samples into tensors). Pure functions of indices and counts, apart
from building the datasets (data_pipeline/dataset.py), so no loader state exists: a resume under
any global batch continues at the next unconsumed sample.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

import torch
from torch.utils.data import ConcatDataset


def batch_indices(step_samples: Sequence[int], micro_step: int, grad_accum_steps: int,
                  dp_rank: int, dp_size: int, micro_batch_size: int) -> List[int]:
    """Dataset indices of one micro-batch on one data-parallel rank, in the optimizer step that
    reads `step_samples` (`DataPosition.step_samples()`: G = micro_batch_size * grad_accum_steps *
    dp_size indices), ordered micro-step-major, then dp rank, then sample:

        start = (micro_step*dp_size + dp_rank) * micro_batch_size
        indices = step_samples[start : start + micro_batch_size]

    so the union over dp ranks and micro-steps of a step is exactly what a dp=1 run with
    dp_size*grad_accum_steps micro-batches sees (its micro-step m' = micro_step*dp_size + dp_rank).
    """
    if not (0 <= micro_step < grad_accum_steps and 0 <= dp_rank < dp_size and micro_batch_size > 0
            and len(step_samples) == micro_batch_size * grad_accum_steps * dp_size):
        raise ValueError(
            f"batch_indices: need 0 <= micro_step ({micro_step}) < grad_accum_steps "
            f"({grad_accum_steps}), 0 <= dp_rank ({dp_rank}) < dp_size ({dp_size}), "
            f"micro_batch_size ({micro_batch_size}) > 0 and their product of step samples, not "
            f"{len(step_samples)}")
    start = (micro_step * dp_size + dp_rank) * micro_batch_size
    return [int(i) for i in step_samples[start:start + micro_batch_size]]


class DataPosition:
    """A run's place in its stream of training samples: the sampler's whole state, kept in every
    checkpoint's trainer_state.json.

    * `consumed_samples`, `consumed_tokens`: what the run's optimizer steps have drawn (a step whose
      update the `skip` policy dropped counts: its batch was drawn), summed step by step, so they
      stay right across resumes under another global batch.
    * `skipped`: [start, end) dataset-index ranges passed over by the `rewind` policy (the samples
      of a bad step), sorted and disjoint.
    * `step_samples()`: the dataset indices the next step reads: the `global_batch` samples of the
      stream from `consumed_samples` on, where the stream is the dataset's samples in order with the
      skipped ranges left out. A resume continues from exactly there whatever its global batch
      (another layout, micro-batch size or accumulation), even where a step of the new global batch
      reaches across a skipped range; `step x global batch` would skip or repeat samples.
    * `stream_builds`: the samples each build of the training stream was asked for, in order, kept
      across resumes: megatron-core orders a build's samples by how many are asked for (the epochs
      they take), so a resume asks each build for its number again, and one that needs more
      samples than the builds hold appends a build (`StreamBuilds`, trainer/run.py) rather than
      asking the first for more, which re-shuffled the samples already read.
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
        self.stream_builds: List[int] = []
        self.skipped: List[Tuple[int, int]] = []

    def sample_at(self, position: int) -> int:
        """The dataset index of the stream's sample `position` (skipped ranges left out)."""
        index = int(position)
        for start, end in self.skipped:  # sorted and disjoint
            if start > index:
                break
            index += end - start
        return index

    def next_sample(self) -> int:
        """The dataset index of the next step's first sample."""
        return self.sample_at(self.consumed_samples)

    def step_samples(self) -> List[int]:
        """The dataset indices the next step reads."""
        return [self.sample_at(c) for c in range(self.consumed_samples,
                                                 self.consumed_samples + self.global_batch)]

    def step_ranges(self) -> List[Tuple[int, int]]:
        """`step_samples()` as [start, end) ranges: one, unless the step reaches across a skipped
        range."""
        ranges: List[Tuple[int, int]] = []
        for i in self.step_samples():
            if ranges and ranges[-1][1] == i:
                ranges[-1] = (ranges[-1][0], i + 1)
            else:
                ranges.append((i, i + 1))
        return ranges

    def end_sample(self, steps: int) -> int:
        """One past the last dataset index the next `steps` steps read."""
        return self.sample_at(self.consumed_samples + steps * self.global_batch - 1) + 1

    def advance(self) -> None:
        """An optimizer step drew its global batch."""
        self.consumed_samples += self.global_batch
        self.consumed_tokens += self.global_batch * self.seq_len

    def skip(self, ranges) -> None:
        """Pass over these [start, end) dataset-index ranges when the stream reaches them."""
        merged: List[Tuple[int, int]] = []
        for a, b in sorted({(int(a), int(b)) for a, b in ranges} | set(self.skipped)):
            if merged and a <= merged[-1][1]:
                merged[-1] = (merged[-1][0], max(merged[-1][1], b))
            else:
                merged.append((a, b))
        self.skipped = merged

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
                "skipped_samples": [list(r) for r in self.skipped],
                "stream_builds": list(self.stream_builds)}

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
            # before builds were appended: the one build's samples (0: none recorded)
            old = int(state.get("stream_samples", 0))
            self.stream_builds = [int(n) for n in state.get("stream_builds", [old] if old else [])]
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


class StreamBuilds(ConcatDataset):
    """The training stream as the builds a run has appended (`DataPosition.stream_builds`), each a
    dataset of its own samples in its own order: sample i of the stream is the first build's while
    it holds one, then the next build's. The first build's megatron config (its tokenizer's EOD)
    stands for all."""

    @property
    def config(self):
        return getattr(self.datasets[0], "config", None)


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
    * `loss_mask` FloatTensor [B, seq_len]: 1 where target t (tokens[:, t+1]) counts: 0 for
      padding and prompts (the model also drops every target across a document boundary:
      models/mtp.py depth_target_mask).
    * `doc_ids`   LongTensor [B, seq_len+1]: positions i, j belong to the same document iff their
      doc_ids are equal. Samples carry their own (megatron prefixes: the stored documents'
      boundaries; chat records: the records'); for a dataset whose samples carry none, the number
      of EOD tokens strictly before each position in the window.
    * `padding`   BoolTensor [B, seq_len], only when a sample carries it (chat windows): the inputs
      that are padding, which MoE layers leave out of their loads and auxiliary losses.

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
    loss_mask = torch.stack([s["loss_mask"] for s in samples]).float()
    batch = {"tokens": tokens_t, "loss_mask": loss_mask, "doc_ids": doc_ids}
    if any("padding" in s for s in samples):  # (a sample without the flag has none)
        batch["padding"] = torch.stack([s.get("padding", torch.zeros(len(s["loss_mask"]),
                                                                     dtype=torch.bool))
                                        for s in samples]).bool()
    return batch
