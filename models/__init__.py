"""Plain single-device PyTorch modules: no process groups, no torch.distributed calls."""

from .attention import KVCache
from .config import ModelConfig
from .model import ModelOutput, TandemModel
from .mtp import depth_target_mask
from .mtp_config import MTPConfig, MTPLossConfig, validate_model

__all__ = ["KVCache", "MTPConfig", "MTPLossConfig", "ModelConfig", "ModelOutput", "TandemModel",
           "depth_target_mask", "validate_model"]
