"""The offline expert policy: rule-based CUDA kernels written from a task's PyTorch reference.

graph.capture (torch.export on the meta device) -> render.prepare (regions.lower: canonical ops, fusible
regions; the op families of families/ claim them) -> edits.base_plan / edits.legal_edits (a Plan per
candidate, each region's knobs and edits its family's) -> render.render (the families' templates/) ->
Candidate.
"""

from pipeline.generate.expert.graph import CaptureError, Graph, capture
from pipeline.generate.expert.plan import Plan, RegionPlan, plan_of
from pipeline.generate.expert.policy import ExpertPolicy, supports
from pipeline.generate.expert.regions import Region, RegionKind, lower

__all__ = [
    "CaptureError",
    "ExpertPolicy",
    "Graph",
    "Plan",
    "Region",
    "RegionKind",
    "RegionPlan",
    "capture",
    "lower",
    "plan_of",
    "supports",
]
