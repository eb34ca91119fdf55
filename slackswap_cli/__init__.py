"""slackswap: fit training into GPU memory by keeping, swapping or recomputing saved activations."""
from __future__ import annotations

from .workload_spec import Workload

__version__ = "0.1.0"
__all__ = ["Workload", "__version__"]
