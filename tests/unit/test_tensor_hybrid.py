"""Tensor parallelism for Qwen4-Exp's layers, the parts checkable in one process: the layout checks
(one line naming the key, before any work) and the Gated DeltaNet row order the TP shards rely on
and the Hugging Face interop undoes. Equivalence to one process is
tests/distributed/test_qwen4_layouts.py."""

from __future__ import annotations

import pytest
import torch

from tandem.models.gated_deltanet import qkv_rows_from_hf
from tandem.trainer.config_checks import ConfigError
from tandem.trainer.hf.names import Src
from tandem.trainer.parallel.validate import validate_layout
from tandem.trainer.recipe import load_config
from tests.distributed import worker

Q4 = ["model.full_attention_interval=2", "model.hc_count=4", "model.hc_lowrank=8",
      "model.zero_centered_norm=true",
      "model.num_layers=4", "model.num_heads=4", "model.num_kv_heads=2", "model.num_experts=4",
      "model.head_dim=8",
      "model.partial_rotary_factor=0.5", "model.linear_num_key_heads=2",
      "model.linear_num_value_heads=4", "model.vocab_size=4096", "data.seq_len=64"]


def cfg(*overrides):
    return load_config(None, Q4 + list(overrides))


@pytest.mark.parametrize("overrides,needle", [
    (["model.linear_num_key_heads=1", "model.linear_num_value_heads=4"],
     "model.linear_num_key_heads=1 is not divisible by parallel.tp=2 (Gated DeltaNet heads are "
     "split over tp)"),
    (["model.shared_expert_intermediate_size=18", "parallel.tp=4", "model.num_heads=8",
      "model.num_kv_heads=4", "model.linear_num_key_heads=4", "model.linear_num_value_heads=8"],
     "model.shared_expert_intermediate_size=18 (the shared expert's width, 18) is not divisible "
     "by parallel.tp=4"),
    # unset, its width is the routed experts': named so (it blamed a key the user never set)
    (["model.moe_intermediate_size=127"], "model.moe_intermediate_size=127 x "
     "model.num_shared_experts=1 (the shared expert's width, 127) is not divisible by "
     "parallel.tp=2"),
    (["model.num_kv_heads=1"], "model.num_kv_heads=1 is not divisible by parallel.tp=2"),
])
def test_head_counts_not_divisible_by_tp_are_one_line_errors(overrides, needle):
    c = cfg("parallel.tp=2", *overrides)
    with pytest.raises(ConfigError) as err:
        validate_layout(c, c.parallel.tp)
    assert needle in str(err.value) and "\n" not in str(err.value)


def test_qwen4_tp_layouts_validate():
    assert validate_layout(cfg("parallel.tp=2", "parallel.sequence_parallel=true"), 2) == 1
    assert validate_layout(cfg("parallel.tp=2", "parallel.ep=2", "parallel.sequence_parallel=true"),
                           4) == 1


