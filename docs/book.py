"""The course as a book: writes the Jupyter Book 2 (MyST) project of the course into a folder.

    python docs/book.py EXECUTED SOURCE   # tasks.py book runs it in .venv, which has minilib

EXECUTED holds the executed notebooks (tests/test_notebooks.py keeps them); SOURCE gets:

    myst.yml            the table of contents: the landing page, the notebooks, the
                        exercises, the reference, the instructor's guide
    index.md            the landing page: who the course is for and how to run it, the
                        README's own sections
    notebooks/*.ipynb   the executed notebooks, each explorer as its static figure, "notebook
                        03" a link to it and `make_batch` a link to its reference entry
    docs/glossary.md    the glossary, at the path the notebooks' links to it name
    exercises/NN.md     a page per notebook's exercise set, each checker with its docs
    reference/*.md      a page per module the notebooks import, from its docstrings
    instructors.md      the instructor's guide, docs/instructors.md (its tables written by
                        docs/instructors_times.py), its names linked as the notebooks' are
    docs/img/           the README's screenshots

Every documented name gets a label, `api-<module>-<name>` (dots as dashes), that any page can
link to: `[make_batch](#api-minilib-batch-make_batch)`.
"""

from __future__ import annotations

import importlib
import inspect
import json
import re
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# The README's sections that the landing page shows, in this order, after its opening.
LANDING_SECTIONS = [
    "Two commands",
    "On Colab",
    "Notebook 7, and the course as a book",
    "The course",
    "Supported stacks",
    "On a TPU VM",
]
LIVE_NOTE = (
    "A static figure of the explorer: when you run the notebook (locally, on Colab or on a "
    "TPU VM) its controls are live."
)
# The glossary, at the same path in the book's source as in the repository, so that the
# notebooks' links to it (`../docs/glossary.md#mxu`) reach it in both.
GLOSSARY = "docs/glossary.md"
WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"
WIDGET_STATE = "application/vnd.jupyter.widget-state+json"


def readme_sections(readme: str) -> dict[str, str]:
    """The README cut at its `## ` headings: {heading: text}, the opening under ""."""
    sections, name = {"": ""}, ""
    for line in readme.splitlines(keepends=True):
        if line.startswith("## "):
            name = line[3:].strip()
            sections[name] = ""
        sections[name] += line
    return sections


def landing_page(readme: str) -> str:
    """The README's opening (who the course is for, where it runs) and how to run it."""
    sections = readme_sections(readme)
    missing = [name for name in LANDING_SECTIONS if name not in sections]
    if missing:
        raise ValueError(f"README.md has no section {missing}: update LANDING_SECTIONS")
    return "".join(sections[name] for name in ["", *LANDING_SECTIONS])


# The course's notebooks: the lessons (`09_performance.ipynb`) and their appendices
# (`09a_performance_appendix.ipynb`), which sort after them.
COURSE_GLOB = "[0-9][0-9]*_*.ipynb"


def is_appendix(path: Path) -> bool:
    """`09a_performance_appendix.ipynb`: an appendix, not a lesson.

    >>> is_appendix(Path("09a_performance_appendix.ipynb"))
    True
    >>> is_appendix(Path("09_performance.ipynb"))
    False
    """
    return path.name[2] != "_"


def link_notebook_names(markdown: str, notebooks: list[Path]) -> str:
    """`01_attention_and_head_grouping` (the README's table of the course) as a link to it."""
    names = {p.stem for p in notebooks}
    return re.sub(r"`(\d\d[a-z]?_\w+)`",
                  lambda m: f"[{m[0]}](notebooks/{m[1]}.ipynb)" if m[1] in names else m[0],
                  markdown)  # fmt: skip


def label(module: str, name: str) -> str:
    return f"api-{module.replace('.', '-')}-{name}"


def docstring_markdown(doc: str) -> str:
    """A docstring as MyST markdown: its doctest examples fenced as Python, its indented
    blocks as text, the rest as is (with `2*h` kept from turning into emphasis)."""
    out, fence = [], None  # the open fence: "python" (an example) or "text" (indented lines)
    for line in inspect.cleandoc(doc).splitlines():
        starts = "python" if line.startswith(">>>") else "text" if line.startswith("  ") else None
        if fence and (not line.strip() or (fence == "text" and not starts)):
            out.append("```")
            fence = None
        if not fence and starts:
            out.append(f"```{starts}")
            fence = starts
        out.append(line if fence else unstarred(line))
    if fence:
        out.append("```")
    return "\n".join(out)


def unstarred(line: str) -> str:
    """`2*h` outside inline code as `2\\*h`: a product, not emphasis."""
    parts = re.split(r"(`[^`]*`)", line)
    parts[::2] = [re.sub(r"(?<=\w)\*(?=\w)", r"\\*", part) for part in parts[::2]]
    return "".join(parts)


class Annotation(str):
    """An annotation kept as a string (`from __future__ import annotations`), shown as code
    rather than as a quoted string."""

    def __repr__(self) -> str:
        return str(self)


