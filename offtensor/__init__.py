"""offtensor: run a PyTorch model whose weights do not fit the GPU.

Weights that do not fit a budget live in exact-size (pinned) host memory inside an
``OffloadedTensor``; its ``__torch_dispatch__`` pages exactly the bytes an op needs onto the
device. ``wrap_model(model, budget_gb=...)`` does that for a whole model, in place.
"""

from . import _ext  # noqa: F401  (loads the native extension, or warns once)
from . import ops  # noqa: F401  (gives OffloadedTensor its op handlers)
from .config import OffloadConfig
from .pager import BudgetError, OffloadStats
from .loading import CheckpointError, from_pretrained, load_safetensors
from .tensor import OffloadedTensor, add_safe_globals, offload, safe_globals
from .sim.plan import plan
from .sim.profiles import PROFILES, Profile, get_profile, measure_profile
from .sim.recording import timeline
from .moe import RoutingStats
from .sim.timeline import Replay, Timeline
from .model.host import on_host
from .wrap import reset_stats, stats, unwrap_model, wrap_model

__all__ = [
    "OffloadedTensor",
    "offload",
    "safe_globals",
    "add_safe_globals",
    "wrap_model",
    "unwrap_model",
    "on_host",
    "stats",
    "reset_stats",
    "load_safetensors",
    "from_pretrained",
    "CheckpointError",
    "OffloadConfig",
    "OffloadStats",
    "BudgetError",
    "timeline",
    "plan",
    "Timeline",
    "Replay",
    "Profile",
    "PROFILES",
    "get_profile",
    "measure_profile",
    "RoutingStats",
]
