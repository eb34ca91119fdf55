"""Terminal views of profiles, plans, simulated steps and reports, as Rich renderables.

Every function here takes data and returns renderables (tables, text); none prints or exits,
so the commands decide where output goes and tests render into a recording console. This
package and `output.py` are the only modules that import Rich; the commands import it only
when a person is shown a view (not for --json or --quiet).

- format.py: what the views share (tables that never wrap, the widest rendering that fits,
  the bar chart)
- layer_rows.py: per-layer rows, repeated blocks collapsed into one
- profile.py: a profile's views; plan.py: a plan's views and the memory chart
- tables.py: `compare` and `hardware`; verify.py: `apply`'s note, `verify` and
  `verify --compile`; fit.py: `fit`'s sweep
"""
from __future__ import annotations

from ...units import fmt_bytes, fmt_us
from .format import fmt_pct
from .plan import MemoryChart, memory_chart, plan_views
from .profile import profile_views
from .tables import compare_table, compare_views, hardware_table
from .verify import (
                     patch_usage,
                     two_curve_chart,
                     verify_compiled_view,
                     verify_memory_view,
                     verify_view,
)

__all__ = ["MemoryChart", "compare_table", "compare_views", "fmt_bytes", "fmt_pct", "fmt_us",
           "hardware_table", "memory_chart", "patch_usage", "plan_views", "profile_views",
           "two_curve_chart", "verify_compiled_view", "verify_memory_view", "verify_view"]
