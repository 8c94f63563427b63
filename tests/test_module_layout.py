"""minilib's packages are the course's layers, and its imports run the course's way.

Two promises:

* **The top level is the course.** What the learner builds, chapter by chapter, sits flat at
  the top of `minilib` (`COURSE`), beside the packages of the kernel (one module per idea, in
  reading order), the rungs, the engine and the exercises they also write. The tools they
  use but never write live in packages named for their role: `explore` (figures, explorers,
  the mistakes catalogue), `tpu` (static TPU analysis) and `perf` (timing, workloads, the
  roofline, the benchmark), beside `chips` (the TPU chips' facts, which every layer reads)
  and `jax_patches` (jax fixed where the installed versions need it).
* **No module imports a later layer, and there is no cycle.** The layers follow the course:
  errors, the mask rule and the facts every layer may read; heads and options; the paged KV
  cache; batches and validation; the attention implementations; what is built on them
  (schedule, figures, timing, the ladder); and last the explorers, the command line, the
  engine and the exercises. A module may import its own layer and the layers before it.
  Every import counts, a lazy one inside a function too: a lazy import hides a cycle, it does
  not remove it.
"""

from __future__ import annotations

import ast
import fnmatch
import pathlib

import pytest

import minilib

PACKAGE = pathlib.Path(minilib.__file__).parent

# The learner's own modules, flat at the top of minilib (minilib/README.md lists them by chapter).
COURSE = {
    "errors", "heads", "options", "page_allocator", "kv_cache",  # ch. 01-02
    "batch", "masking", "validation",  # ch. 03-05
    "reference", "vectorized", "blockwise", "pallas_basics",  # ch. 04-07
    "kernel", "kernel_trace", "schedule", "block_sizes",  # ch. 08-09
    "ladder", "engine", "exercises",  # the rungs, the capstone, the exercises
}  # fmt: skip
# The tools, each package named for its role, the two entry points, and `parity`, the check
# every notebook's comparison with a reference asserts.
TOOLS = {"explore", "tpu", "perf", "parity", "doctor", "__main__", "chips", "jax_patches"}

LAYERS = [
    # 0. Leaves, or nearly: what every layer may read (errors, the mask rule, the TPU chips'
    #    facts and the patches to jax, the dump reader, the checkers' report machinery and
    #    their comparisons, the figures' style and the explorers' words, which know nothing of
    #    attention, and the parity check with its tolerances).
    ("errors", "masking", "kernel_trace", "chips", "jax_patches", "jax_patches.*",
     "tpu.bundles", "tpu.loop_paths", "tpu.dump_reader", "tpu.dump_cache", "tpu.labels",
     "tpu.memory", "tpu.compile", "tpu.numerics", "parity",
     "tpu.v3", "perf.roofline",
     "exercises.checking", "exercises.comparisons",
     "ladder.interpret", "explore.style", "explore.text"),
    # 1. Head grouping and the options object.
    ("heads", "options"),
    # 2. The paged KV cache (chapter 02).
    ("page_allocator", "kv_cache"),
    # 3. Ragged batches, and what every attention function checks its input with.
    ("batch", "validation"),
    # 4. The implementations, and the kernel's block sizes.
    ("reference", "vectorized", "blockwise", "pallas_basics", "block_sizes", "kernel",
     "kernel.*"),
    # 5. Built on them: the schedule, timing, workloads, the benchmark's plots, mistakes,
    #    the Explorer, the ladder.
    ("schedule", "perf.timing", "perf.workloads", "perf.plots", "perf.implementations",
     "perf.memory_sweep", "explore.mistakes", "explore.explorer", "ladder", "ladder.*"),
    # 6. The figures and explorers of each idea, the command line, the engine, the exercises,
    #    the packages' front doors.
    ("explore.head_grouping", "explore.page_table", "explore.ragged_batch",
     "explore.kernel_schedule", "explore.playground", "perf.bench", "perf.tpu_bench",
     "tpu.kernel_costs",
     "tpu.comparison", "tpu.block_times", "tpu.at_defaults", "tpu.suite", "tpu.listing",
     "tpu.sinks", "tpu.recorded", "tpu.lever_costs", "explore.levers",
     "doctor", "__main__", "engine", "engine.*", "exercises", "exercises.*", "explore", "tpu",
     "perf", ""),
]  # fmt: skip


def module_name(path: pathlib.Path) -> str:
    """'kv_cache', 'engine.model', 'engine' (a package's __init__), '' (minilib itself)."""
    parts = path.relative_to(PACKAGE).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in PACKAGE.rglob("*.py")}