def plain_signature(obj) -> inspect.Signature:
    sig = inspect.signature(obj)

    def plain(annotation):
        return Annotation(annotation) if isinstance(annotation, str) else annotation

    params = [p.replace(annotation=plain(p.annotation)) for p in sig.parameters.values()]
    return sig.replace(parameters=params, return_annotation=plain(sig.return_annotation))


def entry(module: str, name: str, obj) -> str:
    """One public name: its label, heading, signature and docstring."""
    try:
        signature = f"{name}{plain_signature(obj)}" if callable(obj) else name
    except (TypeError, ValueError):
        signature = name
    kind = "class " if inspect.isclass(obj) else ""
    doc = inspect.getdoc(obj) if callable(obj) else None
    body = docstring_markdown(doc) if doc else ""
    code = f"```python\n{kind}{signature}\n```"
    return f"({label(module, name)})=\n### `{name}`\n\n{code}\n\n{body}\n"


def public_names(module) -> list[str]:
    return list(getattr(module, "__all__", []))


def module_page(module_name: str) -> str:
    module = importlib.import_module(module_name)
    entries = [entry(module_name, n, getattr(module, n)) for n in public_names(module)]
    doc = docstring_markdown(module.__doc__ or "")
    return f"# `{module_name}`\n\n{doc}\n\n" + "\n".join(entries)


def imported_modules(notebooks: list[Path]) -> list[str]:
    """The minilib modules the notebooks import: minilib, then the others in course order."""
    found = []
    for path in notebooks:
        for match in re.finditer(r"(?:from|import) (minilib[\w.]*)", path.read_text()):
            if match[1] not in found:
                found.append(match[1])
    return sorted(found, key=lambda name: name != "minilib")


def exercise_page(number: str, notebook: Path) -> str:
    """Notebook `number`'s exercises: a link to it, then each checker with its docs."""
    import minilib.exercises as exercises

    modules = sorted((ROOT / "minilib" / "exercises").glob(f"ex{number}_*.py"))
    lines = [f"# Exercises of notebook {number}\n",
             f"The exercises close [notebook {number}](../notebooks/{notebook.name}). Each is "
             "a function to fill in; its checker runs it against minilib's tested version and "
             "prints `Passed`, or the case and output that differ.\n"]  # fmt: skip
    for path in modules:
        name = f"minilib.exercises.{path.stem}"
        module = importlib.import_module(name)
        lines.append(f"## `{name}`\n\n{docstring_markdown(module.__doc__ or '')}\n")
        for checker in public_names(module):
            if checker.startswith("check_") and hasattr(exercises, checker):
                lines.append(entry(name, checker, getattr(module, checker)))
    return "\n".join(lines)


def exercise_targets(numbers: list[str]) -> dict[str, str]:
    """{checker: label} of each checker that the exercise pages of notebooks `numbers` document
    (as `exercise_page` does)."""
    import minilib.exercises as exercises

    targets = {}
    for number in numbers:
        for path in sorted((ROOT / "minilib" / "exercises").glob(f"ex{number}_*.py")):
            name = f"minilib.exercises.{path.stem}"
            for checker in public_names(importlib.import_module(name)):
                if checker.startswith("check_") and hasattr(exercises, checker):
                    targets[checker] = label(name, checker)
    return targets


def instructors_page(guide: str, notebooks: list[Path], targets: dict[str, str]) -> str:
    """The instructor's guide as a page of the book: `08_tpu_kernel` and "notebook 08" link to
    the notebook, a checker's name to its entry on the exercise pages (`targets`)."""
    pages = {p.name[:2]: f"notebooks/{p.name}" for p in notebooks if not is_appendix(p)}
    return link_prose(link_notebook_names(guide, notebooks), targets, pages)


def link_targets(modules: list[str]) -> dict[str, str]:
    """{name: label} for each public function and class, linked to the module defining it."""
    targets = {}
    for module_name in modules:
        module = importlib.import_module(module_name)
        for name in public_names(module):
            obj = getattr(module, name)
            if callable(obj) and (name not in targets or obj.__module__ == module_name):
                targets[name] = label(module_name, name)
    return targets


def link_prose(markdown: str, targets: dict[str, str], notebooks: dict[str, str]) -> str:
    """`name` (or `name()`) becomes a link to its reference entry and "notebook 03" a link to
    that notebook, outside code blocks and existing links."""

    def to_entry(match):
        name = match[1].removeprefix("minilib.").rsplit(".", 1)[-1]
        return f"[{match[0]}](#{targets[name]})" if name in targets else match[0]

    def to_notebook(match):
        page = notebooks.get(match[2])
        return f"[{match[0]}]({page})" if page else match[0]

    out, fenced = [], False
    for line in markdown.splitlines(keepends=True):
        fenced ^= line.lstrip().startswith("```")
        if not fenced:
            line = re.sub(r"(?<![\[\w])`((?:minilib\.)?[\w.]+)(?:\(\))?`(?!\])", to_entry, line)
            line = re.sub(r"(?<!\[)\b([Nn]otebook) (\d\d)\b(?!\])", to_notebook, line)
        out.append(line)
    return "".join(out)


