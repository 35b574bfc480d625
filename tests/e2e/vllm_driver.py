"""Serve an exported MTP checkpoint with vLLM (greedy, MTP speculation) and print one JSON object.

Run with the Python of a virtual environment that has vLLM (not the project's): it never imports
tandem. Usage: python vllm_driver.py MODEL_DIR PROMPTS_JSON [--k 3] [--max-tokens N] [--eos ID]
[--dtype float32]
PROMPTS_JSON holds a list of token-id lists; prompts go in as token ids (TokensPrompt), so no
tokenizer is involved on either side.
Output: {"outputs": [[ids]...], "metrics": {"num_drafts", "num_draft_tokens", "num_accepted_tokens",
"accepted_per_pos"}, "load_s", "generate_s"}.
"""

import argparse
import json
import os
import sys
import time


def counters(metrics) -> dict:
    """vLLM's spec-decode counters (summed over label sets) from LLM.get_metrics()."""
    out = {"num_drafts": 0, "num_draft_tokens": 0, "num_accepted_tokens": 0, "accepted_per_pos": []}
    for m in metrics:
        name = m.name.removesuffix("_total")
        if name == "vllm:spec_decode_num_drafts":
            out["num_drafts"] += int(m.value)
        elif name == "vllm:spec_decode_num_draft_tokens":
            out["num_draft_tokens"] += int(m.value)
        elif name == "vllm:spec_decode_num_accepted_tokens":
            out["num_accepted_tokens"] += int(m.value)
        elif name == "vllm:spec_decode_num_accepted_tokens_per_pos":
            vals = [int(v) for v in m.values]
            acc = out["accepted_per_pos"]
            out["accepted_per_pos"] = [a + b for a, b in zip(acc, vals)] if acc else vals
    return out


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("model")
    p.add_argument("prompts")
    p.add_argument("--k", type=int, default=3, help="num_speculative_tokens (MTP drafts per round)")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--eos", type=int, default=None,
                   help="stop after this token id (kept in the output, as Tandem does)")
    p.add_argument("--max-model-len", type=int, default=256)
    p.add_argument("--dtype", default="float32",
                   help="the weights' dtype in vLLM (its CPU MLA kernels take bfloat16 only)")
    p.add_argument("--memory", type=float, default=0.1,
                   help="gpu_memory_utilization: on the CPU build the fraction of host memory for "
                        "the KV cache")
    args = p.parse_args()
    with open(args.prompts) as f:
        prompts = json.load(f)
    if not prompts or not all(isinstance(x, list) and x for x in prompts):
        print(f"vllm_driver: {args.prompts} must hold a non-empty list of non-empty token-id lists",
              file=sys.stderr)
        return 2
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    t0 = time.perf_counter()
    llm = LLM(model=args.model, skip_tokenizer_init=True, dtype=args.dtype,
              max_model_len=args.max_model_len,
              gpu_memory_utilization=args.memory, enforce_eager=True, disable_log_stats=False,
              seed=0,
              speculative_config={"method": "mtp",
                                  "num_speculative_tokens": args.k} if args.k else None)
    t1 = time.perf_counter()
    # No tokenizer is loaded, so the end token comes in as a stop token id (None: run to
    # max_tokens).
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, detokenize=False,
                            stop_token_ids=[args.eos] if args.eos is not None else None)
    results = llm.generate([TokensPrompt(prompt_token_ids=x) for x in prompts], params,
                           use_tqdm=False)
    t2 = time.perf_counter()
    out = {"outputs": [list(r.outputs[0].token_ids) for r in results],
           "metrics": counters(llm.get_metrics()), "load_s": t1 - t0, "generate_s": t2 - t1}
    print("VLLM_RESULT " + json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":  # vLLM spawns its engine process: this module is re-imported there
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    sys.exit(main())
