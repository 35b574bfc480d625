"""Named model flavors: one home for every model shape the recipes, tests and benchmarks share.

A flavor is a partial config in the config's own key names, `{"model": {...}}` (and an `mtp` part
where the MTP module's shape belongs to the flavor; the recipes' flavors leave the MTP module to the
recipe); what it leaves out keeps the value of whatever lies beneath it. Three ways in:

- a recipe's top-level `flavor: NAME` (trainer/config.py `load_config`): the flavor lies above the
  schema's defaults and the recipe's `base:` recipes, beneath the recipe's own sections and the
  command line, so `model:` keys in the recipe still win;
- `flavor=NAME` among the `key=value` overrides (`tandem train recipes/tiny.yaml flavor=debug`), or
  `overrides(NAME)`, the same as a `key=value` list: expanded in place, so later overrides win;
- `model_config(NAME, **changes)` / `mtp_config(NAME, **changes)` for code that builds the
  dataclasses directly (the unit tests), over the dataclass defaults.

The flavors (torchtitan's models/llama3/__init__.py keeps its named flavors the same way):

- `debug`: the test suite's seconds-long model (tests/conftest.py TINY_OVERRIDES): 2 layers of width
  32, 4 experts. Its 512-token vocabulary needs `data.vocab_size<=512` with the embedded corpus.
- `debug_mla`: `debug` with DeepSeek-V3's attention (MLA, YaRN), for the MLA layouts and parity.
- `debug_qwen4`: Qwen4-Exp in the same size (Gated DeltaNet, QSA, 4 hyper-connection streams, PLE on
  layer 0, a gated shared expert), for the unit tests of the seed model's parts and its drafter.
- `tiny`: recipes/tiny.yaml's 2.7M-parameter MoE trunk, the default job's.
- `qwen4_exp_tiny`: recipes/qwen4_exp_tiny.yaml's Qwen4-Exp in miniature.
- `moe_4b`: the DeepSeek-V3-like ~5.2B-total / ~1.2B-active MoE of
  recipes/moe_4b_mtp_{gpu,ascend}.yaml.
- `qwen38_flash`: Qwen3.8-Flash-Next at its published shape (~179B),
  recipes/qwen38_flash_{gpu,ascend}.yaml.

Pure data: this module imports neither torch nor the trainer.
"""

from __future__ import annotations

import copy
import json
from typing import Any, Dict, List

from .config import ModelConfig
from .mtp_config import MTPConfig

Flavor = Dict[str, Dict[str, Any]]

_DEBUG = dict(vocab_size=512, hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1,
              intermediate_size=64, moe_intermediate_size=32, num_experts=4)

# the debug model with DeepSeek-V3's attention: MLA with a compressed query, YaRN at 4x a 16-token
# original context (its mscales as DeepSeek-V3 sets them)
_DEBUG_MLA = dict(
    _DEBUG, num_kv_heads=2, kv_lora_rank=16, q_lora_rank=12, qk_nope_head_dim=8, qk_rope_head_dim=4,
    v_head_dim=8, rope_scaling="yarn", rope_factor=4.0, rope_original_max_len=16, rope_mscale=1.0,
    rope_mscale_all_dim=1.0)

_DEBUG_QWEN4 = dict(
    vocab_size=64, hidden_size=32, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=8,
    moe_intermediate_size=16,
    num_experts=4, top_k=2, num_shared_experts=1, shared_expert_gate=True, first_k_dense=0,
    router_score="softmax",
    balance="aux_loss", zero_centered_norm=True, full_attention_interval=2,
    partial_rotary_factor=0.5,
    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
    linear_value_head_dim=8,
    indexer_heads=16, indexer_head_dim=8, indexer_budget=8, indexer_compress_ratio=4, hc_count=4,
    hc_lowrank=8,
    ple_layers=[0], heads_per_ngram=2, ngram_vocab_base=97, eos_token_id=1, max_seq_len=128)

_TINY = dict(
    vocab_size=2048, hidden_size=128, num_layers=4, num_heads=4, num_kv_heads=2,
    intermediate_size=384,
    moe_intermediate_size=128, num_experts=8, top_k=2, num_shared_experts=1, first_k_dense=1,
    router_score="sigmoid",
    balance="aux_free", max_seq_len=512)

_QWEN4_EXP_TINY = dict(
    vocab_size=2048, hidden_size=128, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=32,
    partial_rotary_factor=0.25, rope_theta=10000000.0, intermediate_size=128,
    moe_intermediate_size=128,
    shared_expert_intermediate_size=128, shared_expert_gate=True, num_experts=8, top_k=2,
    num_shared_experts=1,
    first_k_dense=0, router_score="softmax", balance="aux_loss", zero_centered_norm=True,
    full_attention_interval=4,
    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=32,
    linear_value_head_dim=32,
    indexer_heads=2, indexer_head_dim=32, indexer_budget=64, indexer_compress_ratio=4,
    indexer_warmup_steps=30,
    hc_count=4, hc_lowrank=32, ple_layers=[1], ple_embed_dim=64, heads_per_ngram=4,
    ngram_vocab_base=4093, eos_token_id=0, max_seq_len=512)

