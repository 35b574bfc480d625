"""The evaluator's teacher-forced figures (eval/metrics.py `teacher_forced`) run the head chunk by
chunk (issue 20, item 4): the same losses and top-1 accuracies as full-vocabulary logits gave, while
no tensor of [more than one chunk x vocab] is ever allocated."""

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from tandem.eval.metrics import teacher_forced
from tandem.models import TandemModel
from tandem.models.config import ModelConfig
from tandem.models.mtp import depth_target_mask, shifted_tokens
from tandem.models.mtp_config import MTPConfig

VOCAB, BATCH, SEQ, CHUNK = 512, 2, 48, 16


def counting(start: torch.Tensor) -> torch.Tensor:
    """Sequences that count up from `start` (mod the vocabulary): learnable in a few steps."""
    return (start + torch.arange(SEQ + 1)) % VOCAB


@pytest.fixture(scope="module")
def model():
    return trained_model()


def trained_model() -> TandemModel:
    """A tiny MoE + 2-depth MTP model trained 10 steps on counting sequences, so that its top-1
    accuracies sit well inside (0, 1) and an argmax that differed anywhere would show."""
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=VOCAB, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                      intermediate_size=64, moe_intermediate_size=16, num_experts=4, top_k=2,
                      num_shared_experts=1, first_k_dense=1, max_seq_len=64)
    model = TandemModel(cfg, MTPConfig(num_steps=2, num_layers=1, loss_chunk_tokens=CHUNK))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(3)
    for _ in range(10):
        out = model(counting(torch.randint(0, VOCAB, (4, 1), generator=g)))
        (out.loss_sums.sum() / out.token_counts.sum()).backward()
        opt.step()
        opt.zero_grad()
    return model.eval()


def batches():
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(2):
        tokens = counting(torch.randint(0, VOCAB, (BATCH, 1), generator=g))
        tokens[:, SEQ // 2] = 7  # a break in the count
        eod = torch.rand(BATCH, SEQ + 1, generator=g) < 0.05
        out.append({"tokens": tokens,
                    "loss_mask": (torch.rand(BATCH, SEQ, generator=g) > 0.1).float(),
                    "doc_ids": torch.cumsum(eod.long(), dim=1) - eod.long()})
    return out


@torch.no_grad()
def full_vocab_teacher_forced(m, data):
    """The evaluator before chunking: [tokens x vocab] logits per depth, cross-entropy and
    argmax."""
    loss, correct, count = (torch.zeros(m.num_depths, dtype=torch.float64) for _ in range(3))
    for batch in data:
        tokens = batch["tokens"]
        b, s = tokens.shape[0], tokens.shape[1] - 1
        pos = torch.arange(s).expand(b, s)
        for d, h in m.depth_states(m.trunk(tokens[:, :s], pos), tokens, pos):
            mask = depth_target_mask(batch["loss_mask"], batch["doc_ids"], d)
            logits = m.logits(d, h[mask]).float()
            targets = shifted_tokens(tokens, d + 1, s)[mask]
            loss[d] += float(F.cross_entropy(logits, targets, reduction="sum"))
            correct[d] += float((logits.argmax(-1) == targets).sum())
            count[d] += float(mask.sum())
    out = {"loss/main": float(loss[0] / count[0])}
    out.update({f"loss/mtp_{d}": float(loss[d] / count[d]) for d in range(1, m.num_depths)})
    out.update({f"tf_acc/mtp_{d}": float(correct[d] / count[d]) for d in range(1, m.num_depths)})
    return out


class LargestVocabTensor(TorchDispatchMode):
    """Records the largest element count of any op output whose last dimension is the vocabulary."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        # views allocate nothing (e.g. the head weight's transpose, [hidden x vocab])
        if func.is_view:
            return out
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.dim() >= 2 and t.shape[-1] == VOCAB:
                self.largest = max(self.largest, t.numel())
        return out


@pytest.mark.parametrize("dtype", [None, torch.bfloat16], ids=["fp32", "bf16"])
def test_chunked_figures_equal_full_vocabulary_figures(model, dtype):
    data = batches()
    with torch.autocast("cpu", dtype=dtype or torch.float32, enabled=dtype is not None):
        want = full_vocab_teacher_forced(model, data)
        got = teacher_forced(model, data)
    assert set(got) == set(want)
    for key, value in want.items():
        if key.startswith("tf_acc/"):  # same argmax on every row: exactly the same count
            assert got[key] == value, key
        else:  # the loss sums chunk sums: fp32 summation order only
            assert got[key] == pytest.approx(value, rel=1e-6, abs=0), key
    assert 0.05 < want["tf_acc/mtp_1"] < 0.95 and 0.05 < want["tf_acc/mtp_2"] < 0.95


@pytest.mark.parametrize("document_mask", [False, True])
def test_losses_equal_the_training_forwards(model, document_mask):
    """Per depth, the evaluator's mean loss is the training forward's loss sum over its target
    count (models/loss.py: another path to the same sums), with packed documents kept apart or
    not; and the two settings differ (the batches hold document boundaries)."""
    data = batches()
    got = teacher_forced(model, data, document_mask=document_mask)
    with torch.no_grad():
        outs = [model(b["tokens"], b["loss_mask"], b["doc_ids"], document_mask=document_mask)
                for b in data]
    sums = sum(o.loss_sums.double() for o in outs)
    counts = sum(o.token_counts.double() for o in outs)
    keys = ["loss/main"] + [f"loss/mtp_{d}" for d in range(1, model.num_depths)]
    for d, key in enumerate(keys):
        assert got[key] == pytest.approx(float(sums[d] / counts[d]), rel=1e-5), key
    other = teacher_forced(model, data, document_mask=not document_mask)
    assert all(abs(other[key] - got[key]) > 1e-4 for key in keys)


def test_no_tensor_larger_than_a_chunk_of_logits(model):
    data = batches()
    tokens_per_depth = BATCH * SEQ  # rows of one depth's logits before chunking (at most)
    with LargestVocabTensor() as old:
        full_vocab_teacher_forced(model, data)
    with LargestVocabTensor() as new:
        teacher_forced(model, data)
    assert old.largest > 2 * CHUNK * VOCAB  # what the check would catch: ~[tokens x vocab]
    assert new.largest <= CHUNK * VOCAB, f"{new.largest} elements > {CHUNK} x {VOCAB}"
    assert old.largest <= tokens_per_depth * VOCAB


def test_a_depth_without_targets_has_no_figure(model):
    """Windows of 2 tokens hold one main-head target and none for the MTP depths (depth d needs d +
    2 tokens): only `loss/main` is reported; 0.0 for the others read as a perfect loss."""
    batch = {"tokens": counting(torch.tensor([[5], [9]]))[:, :2]}
    out = teacher_forced(model, [batch])
    assert set(out) == {"loss/main"} and out["loss/main"] > 0