def static_explorer(output: dict, widget_state: dict) -> list[dict]:
    """An explorer's output as the book shows it: its figure (the PNG in its widget state)
    and a line saying that it is live when the notebook runs."""
    found, todo = [], [output["data"][WIDGET_VIEW]["model_id"]]
    while todo:  # the explorer's widgets, children first found first
        model = widget_state.get(todo.pop(0), {})
        found.append(model)
        children = json.dumps(model.get("state", {}))
        todo += re.findall(r"IPY_MODEL_(\w+)", children)
    outputs = []
    for model in found:
        buffers = {tuple(b["path"]): b["data"] for b in model.get("buffers", [])}
        if model.get("model_name") == "ImageModel" and buffers.get(("value",)):
            outputs.append({"output_type": "display_data", "metadata": {},
                            "data": {"image/png": buffers[("value",)]}})  # fmt: skip
    note = {"output_type": "display_data", "metadata": {},
            "data": {"text/html": f"<p><em>{LIVE_NOTE}</em></p>"}}  # fmt: skip
    return [*outputs, note]


def book_notebook(path: Path, targets: dict[str, str], notebooks: dict[str, str]) -> dict:
    """The executed notebook at `path` as the book shows it."""
    nb = json.loads(path.read_text())
    state = nb.get("metadata", {}).pop("widgets", {}).get(WIDGET_STATE, {}).get("state", {})
    for cell in nb["cells"]:
        if cell["cell_type"] == "markdown":
            cell["source"] = link_prose("".join(cell["source"]), targets, notebooks)
        outputs = []
        for output in cell.get("outputs", []):
            is_widget = WIDGET_VIEW in output.get("data", {})
            outputs += static_explorer(output, state) if is_widget else [output]
        if "outputs" in cell:
            cell["outputs"] = outputs
    return nb


def toc(notebooks: list[Path], exercises: list[str], modules: list[str]) -> dict:
    def part(title, files):
        return {"title": title, "children": [{"file": f} for f in files]}

    return {
        "version": 1,
        "project": {
            "title": "Ragged paged attention, from jax.numpy to a TPU kernel",
            "toc": [
                {"file": "index.md"},
                part("The course", [f"notebooks/{p.name}" for p in notebooks]),
                {"file": GLOSSARY},
                part("Exercises", [f"exercises/{n}.md" for n in exercises]),
                part("minilib reference", [f"reference/{m}.md" for m in modules]),
                part("For instructors", ["instructors.md"]),
            ],
        },
        # A template of our own (docs/book_template), since the book theme is downloaded
        # from the web at build time: `jupyter book build --site` writes the pages' content,
        # docs/book_html.py makes them HTML.
        "site": {"template": "./template"},
    }


def write_book(executed: Path, source: Path) -> None:
    notebooks = sorted(executed.glob(COURSE_GLOB))  # the lessons, each appendix after its own
    course = sorted((ROOT / "notebooks").glob(COURSE_GLOB))
    missing = sorted({p.name for p in course} - {p.name for p in notebooks})
    if missing:
        raise ValueError(f"{executed} lacks the executed {missing}: run them with "
                         "`pytest -m notebooks tests/test_notebooks.py` (a failed one is not "
                         "kept), then build the book again")  # fmt: skip
    shutil.rmtree(source, ignore_errors=True)
    for folder in ("notebooks", "exercises", "reference"):
        (source / folder).mkdir(parents=True)
    shutil.copytree(ROOT / "docs" / "img", source / "docs" / "img")
    shutil.copy(ROOT / GLOSSARY, source / GLOSSARY)
    shutil.copytree(ROOT / "docs" / "book_template", source / "template")
    landing = landing_page((ROOT / "README.md").read_text())
    (source / "index.md").write_text(link_notebook_names(landing, notebooks))

    modules = [m for m in imported_modules(notebooks) if not m.startswith("minilib.exercises")]
    for module in modules:
        (source / "reference" / f"{module}.md").write_text(module_page(module))
    numbers = []
    for path in [p for p in notebooks if not is_appendix(p)]:
        if list((ROOT / "minilib" / "exercises").glob(f"ex{path.name[:2]}_*.py")):
            numbers.append(path.name[:2])
            page = exercise_page(path.name[:2], path)
            (source / "exercises" / f"{path.name[:2]}.md").write_text(page)

    targets = link_targets(modules)
    pages = {p.name[:2]: f"./{p.name}" for p in notebooks if not is_appendix(p)}
    for path in notebooks:
        nb = book_notebook(path, targets, pages)
        (source / "notebooks" / path.name).write_text(json.dumps(nb))
    guide = (ROOT / "docs" / "instructors.md").read_text()
    checkers = exercise_targets(numbers)
    (source / "instructors.md").write_text(instructors_page(guide, notebooks, checkers))
    (source / "myst.yml").write_text(json.dumps(toc(notebooks, numbers, modules), indent=1))


if __name__ == "__main__":
    write_book(Path(sys.argv[1]), Path(sys.argv[2]))