# 16 layers (first dense), 64 routed experts top-6 with 2 shared experts, sigmoid router with
# aux-loss-free balancing and DeepSeek-V3's group-limited routing, GQA attention (where DeepSeek-V3
# has MLA: the `debug_mla` flavor shows its keys)
_MOE_4B = dict(
    vocab_size=102400, hidden_size=2048, num_layers=16, num_heads=16, num_kv_heads=4, head_dim=128,
    intermediate_size=10944, moe_intermediate_size=704, num_experts=64, top_k=6,
    num_shared_experts=2,
    first_k_dense=1, router_score="sigmoid", norm_topk_prob=True, routed_scaling_factor=2.5,
    n_group=8, topk_group=4,
    balance="aux_free", bias_update_rate=1.0e-3, rope_theta=10000.0, max_seq_len=4160)

# hidden 2560, 48 layers on the hybrid schedule (36 Gated DeltaNet, 12 QSA at 0-based 3, 7, ...,
# 47), 24 heads / 2 KV heads of 256, partial rotary 0.25 at theta 1e7, 512 experts top-10 of width
# 640 plus a gated shared expert of 640, vocab 248,320 (untied), 4 hyper-connection streams (rank
# 320), PLE on layer 1 (n-grams up to 3, 8 heads per order, tables above 20,000,000 rows: ~51B
# parameters), QSA indexer 4 heads x 128, budget 2048 tokens in blocks of 4, 1000 dense warm-up
# steps; max_seq_len covers 8192-token windows + K + decoding
_QWEN38_FLASH = dict(
    vocab_size=248320, hidden_size=2560, num_layers=48, num_heads=24, num_kv_heads=2, head_dim=256,
    partial_rotary_factor=0.25, rope_theta=10000000.0, intermediate_size=640,
    moe_intermediate_size=640,
    shared_expert_intermediate_size=640, shared_expert_gate=True, num_experts=512, top_k=10,
    num_shared_experts=1,
    first_k_dense=0, router_score="softmax", norm_topk_prob=True, balance="aux_loss",
    aux_loss_coef=1.0e-3,
    zero_centered_norm=True, full_attention_interval=4, linear_num_key_heads=16,
    linear_num_value_heads=32,
    linear_key_head_dim=128, linear_value_head_dim=128, indexer_heads=4, indexer_head_dim=128,
    indexer_budget=2048,
    indexer_compress_ratio=4, indexer_warmup_steps=1000, hc_count=4, hc_lowrank=320, ple_layers=[1],
    ngram_size=3,
    heads_per_ngram=8, ngram_vocab_base=20000000, eos_token_id=248044, max_seq_len=8256)

FLAVORS: Dict[str, Flavor] = {
    "debug": {"model": _DEBUG},
    "debug_mla": {"model": _DEBUG_MLA},
    "debug_qwen4": {"model": _DEBUG_QWEN4},
    "tiny": {"model": _TINY},
    "qwen4_exp_tiny": {"model": _QWEN4_EXP_TINY},
    "moe_4b": {"model": _MOE_4B},
    "qwen38_flash": {"model": _QWEN38_FLASH},
}
"""name -> {"model": {field: value}, "mtp": {field: value}}; see the module docstring."""

SECTIONS = ("model", "mtp")
"""The config sections a flavor may set."""


class UnknownFlavor(ValueError):
    """The named flavor does not exist; the message lists the ones that do."""


def names() -> List[str]:
    return sorted(FLAVORS)


def flavor(name: str) -> Flavor:
    """A deep copy of flavor `name` ({"model": {...}, "mtp": {...}}). Raises UnknownFlavor."""
    if name not in FLAVORS:
        raise UnknownFlavor(f"unknown model flavor {name!r}; known: {', '.join(names())}")
    return copy.deepcopy(FLAVORS[name])


def _value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, dict)):
        return json.dumps(value)
    return str(value)


def overrides(name: str) -> List[str]:
    """Flavor `name` as `key=value` overrides (`model.hidden_size=32`, ...), for `load_config` and
    the command line."""
    return [f"{section}.{key}={_value(value)}" for section, keys in flavor(name).items() for key,
            value in keys.items()]


def model_config(name: str, **changes: Any) -> ModelConfig:
    """ModelConfig of flavor `name` over the dataclass defaults, with `changes` on top."""
    return ModelConfig(**{**flavor(name).get("model", {}), **changes})


def mtp_config(name: str, **changes: Any) -> MTPConfig:
    """MTPConfig of flavor `name` over the dataclass defaults, with `changes` on top."""
    return MTPConfig(**{**flavor(name).get("mtp", {}), **changes})
