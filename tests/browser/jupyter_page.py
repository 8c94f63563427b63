"""Drive the course in a real browser, as a learner does: JupyterLab, Chromium, Playwright.

    with JupyterLab(notebooks_dir, results_dir) as lab, Chromium(results_dir) as browser:
        nb = NotebookPage(browser.new_page(), lab, "01_attention_and_head_grouping.ipynb")
        nb.run_all()
        explorer = nb.explorer("Head grouping")     # the explorer's box, found by its title
        nb.type_into(explorer, "num_kv_heads", "8")
        nb.wait_for_text(explorer, "must be divisible")
        nb.screenshot(explorer, "01-head-grouping-error")

JupyterLab runs from this interpreter's environment (so its kernel is this environment's
Python), on 127.0.0.1 with a random token, in a temporary home of its own: the learner's
settings, kernels and workspaces on this machine play no part. It is stopped by its PID.

With ipywidgets 7 (Colab's), the front end is the classic notebook (nbclassic) instead:
JupyterLab 4's widget manager renders only ipywidgets 8 models ("Module
@jupyter-widgets/controls, version ^1.5.0 is not registered"), and JupyterLab 3, the last
with an ipywidgets 7 manager, does not install on Python 3.13.

Chromium is Debian's `chromium` (Playwright's own browser download needs the internet). As
root in a container without a network it needs the flags in `CHROMIUM_FLAGS`.
"""

from __future__ import annotations

import dataclasses
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# The course's JupyterLab settings (no news pop-up), as `tasks.py course` uses them.
COURSE_JUPYTER_CONFIG = ROOT / "jupyter_config"

CHROMIUM_FLAGS = [
    "--no-sandbox",  # Chromium's sandbox cannot start as root
    "--disable-gpu",
    "--disable-background-networking",  # no network here: no update checks, no field trials
    "--disable-component-update",
    "--no-first-run",
]
# How long the page may take to react to typing, and a notebook to run top to bottom.
REACT_SECONDS = 60
RUN_ALL_SECONDS = 600
NEWS_PROMPT = "Would you like to get notified about official Jupyter news?"
# What a widget that did not render shows instead of itself: a placeholder, the front end's
# error, or its Python repr.
UNRENDERED = ("Loading widget", "Error displaying widget", "Failed to load")
MODEL_REPR = re.compile(r"\b[A-Z]\w*\(children=\(")


@dataclasses.dataclass(frozen=True)
class FrontEnd:
    """Where a notebook front end keeps what the test reads and clicks."""

    name: str  # the `jupyter <name>` command
    notebook_path: str  # URL path of a notebook, before its name
    idle_kernel: str  # JavaScript: true when the kernel is connected and idle
    run_all: tuple[str, ...]  # what to click, in order: the menu, then "Run All"
    prompts: str  # the input prompts of the notebook's code cells ("[3]:", "[*]:")
    outputs: str  # every output area
    error_outputs: str  # outputs that are tracebacks
    whole_outputs_css: str = ""  # for screenshots: long outputs shown whole, not scrolled


LAB = FrontEnd(
    name="lab",
    notebook_path="/lab/tree/",
    idle_kernel="[...document.querySelectorAll('.jp-StatusBar-Widget')]"
    ".some(w => /\\| Idle/.test(w.textContent))",
    run_all=('role=menuitem[name="Run"s]', 'role=menuitem[name="Run All Cells"s]'),
    prompts=".jp-NotebookPanel:not(.lm-mod-hidden) .jp-CodeCell .jp-InputPrompt",
    outputs=".jp-OutputArea-output",
    error_outputs=".jp-OutputArea-output[data-mime-type*='error']",
)
CLASSIC = FrontEnd(
    name="nbclassic",
    notebook_path="/nbclassic/notebooks/",  # beside Notebook 7: see front_end_for_this_environment
    idle_kernel="!!document.querySelector('#kernel_indicator_icon.kernel_idle_icon')",
    run_all=("#celllink", "#run_all_cells"),
    prompts=".code_cell .input_prompt",
    outputs=".output_area",
    error_outputs=".output_error",
    whole_outputs_css=".output_scroll { height: auto !important; max-height: none !important;"
    " overflow: visible !important; box-shadow: none !important; }",
)


def front_end_for_this_environment() -> FrontEnd:
    import ipywidgets

    if not ipywidgets.__version__.startswith("7."):
        return LAB
    # nbclassic serves its pages under /nbclassic beside Notebook 7, and at the root beside
    # Notebook 6 (as in Colab's packages).
    from nbclassic import nbclassic_path

    return dataclasses.replace(CLASSIC, notebook_path=f"{nbclassic_path()}/notebooks/")