def test_group_order_makes_tp_shards_whole_groups_and_round_trips():
    hk, hv, dk, dv, tp = 4, 8, 3, 5, 2
    rows = qkv_rows_from_hf(hk, hv, dk, dv)
    key_dim, value_dim = hk * dk, hv * dv
    theirs = torch.arange(2 * key_dim + value_dim)  # each row labelled by its transformers index
    ours = theirs[rows]
    per_rank = ours.numel() // tp
    # a plain Shard(0) block is [q_g | k_g | v_g] for this rank's groups, in order
    for r in range(tp):
        groups = range(r * hk // tp, (r + 1) * hk // tp)
        want = torch.cat([torch.cat([torch.arange(g * dk, (g + 1) * dk),
                                     key_dim + torch.arange(g * dk, (g + 1) * dk),
                                     2 * key_dim + torch.arange(g * 2 * dv, (g + 1) * 2 * dv)])
                          for g in groups])
        assert torch.equal(ours[r * per_rank:(r + 1) * per_rank], want)
    src = Src(["w"], qkv_groups=(hk, hv, dk, dv))
    w = torch.randn(theirs.numel(), 7)
    assert torch.equal(src.to_model_rows(w), w[rows])
    assert torch.equal(src.to_checkpoint_rows(src.to_model_rows(w)), w)


# --- two tp ranks select alike (2 processes on gloo) ----------------------------------------------
TP_LAYOUTS = ["tp=2,preset.qwen4=1", "tp=2,sequence_parallel=true,preset.qwen4=1"]


def _select_alike_rank(rank: int, world: int, out: str) -> None:
    import torch.distributed as dist

    from tandem.models.qsa import IndexedAttention
    from tandem.trainer.loss import depth_coefficients
    from tandem.trainer.parallel import init_parallel
    from tandem.trainer.parallel.device import resolve_device
    from tandem.trainer.run import build_model
    from tandem.trainer.step import TrainStep

    result = {}
    select = IndexedAttention.select_blocks
    for layout in TP_LAYOUTS:
        cfg = worker.make_cfg(layout, 1)
        pstate = init_parallel(cfg, resolve_device("cpu"))
        model = build_model(cfg, pstate)
        tr = TrainStep(cfg, model, pstate)
        model.train()  # forward_backward's default stage is the sparse one: selection and its KL
        chosen = []

        def recording(self, scores_bsn, query_at_bs, *layout):
            blocks, count = select(self, scores_bsn, query_at_bs, *layout)
            chosen.append(torch.cat([blocks.flatten(), count.flatten()]))
            return blocks, count

        IndexedAttention.select_blocks = recording
        try:
            batches = worker.rank_micro_batches(0, pstate.dp_rank, pstate.dp_size, 1)
            tr.forward_backward(batches, tr.global_target_counts(batches),
                                depth_coefficients(cfg.mtp, 1))
        finally:
            IndexedAttention.select_blocks = select
        tr.clip_gradients()  # finishes the gradients (tp sums) as a training step does
        mine = [torch.cat(chosen).double(),
                torch.cat([p.grad.flatten() for n,
                           p in model.named_parameters() if ".indexer." in n]).double()]
        same = []
        for t in mine:
            copies = [torch.empty_like(t) for _ in range(world)]
            dist.all_gather(copies, t)
            same.append(all(torch.equal(c, copies[0]) for c in copies))
        result[layout] = {"selections_equal": same[0], "indexer_grads_equal": same[1],
                          "layers": len(chosen), "selected": int(sum(c.numel() for c in chosen))}
    if rank == 0:
        torch.save(result, out)
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.distributed
def test_tp_ranks_select_the_same_qsa_positions(tmp_path):
    """The replicated indexer reads the whole input on every rank: both tp ranks select the same
    blocks in every QSA layer (trunk and MTP), and the indexers' finished gradients are bitwise
    equal."""
    out = str(tmp_path / "result.pt")
    worker.spawn_ranks(_select_alike_rank, 2, out)
    result = torch.load(out, weights_only=False)
    for layout in TP_LAYOUTS:
        r = result[layout]
        # trunk QSA layers 1, 3 and the MTP's
        assert r["layers"] >= 3 and r["selected"] > 0, (layout, r)
        assert r["selections_equal"] and r["indexer_grads_equal"], (layout, r)


def test_sharded_ngram_table_in_one_process_equals_the_plain_lookup():
    """The PLE table sharded over a (one-rank) stage group: the owner sort, the all-to-alls and
    their inverse give the plain embedding's rows, and the backward adds the rows' gradients into
    `.grad` in place, accumulating over micro-batches like autograd's dense gradient. The multi-rank
    lookups are tests/distributed/test_qwen4_layouts.py's."""
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh

    from tandem.trainer.parallel.tensor_hybrid import ShardedNGramTable, shard_ple_tables

    created = False
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        created = True
    try:
        torch.manual_seed(0)
        ref = nn.Embedding(37, 3)
        block = nn.Module()
        block.ple = nn.Module()
        block.ple.ple_embedding = nn.Module()
        block.ple.ple_embedding.ngram_embedding = table = nn.Embedding(37, 3)
        table.weight.data.copy_(ref.weight.data)
        model = nn.Module()
        model.layers = nn.ModuleDict({"1": block})
        names = shard_ple_tables(model, init_device_mesh("cpu", (1,)), exchange_dtype=None)
        assert names == ["layers.1.ple.ple_embedding.ngram_embedding.weight"]
        table = block.ple.ple_embedding.ngram_embedding  # the sharded table built from the model's
        assert isinstance(table, ShardedNGramTable) and table.row_starts.tolist() == [0, 37]
        for _ in range(2):  # two micro-batches: gradients accumulate
            ids = torch.randint(0, 37, (2, 5, 4))
            ids[0, 0] = ids[1, 1]  # repeated rows sum
            out = table(ids)
            want = ref(ids)
            assert torch.equal(out, want)
            g = torch.randn_like(want)
            out.backward(g)
            want.backward(g)
        torch.testing.assert_close(table.weight.grad.to_local(), ref.weight.grad)
    finally:
        if created:
            dist.destroy_process_group()
