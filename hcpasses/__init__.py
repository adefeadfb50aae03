"""hcpasses: a torch.compile backend whose graph passes rewrite hyper-connection (HC) blocks.

import hcpasses, torch
be = hcpasses.backend(sp_rewrite=True, gated_mean_quant=True, dump_dir="dumps")
out = torch.compile(model, backend=be)(x)
print(be.reports[-1])
"""

from hcpasses.backend import HCPassesBackend, backend, compile_with_defaults, default_backend
from hcpasses.config import HCPassesConfig
from hcpasses.graph_pass import GraphPass, PassResult
from hcpasses.passes import PASSES, PassSpec
from hcpasses.report import GraphReport, PassRecord

__all__ = [
    "PASSES",
    "GraphPass",
    "GraphReport",
    "HCPassesBackend",
    "HCPassesConfig",
    "PassRecord",
    "PassResult",
    "PassSpec",
    "backend",
    "compile_with_defaults",
    "default_backend",
]
