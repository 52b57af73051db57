"""The pages as Jupyter opens and saves them: jupytext's contents manager, with the repository's jupytext.toml."""

from __future__ import annotations

import asyncio
import shutil
import subprocess

import pytest
from conftest import NOTEBOOKS, ROOT


def _contents_manager(root_dir):
    # What JupyterLab's server uses once jupytext is installed: its contents manager over jupyter_server's.
    from jupyter_server.services.contents.largefilemanager import AsyncLargeFileManager
    from jupytext.async_contentsmanager import build_async_jupytext_contents_manager_class

    return build_async_jupytext_contents_manager_class(AsyncLargeFileManager)(root_dir=str(root_dir))


async def _run_all_and_save(manager, name: str) -> dict:
    """Open a page as a notebook, give every code cell an output as a run would, save it."""
    from jupyter_client.kernelspec import KernelSpecManager

    model = await manager.get(name, content=True, type="notebook")
    notebook = model["content"]
    spec = KernelSpecManager().get_kernel_spec("python3")
    notebook["metadata"]["kernelspec"] = {"display_name": spec.display_name, "language": "python", "name": "python3"}
    for count, cell in enumerate(c for c in notebook["cells"] if c["cell_type"] == "code"):
        cell["execution_count"] = count + 1
        cell["outputs"] = [{"output_type": "stream", "name": "stdout", "text": f"output {count}\n"}]
    await manager.save({"type": "notebook", "content": notebook}, name)
    return await manager.get(name, content=True, type="notebook")  # what a reload shows


@pytest.mark.parametrize("page", NOTEBOOKS, ids=lambda p: p.stem)
def test_running_and_saving_a_page_in_jupyter_keeps_the_py_and_the_outputs_in_an_ignored_ipynb(page, tmp_path):
    folder = tmp_path / page.parent.name
    folder.mkdir()
    shutil.copy(ROOT / "jupytext.toml", tmp_path)  # found by walking up from the page, as in the repository
    shutil.copy(page, folder)
    # JupyterLab's root is the repository (`nox -s lab`): jupytext finds its configuration
    # in the page's folder or above it, within that root
    reloaded = asyncio.run(_run_all_and_save(_contents_manager(tmp_path), f"{folder.name}/{page.name}"))
    assert (folder / page.name).read_text() == page.read_text()  # the tracked file, unchanged
    paired = folder / f"{page.stem}.ipynb"
    assert paired.exists()
    outputs = [c["outputs"][0]["text"] for c in reloaded["content"]["cells"] if c["cell_type"] == "code"]
    assert outputs == [f"output {i}\n" for i in range(len(outputs))] and outputs  # they survive a reload
    in_repository = page.with_suffix(".ipynb").relative_to(ROOT)
    ignored = subprocess.run(["git", "check-ignore", "-q", str(in_repository)], cwd=ROOT).returncode == 0
    assert ignored, f"git would track {in_repository}"
