"""What DeepSpeed's first use costs on a CPU machine: the C++ extensions it compiles, which the DeepSpeed page avoids.

    python bench/deepspeed_builds.py [--record]      (needs the `deepspeed` extra: pip install -e '.[deepspeed]')

On a machine where DeepSpeed finds no GPU, ``deepspeed.init_distributed`` (and so ``deepspeed.initialize``)
compiles its shared-memory communication op (``ShareMemCommBuilder``, ``build_shm_op`` in
``deepspeed/comm/torch.py``) with ninja and g++, and DeepSpeed's own Adam (an ``"optimizer"`` in the
config, no torch optimizer passed in) compiles ``FusedAdamBuilder``. Each is compiled once per machine
and cached in ``TORCH_EXTENSIONS_DIR`` (``~/.cache/torch_extensions`` by default).

For each op, in a fresh interpreter: ``builder.load()`` timed in an empty extensions folder (the first
use), then again with the folder it filled (every later process). The folders are temporary: the
reader's cache is neither read nor written. One run each, 2 cores; the printout is kept in
bench/results/deepspeed_builds.txt with ``--record``.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from results import recorded  # noqa: E402

LOAD = (
    "import time; from deepspeed.accelerator import get_accelerator; "
    "builder = get_accelerator().create_op_builder({name!r}); "
    "t = time.perf_counter(); builder.load(verbose=False); print(time.perf_counter() - t)"
)
OPS = ["ShareMemCommBuilder", "FusedAdamBuilder"]


def load_seconds(name: str, extensions: str) -> float:
    """Seconds of one ``builder.load()`` of op ``name`` with ``extensions`` as the extensions folder."""
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": extensions, "DS_ACCELERATOR": "cpu"}
    done = subprocess.run([sys.executable, "-c", LOAD.format(name=name)], capture_output=True, text=True, env=env)
    if done.returncode:
        raise SystemExit(f"{name} did not build:\n{done.stderr[-3000:]}")
    return float(done.stdout.strip().splitlines()[-1])


def measure() -> None:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")  # named: no warning that it fell back to the CPU
    import deepspeed

    print(f"DeepSpeed {deepspeed.__version__}, accelerator: cpu")
    print(f"{'op':22} {'first use (compiled)':>21} {'later (cached)':>15}")
    for name in OPS:
        with tempfile.TemporaryDirectory(prefix="torch_extensions-") as extensions:
            first, later = load_seconds(name, extensions), load_seconds(name, extensions)
        print(f"{name:22} {first:20.1f}s {later:14.2f}s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--record", action="store_true")
    if parser.parse_args().record:
        with recorded("deepspeed_builds", "python bench/deepspeed_builds.py --record"):
            measure()
    else:
        measure()


if __name__ == "__main__":
    main()
