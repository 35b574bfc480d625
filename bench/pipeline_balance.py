"""Pipeline stage balance of a recipe: training FLOPs per token on every stage, before and after
placing the loss depths (trainer/parallel/pipeline_plan.py).

FLOPs are trainer/estimate.py's accounting: a trunk layer 3x its forward (attention with the causal
half of the s^2 term, the top-k routed and shared experts, the router), an MTP depth its layer (3x)
plus its vocabulary head (3x its forward under the fused backward, 4x where it recomputes its logits
chunks in backward: cost.head_passes) over the depth's share of valid targets. No model is built;
nothing runs on a device.

Printed for the recipe's pipeline, for 2, 3 and 4 stages per rank (interleaved schedules): first the
placement before pipeline_plan existed (the even layer split, every depth on the last stage; the
first figure printed is the recipe's of that time, 2 stages per rank), then `pp_balance`'s, each
with per-stage and per-pp-rank FLOPs (under the interleaved schedule a rank runs several stages);
then the recipe as configured. The last line is the configured placement's `max_stage_over_mean=`.

    python bench/pipeline_balance.py [--recipe recipes/moe_4b_mtp_gpu.yaml] [--set key=value ...]
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tandem.trainer.parallel.pipeline_plan import PipelinePlan, item_flops, stage_flops  # noqa: E402
from tandem.trainer.recipe import load_config  # noqa: E402

DEFAULT_RECIPE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                              "recipes", "moe_4b_mtp_gpu.yaml")


def report(title: str, cfg) -> float:
    plan = PipelinePlan(cfg)
    plan.check(cfg)
    layers, depths = item_flops(cfg)
    flops = stage_flops(layers, depths, plan.layout, plan.depth_stage)
    mean = sum(flops) / len(flops)
    print(f"{title}: {plan.n_stages} stages (pp={plan.pp}), layers per stage {plan.layout}, "
          f"depth stages {plan.depth_stage} (depth 0 = the trunk's head)")
    for s, f in enumerate(flops):
        st = plan.stages[s]
        print(f"  stage {s} (pp rank {plan.stage_rank(s)}): {f / 1e9:6.2f} GFLOP/token  "
              f"x{f / mean:.2f} of the mean"
              "  layers "
              f"{st.layers[0] if st.layers else '-'}..{st.layers[-1] if st.layers else '-'}"
              f"  depths {st.depths or '-'}")
    ranks = [sum(flops[s] for s in plan.stages_of(r)) for r in range(plan.pp)]
    print(f"  per pp rank: {', '.join(f'{r / 1e9:.2f}' for r in ranks)} GFLOP/token; "
          f"max_rank_over_mean={max(ranks) / (sum(ranks) / len(ranks)):.3f}")
    ratio = max(flops) / mean
    print(f"  max_stage_over_mean={ratio:.3f}")
    return ratio


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--recipe", default=DEFAULT_RECIPE)
    p.add_argument("--set", nargs="*", default=[], help="config overrides (key=value)")
    a = p.parse_args()
    cfg = load_config(a.recipe, a.set)
    par = cfg.parallel
    layers, depths = item_flops(cfg)
    print(f"{os.path.basename(a.recipe)}: {cfg.model.num_layers} layers, K={cfg.mtp.num_steps}, "
          f"vocab {cfg.model.vocab_size}, hidden {cfg.model.hidden_size}, seq {cfg.data.seq_len}; "
          "training "
          f"GFLOP/token: trunk layer {min(layers) / 1e9:.3f}..{max(layers) / 1e9:.3f}, the trunk's "
          "head "
          f"{depths[0] / 1e9:.3f}, MTP depth (layer + head) {max(depths[1:], default=0) / 1e9:.3f}")
    plain = ["parallel.pp_balance=false", "parallel.pp_layout=[]", "parallel.pp_depth_stages=[]"]
    virtuals = sorted({2, 3, 4,
                       par.pp_virtual_stages}) if par.pp_schedule == "interleaved_1f1b" else [1]
    for v in virtuals:
        stages = (
            [f"parallel.pp_virtual_stages={v}"] if par.pp_schedule == "interleaved_1f1b" else []
        )
        report(f"every depth on the last stage, even layers ({v} stage(s) per rank; the placement "
               "before "
               "pipeline_plan)", load_config(a.recipe, a.set + plain + stages))
        report(f"pp_balance ({v} stage(s) per rank)",
               load_config(a.recipe, a.set + plain[1:] + stages
                                                                  + ["parallel.pp_balance=true"]))
    ratio = report("configured", cfg)
    print(f"max_stage_over_mean={ratio:.3f}")


if __name__ == "__main__":
    main()
