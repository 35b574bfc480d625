"""QSA under context parallelism equals one process, token for token: a real `ContextShards` (gloo,
cp = 2 and 4, zigzag and contiguous) gives each rank's rows the outputs, input gradients and
selection one process computes for them, the ranks' parameter gradients and indexer KLs sum to one
process's, and their recalls average to it; in both training forms and stages, with a selection
handed to a second layer (an MTP depth reusing depth 1's), without and with packed documents whose
boundaries fall on chunk edges and one row either side of them; switched off (evaluation) the
shards exchange nothing. This file is also the torchrun worker."""

from __future__ import annotations

import sys

import pytest

from tests import processes

pytestmark = [pytest.mark.distributed]

B, S, HIDDEN, BUDGET, RATIO = 2, 32, 32, 8, 4
# document lengths per row: starts 0, 8, 16, 25 and 0, 7, 17 (chunk edges at multiples of 8 or 4)
LENGTHS = ([8, 8, 9, 7], [7, 10, 15])
CASES = [("mask", False), ("gather", False), ("mask", True)]


def _layer(seed: int, form: str):
    import torch

    from tandem.models.qsa import IndexedAttention

    torch.manual_seed(seed)
    layer = IndexedAttention(HIDDEN, 4, 2, 8, 0.5, 10000.0, 64, 1e-6, 2, 16, BUDGET, RATIO,
                             form=form, indexer_loss_coef=0.5).train()
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0, 0.3)
    layer.chunk_elems = 300
    return layer


def _step(layers, x, pos, g, documents, context, local, dense):
    """Both layers' forward and backward (the second reusing the first's selection) on `local`'s
    rows, measuring the first's recall."""
    import torch

    from tandem.models.qsa_loss import measuring_recall

    x = local(x).detach().requires_grad_()
    for layer in layers:
        layer.zero_grad(set_to_none=True)
    with measuring_recall():
        y1, sel = layers[0](x, local(pos), return_selection=True, documents=documents,
                            context=context, dense=dense)
        y2 = layers[1](x, local(pos), selection=sel, documents=documents, context=context,
                       dense=dense)
    ((y1 + y2) * local(g)).sum().backward()
    # a reusing indexer: none
    grads = torch.cat([torch.zeros(p.numel()) if p.grad is None else p.grad.flatten()
                       for layer in layers for p in layer.parameters()])
    return dict(
        y=torch.cat([y1, y2], -1),
        gx=x.grad,
        grads=grads,
        loss=layers[0].last_indexer_loss,
        recall=layers[0].last_recall,
        sel=None if sel is None else torch.cat([sel.blocks_bsk.flatten(), sel.counts_bs.flatten()]),
    )


def _check(sharding: str) -> None:
    from types import SimpleNamespace

    import torch
    import torch.distributed as dist

    from tandem.models.documents import Documents
    from tandem.trainer.parallel.context import ContextShards

    ctx = ContextShards(dist.group.WORLD, sharding)
    cp = dist.get_world_size()
    # switched off (evaluation: each rank holds other windows, whole), every exchange is the one
    # process identity; gather and sum exchanged regardless, and a forward that met them failed
    # (zigzag) or read the other ranks' windows as its own (contiguous)
    off = ContextShards(dist.group.WORLD, sharding, switch=SimpleNamespace(on=False))
    mine = torch.randn(B, 6, 3) + dist.get_rank()
    assert torch.equal(off.gather(mine), mine) and torch.equal(off.sum(mine), mine)
    assert torch.equal(off.halo(off.split(mine), 2, fill=7.0), torch.full((B, 2, 3), 7.0))
    assert off.carry(torch.eye(3).expand(B, 2, 3, 3), mine[:, :2, :, None]) is None
    g = torch.Generator().manual_seed(0)
    x = torch.randn(B, S, HIDDEN, generator=g) + 1.5 * torch.randn(HIDDEN, generator=g)
    grad_out = torch.randn(B, S, HIDDEN, generator=g)
    ids = torch.stack([torch.repeat_interleave(torch.arange(len(r)),
                                               torch.tensor(r)) for r in LENGTHS])
    for packed in (False, True):
        docs = Documents.from_doc_ids(ids) if packed else None
        pos = docs.positions() if packed else torch.arange(S).expand(B, S)
        for form, dense in CASES:
            def layers():
                return [_layer(1, form), _layer(2, form)]

            want = _step(layers(), x, pos, grad_out, docs, None, lambda t: t, dense)
            got = _step(layers(), x, pos, grad_out, None if docs is None else docs.local(ctx), ctx,
                        ctx.local, dense)
            where = f"{sharding} cp={cp} packed={packed} form={form} dense={dense}"
            if want["sel"] is not None:
                n = B * S * (BUDGET // RATIO)
                want_sel = torch.cat([ctx.local(want["sel"][:n].view(B, S, -1)).flatten(),
                                      ctx.local(want["sel"][n:].view(B, S)).flatten()])
                assert torch.equal(got["sel"], want_sel), where
            for key in ("y", "gx"):
                torch.testing.assert_close(got[key], ctx.local(want[key]), rtol=1e-4, atol=1e-5,
                                           msg=lambda m: f"{where} {key}: {m}")
            for key, op in (("grads", "sum"), ("loss", "sum"), ("recall", "mean")):
                total = got[key].clone()
                dist.all_reduce(total)
                total = total / cp if op == "mean" else total
                torch.testing.assert_close(total, want[key], rtol=1e-4, atol=1e-5,
                                           msg=lambda m: f"{where} {key}: {m}")


def main(argv) -> int:
    """argv: the output directory (unused: the checks run here), the shardings to check."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    try:
        for sharding in argv[1].split(","):
            _check(sharding)
    finally:
        dist.destroy_process_group()
    return 0


CASES_BY_CP = {2: "zigzag,contiguous", 4: "zigzag"}
# in the suite's shared launches (shared_launch.py): each rank checks its rows
SHARED_JOBS = [(cp, __name__, [shardings]) for cp, shardings in CASES_BY_CP.items()]


@pytest.mark.parametrize("cp", list(CASES_BY_CP))
def test_qsa_under_context_parallelism_equals_one_process(cp, shared_launches):
    shared_launches.check(__name__.rsplit(".", 1)[-1], cp)


if __name__ == "__main__":
    processes.finish(lambda: main(sys.argv[1:]))
