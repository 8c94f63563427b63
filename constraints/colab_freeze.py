"""Make the pip constraints of Colab's runtimes from the package lists Colab publishes.

Colab publishes the packages of its runtimes in the public repository
`googlecolab/backend-info`: `pip-freeze.tpu.txt` (the TPU runtime's `pip freeze`) and
`os-info-tpu.txt` (its Ubuntu and Python). A copy of each, as published, lives in a folder of
`constraints/colab/`, with `source.txt`: the repository, the commit and its date.

    constraints/colab/tpu/      Colab's TPU runtime  -> oldest.txt, tpu-oldest.txt
    constraints/colab/2026.07/  its past runtime 2026.07 -> colab-2026.07.txt

For the course's environments a constraint file is the whole freeze: first the packages that
the course, its tests and the browser test import, directly or through Jupyter (`COURSE`,
which the freeze must have), then every other package of the freeze, so that what pip brings
beside them (matplotlib's and Jupyter's own dependencies, pytest) is Colab's version too.
Packages Colab does not have (JupyterLab, hypothesis, playwright, ruff) float. The
TPU-compile environment needs jax's packages and libtpu only (`TPU`).

To refresh from a newer freeze, with a clone of googlecolab/backend-info in $COLAB:

    for f in pip-freeze.tpu.txt os-info-tpu.txt; do
        git -C $COLAB show HEAD:$f > constraints/colab/tpu/$f; done
    git -C $COLAB log -1 --date=short --format='googlecolab/backend-info %H %ad' \
        > constraints/colab/tpu/source.txt
    python3 constraints/colab_freeze.py     # rewrites the constraint files
    python3 tasks.py test                   # installs them and runs the tests

(and the same for a past runtime's folder, from the commit Colab's README names for it). If
Colab's Python changes, so does COLAB_PYTHON in tasks.py: the test below says so.

A pinned version that does not install on a stock Python (Colab builds some packages itself)
goes in `NEAREST` with the version that does; the constraint file says so beside the pin.
tests/test_colab_freeze.py checks that the committed files are what this writes.
"""

from __future__ import annotations

import re
from pathlib import Path

HERE = Path(__file__).resolve().parent

COURSE = [
    # jax and what it imports
    "jax", "jaxlib", "numpy", "ml_dtypes", "opt_einsum", "scipy",
    # the figures
    "matplotlib", "pillow",
    # the explorers and the kernel that runs the notebooks
    "ipywidgets", "widgetsnbextension", "jupyterlab_widgets", "ipykernel", "ipython",
    "traitlets", "jupyter_client", "pyzmq", "tornado",
    # the notebook server and running notebooks
    "notebook", "nbclassic", "jupyter_server", "nbclient", "nbformat",
]  # fmt: skip
# jax, all that it depends on, and libtpu (installed apart from `jax[tpu]`, as Colab does).
TPU = ["jax", "jaxlib", "libtpu", "numpy", "ml_dtypes", "opt_einsum", "scipy"]

# (package, version in Colab's freeze) -> (the nearest version that installs, why). Empty
# now: every version that the venvs install from these freezes has a wheel for this machine's
# Python 3.13.0 and 3.12.1.
NEAREST: dict[tuple[str, str], tuple[str, str]] = {}

# Colab's runtime folder -> {constraint file: (what it is for, its packages, whole freeze?)}.
RUNTIMES = {
    "tpu": {
        "oldest.txt": (".venv-oldest: the course on Colab's TPU runtime", COURSE, True),
        "tpu-oldest.txt": (".venv-tpu-oldest: the TPU compile on Colab's jax and libtpu", TPU,
                           False),
    },
    "2026.07": {
        "colab-2026.07.txt": (".venv-colab-2026.07: the course on Colab's past runtime 2026.07",
                              COURSE, True),
    },
}  # fmt: skip


def normalize(name: str) -> str:
    """PEP 503: `ml-dtypes`, `ML_dtypes` and `ml.dtypes` are one package."""
    return re.sub(r"[-_.]+", "-", name).lower()


def read_freeze(text: str) -> dict[str, tuple[str, str]]:
    """`pip freeze` text -> {normalized name: (name as written, version)}; lines that are not
    `name==version` (comments, `name @ url`) are left out.

    >>> read_freeze("# a comment\\nML_dtypes==0.6.0\\ntorch @ https://x/torch.whl")
    {'ml-dtypes': ('ML_dtypes', '0.6.0')}
    """
    pins = {}
    for line in text.splitlines():
        m = re.fullmatch(r"([A-Za-z0-9][A-Za-z0-9._-]*)==(\S+)", line.strip())
        if m:
            pins[normalize(m.group(1))] = (m.group(1), m.group(2))
    return pins


def python_version(os_info: str) -> str:
    """The Python of `os-info-tpu.txt` ("Python 3.13.15" -> "3.13.15")."""
    m = re.search(r"^Python (\d+\.\d+\.\d+)", os_info, re.MULTILINE)
    if m is None:
        raise ValueError("os-info-tpu.txt has no line 'Python X.Y.Z'; is it Colab's file?")
    return m.group(1)


def constraints(
    purpose: str, packages: list[str], whole: bool, freeze: str, os_info: str, source: str
) -> str:
    """The text of one constraint file: a header saying where the pins come from, then
    `name==version` for each of `packages`, then (if `whole`) for the rest of the freeze. A
    pin that is not the freeze's says why beside it."""
    pins = read_freeze(freeze)
    missing = [p for p in packages if normalize(p) not in pins]
    if missing:
        raise ValueError(
            f"{missing} are not pinned in this pip-freeze.tpu.txt; if Colab dropped them, "
            "take them out of COURSE or TPU in constraints/colab_freeze.py."
        )
    repo, commit, date = source.split()
    lines = [
        f"# {purpose}.",
        f"# Generated by constraints/colab_freeze.py from Colab's pip-freeze.tpu.txt of {date}",
        f"# ({repo} at {commit[:12]}; Python {python_version(os_info)}). Do not edit by hand.",
    ]
    lines += [pin(*pins[normalize(p)]) for p in packages]
    if whole:
        lines.append("# The rest of Colab's freeze: what pip installs beside them is Colab's too.")
        chosen = {normalize(p) for p in packages}
        lines += [pin(*pins[key]) for key in pins if key not in chosen]
    return "\n".join(lines) + "\n"


def pin(name: str, version: str) -> str:
    """`name==version`, or the nearest version that installs, with the reason (`NEAREST`)."""
    if (normalize(name), version) in NEAREST:
        nearest, why = NEAREST[normalize(name), version]
        return f"{name}=={nearest}  # Colab: {version}; {why}"
    return f"{name}=={version}"


def generated_files(colab_dir: Path = HERE / "colab") -> dict[str, str]:
    """{constraint file name: its text}, from every runtime folder of `colab_dir`."""
    files = {}
    for runtime, outputs in RUNTIMES.items():
        folder = colab_dir / runtime
        texts = [(folder / n).read_text() for n in ("pip-freeze.tpu.txt", "os-info-tpu.txt")]
        source = (folder / "source.txt").read_text()
        for file_name, (purpose, packages, whole) in outputs.items():
            files[file_name] = constraints(purpose, packages, whole, *texts, source)
    return files


def main() -> None:
    for name, text in generated_files().items():
        path = HERE / name
        if not path.exists() or path.read_text() != text:
            path.write_text(text)
            print(f"wrote constraints/{name}")
        else:
            print(f"constraints/{name} is up to date")


if __name__ == "__main__":
    main()
