"""fsdp_guide: the reference package of the FSDP Guide.

``import fsdp_guide`` does not import torch: a notebook that only launches
ranks keeps its kernel light, and each rank imports torch itself.
"""

from fsdp_guide.launcher import LaunchError, launch

__all__ = ["launch", "LaunchError"]
__version__ = "0.1.0"
