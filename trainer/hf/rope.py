"""RoPE in config.json: where transformers reads its fields (a legacy `rope_scaling` or
`rope_parameters`), default RoPE, YaRN or Llama 3.1's `llama3` onto ModelConfig, and back for an
export."""

from __future__ import annotations

import math
from typing import Tuple

from tandem.models.config import ModelConfig
from tandem.models.layers import Yarn

from .names import UnsupportedCheckpoint


def rope_fields(hf: dict) -> dict:
    """The RoPE dict transformers reads: a legacy `rope_scaling` wins over `rope_parameters`, which
    it then ignores entirely (the missing keys come from the top level)."""
    return hf.get("rope_scaling") or hf.get("rope_parameters") or {}


def theta_and_partial(hf: dict) -> Tuple[float, float]:
    rp = rope_fields(hf)
    rope_type = rp.get("rope_type", rp.get("type", "default")) or "default"
    if rope_type not in ("default", "yarn", "llama3"):
        raise UnsupportedCheckpoint(f"rope_type={rope_type!r} is not supported (default RoPE, yarn "
                                    "or llama3)")
    theta = rp.get("rope_theta", hf.get("rope_theta", 10000.0))
    partial = rp.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    return float(theta), float(partial)


def read_scaling(hf: dict, cfg: ModelConfig) -> None:
    """The RoPE scaling's parameters as transformers reads them (`_compute_yarn_parameters`,
    `_compute_llama3_parameters`), onto `cfg`."""
    rp = rope_fields(hf)
    rope_type = rp.get("rope_type", rp.get("type")) or "default"
    if rope_type == "llama3":
        cfg.rope_scaling, cfg.rope_factor = "llama3", float(rp["factor"])
        cfg.rope_original_max_len = int(rp["original_max_position_embeddings"])
        cfg.rope_low_freq_factor = float(rp["low_freq_factor"])
        cfg.rope_high_freq_factor = float(rp["high_freq_factor"])
        return
    if rope_type != "yarn":
        return
    if rp.get("attention_factor") is not None or rp.get("truncate") is False:
        raise UnsupportedCheckpoint("yarn with an explicit attention_factor or truncate=false is "
                                    "not supported")
    mpe = int(hf.get("max_position_embeddings", 4096))
    original = int(rp.get("original_max_position_embeddings") or mpe)
    cfg.rope_scaling, cfg.rope_original_max_len = "yarn", original
    cfg.rope_factor = float(rp.get("factor") or mpe / original)
    cfg.rope_beta_fast = float(rp.get("beta_fast") or 32)
    cfg.rope_beta_slow = float(rp.get("beta_slow") or 1)
    cfg.rope_mscale = float(rp.get("mscale") or 0)
    cfg.rope_mscale_all_dim = float(rp.get("mscale_all_dim") or 0)


def rope_parameters(cfg: ModelConfig) -> dict:
    """config.json's rope_parameters for `cfg`."""
    out = {"rope_theta": cfg.rope_theta, "rope_type": cfg.rope_scaling
           if cfg.rope_scaling in ("yarn", "llama3") else "default"}
    if cfg.rope_scaling in ("yarn", "llama3"):
        out.update(factor=cfg.rope_factor,
                   original_max_position_embeddings=cfg.rope_original_max_len)
    if cfg.rope_scaling == "llama3":
        out.update(low_freq_factor=cfg.rope_low_freq_factor,
                   high_freq_factor=cfg.rope_high_freq_factor)
    if cfg.rope_scaling == "yarn":
        out.update(beta_fast=cfg.rope_beta_fast, beta_slow=cfg.rope_beta_slow,
                   **served_mscales(cfg))
    return out


def served_mscales(cfg: ModelConfig) -> dict:
    """YaRN's mscale pair written so every reader computes this model's scales. transformers (and
    Tandem) scale cos/sin by m(f, mscale) / m(f, mscale_all_dim) only when both are set, else by
    m(f) = m(f, 1); vLLM's and SGLang's DeepSeek rotary and DeepSeek's own code always take the
    ratio, with m(f, 0) = 1, so a pair with a 0 in it was served at another scale (logits off by
    up to 4 on a tiny model). The softmax factor, m(f, mscale_all_dim)^2 when set, reads alike in
    all of them; so mscale_all_dim stays, and mscale becomes the one whose ratio is m(f)."""
    a, b, f = cfg.rope_mscale, cfg.rope_mscale_all_dim, cfg.rope_factor
    if (a and b) or f <= 1:
        return {"mscale": a, "mscale_all_dim": b}
    if not b:  # m(f, 1) / m(f, 0) = m(f)
        return {"mscale": 1.0, "mscale_all_dim": 0.0}
    # m(f, a') = m(f) m(f, b), with m(f, x) = 0.1 x ln f + 1 (Yarn.magnitude)
    target = Yarn.magnitude(f) * Yarn.magnitude(f, b)
    return {"mscale": (target - 1) / (0.1 * math.log(f)), "mscale_all_dim": b}


def legacy_rope_fields(parameters: dict) -> dict:
    """The same RoPE in the keys transformers 4.x and the DeepSeek / Kimi remote code read: the top
    level's `rope_theta` (and `partial_rotary_factor`), and YaRN or llama3 as `rope_scaling`
    (which transformers 5 then reads in place of `rope_parameters`, to the same values). Without
    them a 4.x load of a YaRN export ran plain RoPE at the default softmax scale."""
    out = {key: parameters[key] for key in ("rope_theta", "partial_rotary_factor")
           if key in parameters}
    if parameters.get("rope_type") in ("yarn", "llama3"):
        out["rope_scaling"] = dict(parameters, type=parameters["rope_type"])
    return out
