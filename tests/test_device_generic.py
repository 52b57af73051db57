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
    """(line number, line) of every string literal naming the CPU as a device, without a cpu-only mark.

    The mark may be on any line of the statement: the formatter puts a long call's arguments on
    lines of their own, and its comment stays where the statement ends."""
    lines = source.splitlines()
    found, literals, reasons = [], [], []
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT and tok.string.startswith(MARK):
            reasons.append(tok.string.partition(MARK)[2].strip())
        elif tok.type == tokenize.STRING:
            try:
                value = ast.literal_eval(tok.string)
            except (ValueError, SyntaxError):  # f-strings
                continue
            if isinstance(value, str) and value.split(":")[0].lower() == "cpu" and "cuda" not in value:
                literals.append(tok.start[0])
        elif tok.type in (tokenize.NEWLINE, tokenize.ENDMARKER):  # the statement ends
            if not any(len(reason.split()) >= 3 for reason in reasons):  # a mark must say why
                found += [(n, lines[n - 1].strip()) for n in literals]
            literals, reasons = [], []
    return found


def test_the_guard_finds_cpu_devices_and_accepts_marked_ones():
    source = (
        'FSDP(m, device_id=torch.device("cpu"))\n'
        'model.to_empty(device="cpu")\n'
        "with torch.autocast('cpu', dtype=torch.bfloat16): pass\n"
        'mesh = init_device_mesh("cpu", (2,))  # cpu-only: counts loopback bytes\n'
        'x = "cpu"  # cpu-only:\n'
        'dist.init_process_group("cpu:gloo,cuda:nccl")\n'
        "print(f'{device}')  # a cpu comment\n"
        "model = FSDP(\n"
        '    m, device_id=torch.device("cpu")\n'
        ")  # cpu-only: FSDP1's CPU path on purpose\n"
        'one = torch.device("cpu")\n'
        "two = 2  # cpu-only: a mark on another statement\n"
    )
    assert [n for n, _ in cpu_literals(source)] == [1, 2, 3, 5, 11]


@pytest.mark.parametrize("page", NOTEBOOKS, ids=lambda p: p.stem)
def test_no_unmarked_cpu_device_in_the_code_of(page):
    notebook = jupytext.read(page)
    found = [
        f"cell {i}, line {n}: {line}"
        for i, cell in enumerate(notebook.cells)
        if cell.cell_type == "code"
        for n, line in cpu_literals(cell.source)
    ]
    assert not found, (
        f"{page.name} names the CPU as a device; use device = fsdp_guide.device() "
        f"(or device.type), or mark the line '{MARK} <why>':\n" + "\n".join(found)
    )
