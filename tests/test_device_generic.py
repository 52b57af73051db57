"""The pages' code is device-generic: no CPU device literal unless the line says why it is CPU-only.

Worker code is what readers copy into torchrun scripts, so it takes the rank's device from
``fsdp_guide.device()``. A line that is about the CPU on purpose (gloo's byte counts, a
CPU-mesh trap) carries ``# cpu-only: <reason>``.
"""

from __future__ import annotations

import ast
import io
import tokenize

import jupytext
import pytest
from conftest import NOTEBOOKS

MARK = "# cpu-only:"


def cpu_literals(source: str) -> list[tuple[int, str]]:
    """(line number, line) of every string literal naming the CPU as a device, without a cpu-only mark."""
    lines = source.splitlines()
    found = []
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type != tokenize.STRING:
            continue
        try:
            value = ast.literal_eval(tok.string)
        except (ValueError, SyntaxError):  # f-strings
            continue
        if isinstance(value, str) and value.split(":")[0].lower() == "cpu" and "cuda" not in value:
            line = lines[tok.start[0] - 1]
            reason = line.partition(MARK)[2].strip()
            if len(reason.split()) < 3:  # a mark must say why
                found.append((tok.start[0], line.strip()))
    return found


def test_the_guard_finds_cpu_devices_and_accepts_marked_ones():
    source = ('FSDP(m, device_id=torch.device("cpu"))\n'
              'model.to_empty(device="cpu")\n'
              "with torch.autocast('cpu', dtype=torch.bfloat16): pass\n"
              'mesh = init_device_mesh("cpu", (2,))  # cpu-only: counts loopback bytes\n'
              'x = "cpu"  # cpu-only:\n'
              'dist.init_process_group("cpu:gloo,cuda:nccl")\n'
              "print(f'{device}')  # a cpu comment\n")
    assert [n for n, _ in cpu_literals(source)] == [1, 2, 3, 5]


@pytest.mark.parametrize("page", NOTEBOOKS, ids=lambda p: p.stem)
def test_no_unmarked_cpu_device_in_the_code_of(page):
    notebook = jupytext.read(page)
    found = [f"cell {i}, line {n}: {line}" for i, cell in enumerate(notebook.cells) if cell.cell_type == "code"
             for n, line in cpu_literals(cell.source)]
    assert not found, (f"{page.name} names the CPU as a device; use device = fsdp_guide.device() "
                       f"(or device.type), or mark the line '{MARK} <why>':\n" + "\n".join(found))