def chromium_path() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class JupyterLab:
    """A Jupyter server with `front_end` on `notebooks_dir`, from this environment, stopped
    on exit."""

    def __init__(self, notebooks_dir: Path, log_dir: Path, front_end: FrontEnd = LAB):
        self.notebooks_dir = notebooks_dir
        self.front_end = front_end
        self.log_path = log_dir / f"jupyter-{front_end.name}.log"
        self.port = free_port()
        self.token = secrets.token_hex(16)
        self.url = f"http://127.0.0.1:{self.port}"
        self.version = ""

    def __enter__(self) -> JupyterLab:
        home = Path(tempfile.mkdtemp(prefix="jupyter-home-"))
        env = dict(os.environ)
        env.pop("MPLBACKEND", None)  # figures render as a learner sees them
        env |= {
            "JUPYTER_CONFIG_DIR": str(home / "config"),
            "JUPYTER_DATA_DIR": str(home / "data"),
            "JUPYTER_RUNTIME_DIR": str(home / "runtime"),
            "JUPYTERLAB_SETTINGS_DIR": str(home / "lab-settings"),
            "JUPYTERLAB_WORKSPACES_DIR": str(home / "lab-workspaces"),
            "JUPYTER_CONFIG_PATH": str(COURSE_JUPYTER_CONFIG),
            "JAX_PLATFORMS": env.get("JAX_PLATFORMS", "cpu"),
        }
        self.version = subprocess.run(
            [sys.executable, "-m", "jupyter", self.front_end.name, "--version"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        command = [
            sys.executable,
            "-m",
            "jupyter",
            self.front_end.name,
            "--no-browser",
            "--ServerApp.ip=127.0.0.1",
            f"--ServerApp.port={self.port}",
            "--ServerApp.port_retries=0",
            f"--IdentityProvider.token={self.token}",
            f"--ServerApp.root_dir={self.notebooks_dir}",
        ]
        if hasattr(os, "geteuid") and os.geteuid() == 0:
            command.append("--allow-root")
        self.log = open(self.log_path, "w")  # noqa: SIM115 (closed in __exit__)
        self.process = subprocess.Popen(
            command, cwd=self.notebooks_dir, env=env, stdout=self.log, stderr=subprocess.STDOUT
        )
        self._wait_until_up()
        return self

    def _wait_until_up(self, seconds: float = 120) -> None:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"JupyterLab exited: see {self.log_path}")
            try:
                with urllib.request.urlopen(f"{self.url}/api/status?token={self.token}", timeout=2):
                    return
            except OSError:
                time.sleep(0.5)
        raise RuntimeError(f"JupyterLab did not answer in {seconds} s: see {self.log_path}")

    def notebook_url(self, name: str) -> str:
        # `reset`: a fresh JupyterLab workspace, with only this notebook open.
        return f"{self.url}{self.front_end.notebook_path}{name}?reset&token={self.token}"

    def __exit__(self, *exc) -> None:
        os.kill(self.process.pid, signal.SIGTERM)  # stops the server and its kernels
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.kill(self.process.pid, signal.SIGKILL)
            self.process.wait()
        self.log.close()


class Chromium:
    """Debian's Chromium, headless, with a fresh profile, driven by Playwright."""

    def __init__(self, log_dir: Path):
        self.log_dir = log_dir
        self.version = ""

    def __enter__(self) -> Chromium:
        from playwright.sync_api import sync_playwright

        self._profile = tempfile.mkdtemp(prefix="chromium-profile-")
        self._playwright = sync_playwright().start()
        self.context = self._playwright.chromium.launch_persistent_context(
            self._profile,
            executable_path=chromium_path(),
            headless=True,
            args=CHROMIUM_FLAGS,
            viewport={"width": 1280, "height": 2400},  # tall: a whole explorer in view
        )
        self.version = self.context.browser.version if self.context.browser else ""
        return self

    def new_page(self):
        return self.context.new_page()

    def __exit__(self, *exc) -> None:
        self.context.close()
        self._playwright.stop()
        shutil.rmtree(self._profile, ignore_errors=True)


class NotebookPage:
    """One notebook open in JupyterLab: run it, find its explorers, type into them, look.

    Every page error (an uncaught JavaScript exception) and console error is recorded in
    `page_errors` and `console_errors`.
    """

    def __init__(self, page, lab: JupyterLab, name: str, results_dir: Path):
        self.page, self.name, self.results_dir = page, name, results_dir
        self.front_end = lab.front_end
        self.page_errors: list[str] = []
        self.reaction_seconds: list[float] = []  # how long each awaited change took
        self.console_errors: list[str] = []
        page.on("pageerror", lambda err: self.page_errors.append(str(err)))
        page.on(
            "console",
            lambda msg: self.console_errors.append(msg.text) if msg.type == "error" else None,
        )
        page.goto(lab.notebook_url(name))
        self.wait_for_idle_kernel()

    # --- running ------------------------------------------------------------------------

    def wait_for_idle_kernel(self, seconds: float = 120) -> None:
        """Wait until the status bar says the kernel is connected and idle."""
        self.page.wait_for_function(f"() => {self.front_end.idle_kernel}", timeout=seconds * 1000)

    def run_all(self) -> float:
        """Run → Run All Cells, as a learner does; wait until every code cell has run.
        Returns the seconds it took."""
        start = time.monotonic()
        for target in self.front_end.run_all:
            self.page.locator(target).click()
        self.page.wait_for_function(
            """selector => {
                const prompts = [...document.querySelectorAll(selector)];
                return prompts.length > 0 && prompts.every(
                    p => /\\[\\d+\\]/.test(p.textContent));
            }""",
            arg=self.front_end.prompts,
            timeout=RUN_ALL_SECONDS * 1000,
        )
        self.wait_for_idle_kernel()
        return time.monotonic() - start

    def cell_errors(self) -> list[str]:
        """The text of every error output (a traceback) on the page."""
        return self.page.locator(self.front_end.error_outputs).all_inner_texts()

    # --- reading --------------------------------------------------------------------------

    def explorer(self, title: str):
        """The box of the explorer whose title starts with `title`, scrolled into view."""
        from playwright.sync_api import TimeoutError as PlaywrightTimeout

        box = self.page.locator(".widget-vbox", has=self.page.get_by_text(title)).last
        try:
            box.wait_for(timeout=REACT_SECONDS * 1000)
        except PlaywrightTimeout:
            raise AssertionError(
                f"{self.name}: the explorer {title!r} did not render. Widget errors in the "
                f"console: {self.widget_console_errors()}; outputs: {self.unrendered_widgets()}"
            ) from None
        box.scroll_into_view_if_needed()
        return box

    def widget_console_errors(self) -> list[str]:
        """Console errors of the widget manager (a model or view it could not load)."""
        return [e.splitlines()[0] for e in self.console_errors if "widget" in e.lower()]

    def news_prompt_shown(self) -> bool:
        """JupyterLab's pop-up asking about its news feed (the course turns it off)."""
        return self.page.get_by_text(NEWS_PROMPT).count() > 0

    def unrendered_widgets(self) -> list[str]:
        """Outputs showing "Loading widget..." or a widget's Python repr instead of the
        widget."""
        outputs = self.page.locator(self.front_end.outputs).all_inner_texts()
        return [t[:200] for t in outputs if any(u in t for u in UNRENDERED) or MODEL_REPR.search(t)]

    def wait_for_text(self, box, text: str, present: bool = True) -> float:
        """Wait until `text` shows in `box` (or, with present=False, no longer shows).
        Returns the seconds it took."""
        start = time.monotonic()
        deadline = start + REACT_SECONDS
        while (text in box.inner_text()) != present:
            if time.monotonic() > deadline:
                state = "show" if present else "go away"
                raise AssertionError(
                    f"{self.name}: {text!r} did not {state} in {REACT_SECONDS} s. "
                    f"The explorer shows:\n{box.inner_text()[:1500]}"
                )
            time.sleep(0.1)
        self.reaction_seconds.append(time.monotonic() - start)
        return self.reaction_seconds[-1]

    def figure_bytes(self, box) -> str:
        """A digest of the PNG bytes the explorer's figure shows; "" if it shows none."""
        image = box.locator("img")
        if image.count() == 0 or not image.first.is_visible():
            return ""
        return image.first.evaluate(
            """async img => {
                const bytes = new Uint8Array(await (await fetch(img.src)).arrayBuffer());
                let hash = 2166136261;  // FNV-1a
                for (const b of bytes) hash = Math.imul(hash ^ b, 16777619) >>> 0;
                return `${bytes.length}:${hash}`;
            }"""
        )

    def wait_for_figure(self, box, other_than: str = "") -> str:
        """Wait until the explorer shows a figure (other than `other_than`); return it."""
        start = time.monotonic()
        while self.figure_bytes(box) in ("", other_than):
            if time.monotonic() - start > REACT_SECONDS:
                state = "a new figure" if other_than else "a figure"
                raise AssertionError(f"{self.name}: the explorer shows no {state}")
            time.sleep(0.1)
        return self.figure_bytes(box)

    # --- acting ---------------------------------------------------------------------------

    def control(self, box, description: str):
        """The input (or select) of the control described as `description`."""
        label = box.page.locator(
            ".widget-label", has_text=re.compile(f"^{re.escape(description)}$")
        )
        row = box.locator(".widget-inline-hbox", has=label)
        return row.locator("input, select").first

    def type_into(self, box, description: str, text: str, submit: bool = False) -> None:
        """Click the control, select what it holds, and type `text` key by key; `submit`
        presses Enter after (text boxes that update on Enter)."""
        field = self.control(box, description)
        field.click()
        field.press("ControlOrMeta+a")
        field.press_sequentially(text, delay=60)
        if submit:
            field.press("Enter")

    def choose(self, box, description: str, option: str) -> None:
        self.control(box, description).select_option(label=option)

    def screenshot(self, box, state: str) -> Path:
        path = self.results_dir / f"{state}.png"
        if self.front_end.whole_outputs_css:
            self.page.add_style_tag(content=self.front_end.whole_outputs_css)
        box.scroll_into_view_if_needed()
        box.screenshot(path=path)
        return path
