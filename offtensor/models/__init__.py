"""Reference models written as plain PyTorch, with no knowledge of offloading (see deepseek.py)."""

from .deepseek import CONFIGS, DeepSeekConfig, DeepSeekForCausalLM, LatentCache, weight_bytes

__all__ = ["CONFIGS", "DeepSeekConfig", "DeepSeekForCausalLM", "LatentCache", "weight_bytes"]
