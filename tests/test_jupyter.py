"""The pages as Jupyter opens and saves them: jupytext's contents manager, with the repository's jupytext.toml."""

from __future__ import annotations

import asyncio
import json
import runpy
import shutil
import subprocess
import time

import pytest
from conftest import NOTEBOOKS, ROOT
from test_browser import browser  # noqa: F401  (the fixture: headless Chromium)


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


# --- JupyterLab itself, as `nox -s lab` starts it, driven in Chromium ---------------------


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    """JupyterLab with `nox -s lab`'s options, on a copy of the repository's pages; yields (url, token, root)."""
    import os
    import secrets
    import sys
    import urllib.request

    LAB = runpy.run_path(str(ROOT / "noxfile.py"))["LAB"]  # the options `nox -s lab` passes

    root = tmp_path_factory.mktemp("repository")
    shutil.copy(ROOT / "jupytext.toml", root)
    shutil.copytree(ROOT / "tutorials", root / "tutorials", ignore=shutil.ignore_patterns("*.ipynb", "__pycache__"))
    port, token, home = _free_port(), secrets.token_hex(16), tmp_path_factory.mktemp("home")
    options = [o.replace("--LabApp.app_settings_dir=jupyter", f"--LabApp.app_settings_dir={ROOT / 'jupyter'}")
               for o in LAB]
    env = dict(os.environ, HOME=str(home), JUPYTER_RUNTIME_DIR=str(home / "runtime"),
               JUPYTERLAB_WORKSPACES_DIR=str(home / "workspaces"))
    server = subprocess.Popen(
        [sys.executable, "-m", "jupyterlab", *options, "--no-browser", f"--port={port}", "--port-retries=0",
         f"--IdentityProvider.token={token}", *(["--allow-root"] if os.geteuid() == 0 else [])],
        cwd=root, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        try:
            urllib.request.urlopen(f"{url}/api/status?token={token}", timeout=5)
            break
        except OSError:
            if server.poll() is not None or time.monotonic() > deadline:
                server.kill()
                raise AssertionError(f"JupyterLab did not start:\n{server.stderr.read().decode()[-3000:]}")
            time.sleep(0.5)
    yield url, token, root
    server.terminate()
    server.wait(timeout=30)


def test_jupyterlab_opens_a_tutorial_as_a_notebook_runs_it_and_saves_without_changing_it(lab, browser):
    url, token, root = lab
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    page.goto(f"{url}/lab?token={token}")
    listing = page.locator(".jp-DirListing-item", has_text="quickstart.py")
    listing.wait_for(timeout=60_000)  # the file browser starts in tutorials/
    listing.dblclick()
    notebook = page.locator(".jp-NotebookPanel")
    notebook.wait_for(timeout=60_000)  # a notebook, not the text editor
    page.locator(".jp-Notebook-ExecutionIndicator[data-status='idle']").wait_for(timeout=120_000)  # kernel ready
    page.get_by_role("menuitem", name="Run").click()
    page.get_by_text("Run All Cells", exact=True).click()
    # every code cell has run: each prompt shows its execution count ("[3]:"), none "[ ]:" or "[*]:"
    page.wait_for_function("""() => {
        const prompts = [...document.querySelectorAll('.jp-CodeCell .jp-InputPrompt')];
        return prompts.length > 0 && prompts.every(p => /\\[\\d+\\]/.test(p.textContent));
    }""", timeout=180_000)
    outputs = notebook.locator(".jp-OutputArea-output").all_inner_texts()
    assert any("torch 2." in text for text in outputs)
    assert not any("Traceback" in text or "Error" in text.split("\n", 1)[0] for text in outputs)
    page.keyboard.press("Control+s")
    paired = root / "tutorials" / "quickstart.ipynb"
    deadline = time.monotonic() + 30
    while not paired.exists() and time.monotonic() < deadline:
        page.wait_for_timeout(200)
    assert (root / "tutorials" / "quickstart.py").read_text() == (ROOT / "tutorials" / "quickstart.py").read_text()
    saved = json.loads(paired.read_text())
    assert any(cell.get("outputs") for cell in saved["cells"])  # the outputs, kept in the ignored .ipynb
    page.close()