def imports_of(name: str) -> set[str]:
    """The minilib modules that module `name` imports, anywhere in its file."""
    found = set()
    for node in ast.walk(ast.parse(MODULES[name].read_text())):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("minilib"):
            base = node.module.removeprefix("minilib").removeprefix(".")
            for alias in node.names:  # `from minilib import kernel` imports a module
                sub = f"{base}.{alias.name}".lstrip(".")
                found.add(sub if sub in MODULES else base)
        elif isinstance(node, ast.Import):
            found |= {a.name.removeprefix("minilib").removeprefix(".")
                      for a in node.names if a.name.startswith("minilib")}  # fmt: skip
    found.discard(name)
    return found


def layer_of(name: str) -> int:
    for i, patterns in enumerate(LAYERS):
        if any(fnmatch.fnmatchcase(name, p) for p in patterns):
            return i
    raise LookupError(f"minilib.{name} is in no layer: add it to LAYERS in {__file__}")


def test_the_top_level_is_the_course_and_the_tools_are_in_packages():
    top = {name.split(".")[0] for name in MODULES if name}
    assert top == COURSE | TOOLS, (
        f"not the course, not a tool package: {sorted(top - COURSE - TOOLS)}; "
        f"missing: {sorted(COURSE | TOOLS - top)}"
    )
    packages = {name for name in top if (PACKAGE / name / "__init__.py").exists()}
    assert packages == {
        "kernel", "ladder", "engine", "exercises", "explore", "tpu", "perf", "jax_patches"
    }  # fmt: skip


# A module a learner reads in one sitting (the kernel package's reason for being).
MAX_MODULE_LINES = 600


def test_no_module_is_longer_than_a_sitting():
    long = {name: n for name, path in MODULES.items()
            if (n := len(path.read_text().splitlines())) > MAX_MODULE_LINES}  # fmt: skip
    assert not long, f"over {MAX_MODULE_LINES} lines, split by idea: {long}"


def test_minilib_readme_names_every_module():
    """In its tables (`kernel`, `tpu/compile`; an exercise module by its name), and every
    package in the tree (`tpu/`)."""
    readme = (PACKAGE / "README.md").read_text()

    def shown(name: str) -> bool:
        if MODULES[name].name == "__init__.py":
            return f"  {name}/ " in readme
        if name.startswith("exercises.ex"):
            return f"`{name.removeprefix('exercises.')}`" in readme
        return f"`{name.replace('.', '/')}`" in readme

    missing = [name for name in MODULES if name and not shown(name)]
    assert not missing, f"minilib/README.md does not show: {missing}"


def test_a_moved_module_names_its_new_home():
    for old_import in (
        "import minilib.viz",
        "from minilib import tpu_compile",
        "from minilib.tpu import chips",
    ):
        with pytest.raises(ModuleNotFoundError, match="moved: .* Import from there"):
            exec(old_import, {})
    for name in minilib.MOVED:
        assert name not in MODULES, f"minilib.{name} exists again: take it out of MOVED"


def test_every_module_has_a_layer():
    for name in MODULES:
        layer_of(name)


@pytest.mark.parametrize("name", sorted(MODULES))
def test_imports_only_its_own_layer_and_earlier_ones(name):
    later = {dep: layer_of(dep) for dep in imports_of(name) if layer_of(dep) > layer_of(name)}
    assert not later, (
        f"minilib.{name} (layer {layer_of(name)}) imports modules of later layers: {later}"
    )


def test_no_import_cycle():
    graph = {name: imports_of(name) for name in MODULES}
    done, path = set(), []

    def visit(name):
        if name in path:
            raise AssertionError("import cycle: " + " -> ".join(path[path.index(name) :] + [name]))
        if name in done:
            return
        path.append(name)
        for dep in sorted(graph[name]):
            visit(dep)
        path.pop()
        done.add(name)

    for name in sorted(graph):
        visit(name)


def test_the_checks_can_fail():
    """The graph is read right: known edges are found, and an upward import would be caught."""
    assert "errors" in imports_of("heads")
    assert "kernel" in imports_of("schedule")
    assert layer_of("schedule") > layer_of("kernel")  # so kernel importing schedule would fail
    with pytest.raises(LookupError):
        layer_of("no_such_module")
    assert {"explore.style", "explore.text"} <= imports_of("explore.explorer")
    assert layer_of("explore.style") == 0  # so style importing anything of minilib would fail
