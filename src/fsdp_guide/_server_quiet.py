"""Imported first by the warm server, and only there: its imports log nothing.

Libraries log at import time (torchao: CUDA kernels a CPU cannot load; torch's pytree:
deprecations). In the server those records belong to no launch, and would appear in
whatever output the launching process has (a notebook cell). A rank forked from the server
sets these loggers back to their defaults (``_warm._fresh_state``), as a cold rank has them.
"""

import logging

# bitsandbytes' CPU backend, on a CPU with AVX512-BF16: that the optional `kernels` package,
# which would fetch a kernel from the Hugging Face Hub, is not installed (nothing is downloaded)
NOISY = ("torchao", "torch.utils._pytree", "bitsandbytes.backends.cpu.ops")

for name in NOISY:
    logging.getLogger(name).setLevel(logging.ERROR)
