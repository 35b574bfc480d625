"""Per-token, per-depth checks of context parallelism, on the model itself (no FSDP around it).

Run under torchrun (`torchrun --nproc-per-node CP -m tests.distributed.context_worker OUT
LAYOUT...`) or import `measure` for the one-process reference. Every rank builds the same seeded
model, the cp ranks split each window (`ContextShards` put in place of the model's window, as
apply_parallelism does), and for a batch with document starts on, and one off, every chunk edge each
rank writes `OUT/<layout>.rank<r>.pt`:
* `per_token`: [depths, B, S] cross-entropy of every window position at every depth (targets masked
  out are 0), gathered into window order: a target shifted after cutting the window, or a hidden row
  paired with the wrong target, shows at the chunk edges even where the totals barely move;
* `loss_sums` and `grads`: the per-depth loss sums and every parameter's gradient (summed over the
  cp ranks) for a batch whose loss mask is zero on all of cp rank 1's rows: that rank has no valid
  target, and must contribute finite zeros and the gradient one process computes.
"""

from __future__ import annotations

import os
import sys
from typing import Dict

import torch
import torch.nn.functional as F

from tests import processes
from tests.distributed import worker


def _per_token(model, batch, document_mask: bool) -> torch.Tensor:
    from tandem.models import depth_target_mask
    from tandem.models.model import window_documents, window_positions
    from tandem.models.mtp import shifted_tokens

    window = model.context
    tokens, loss_mask, doc_ids = batch["tokens"], batch["loss_mask"], batch["doc_ids"]
    b, s = tokens.shape[0], tokens.shape[1] - 1
    documents = window_documents(doc_ids, s) if document_mask else None
    positions = window.local(window_positions(documents, b, s, tokens.device))
    documents = documents.local(window) if documents is not None else None
    h0 = model.trunk(window.local(tokens[:, :s]), positions, documents=documents)
    per_depth = []
    for depth, h in model.depth_states(h0, tokens, positions, documents=documents):
        logits = model.logits(depth, h).float()
        mask = window.local(depth_target_mask(loss_mask, doc_ids, depth))
        targets = window.local(shifted_tokens(tokens, depth + 1, s))
        ce = F.cross_entropy(logits.flatten(0, 1), targets.flatten(),
                             reduction="none").view(b, -1) * mask
        per_depth.append(window.gather(ce))
    return torch.stack(per_depth)


def measure(layout: str) -> Dict[str, object]:
    """The checks of the module docstring under `layout` (cp and cp_sharding from it; 1 process when
    no process group is up)."""
    import torch.distributed as dist

    from tandem.models.model import TandemModel
    from tandem.trainer.loss import combine_losses, depth_coefficients

    cfg = worker.make_cfg(layout, 1)
    torch.manual_seed(0)
    model = TandemModel(cfg.model, cfg.mtp)
    cp = dist.get_world_size() if dist.is_initialized() else 1
    if cp > 1:
        from tandem.trainer.parallel.context import ContextShards

        model.context = ContextShards(dist.group.WORLD, cfg.parallel.cp_sharding)
    model.train()  # QSA's sparse stage (the default), with the indexer's KL on (coefficient 1)
    seq = cfg.data.seq_len
    batch = worker.global_batch(0, 2, edge_documents=True, seq=seq, padded=False)
    with torch.no_grad():
        per_token = _per_token(model, batch, cfg.data.document_mask)
    # cp rank 1's rows hold no valid target
    from tandem.trainer.parallel.context import chunks_of_rank

    # (the reference reads them too)
    layout_cp, sharding = cfg.parallel.cp, cfg.parallel.cp_sharding
    length = seq // (2 * layout_cp if sharding == "zigzag" else layout_cp)
    # (MTP depth k's target at t is masked by t + k)
    for chunk in chunks_of_rank(1, layout_cp, sharding):
        batch["loss_mask"][:, chunk * length:(chunk + 1) * length + cfg.mtp.num_steps] = 0
    from tandem.models import depth_target_mask

    counts = torch.stack([depth_target_mask(batch["loss_mask"], batch["doc_ids"], d).sum()
                          for d in range(model.num_depths)]).float()
    coefs = depth_coefficients(cfg.mtp, 0)
    out = model(batch["tokens"], batch["loss_mask"], batch["doc_ids"], cfg.data.document_mask)
    combine_losses(out.loss_sums, counts, coefs).backward()
    grads = {}
    for name, p in model.named_parameters():
        g = p.grad.clone() if p.grad is not None else torch.zeros_like(p)
        if cp > 1:
            dist.all_reduce(g)
        grads[name] = g
    return {"per_token": per_token, "loss_sums": out.loss_sums.detach(), "grads": grads}


def main(argv) -> int:
    import torch.distributed as dist

    out, layouts = argv[0], argv[1:]
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    for layout in layouts:
        torch.save(measure(layout), os.path.join(out, f"{layout}.rank{dist.get_rank()}.pt"))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    processes.finish(lambda: main(sys.argv[1:]))
