"""minilib's imports run the course's way: no cycle, and no module imports a later layer.

The layers follow the course: errors, heads and options; validation; the KV cache and batches;
the attention implementations; then what is built on them (schedule, timing, the ladder's
checks, the `Explorer` every explorer is made of), and last the figures and explorers of each
idea, the command line, the engine and the exercises. The figures' style and the explorers'
words are leaves: they know nothing of attention.
A module may import its own layer and the layers before it. Every import counts, a lazy one
inside a function too: a lazy import hides a cycle, it does not remove it.
"""

from __future__ import annotations

import ast
import fnmatch
import pathlib

import pytest

import minilib

PACKAGE = pathlib.Path(minilib.__file__).parent

LAYERS = [
    # 0. Leaves: they import nothing of minilib.
    ("errors", "masking", "kernel_trace", "perf.roofline", "tpu.memory", "tpu.compile",
     "exercises.checking", "ladder.interpret", "explore.style", "explore.text"),
    # 1-2. What every attention function checks its input with.
    ("heads", "options"),
    ("validation",),
    # 3. The paged KV cache and ragged batches.
    ("kv_cache", "batch"),
    # 4. The implementations, and the kernel's block sizes.
    ("reference", "vectorized", "blockwise", "pallas_basics", "block_sizes", "kernel"),
    # 5. Built on them: the schedule, timing, workloads, the benchmark's plots, mistakes,
    #    the Explorer, the ladder.
    ("schedule", "perf.timing", "perf.workloads", "perf.plots", "explore.mistakes",
     "explore.explorer", "ladder", "ladder.*"),
    # 6. The figures and explorers of each idea, the command line, the engine, the exercises.
    ("explore.head_grouping", "explore.page_table", "explore.ragged_batch",
     "explore.kernel_schedule", "explore.playground",
     "perf.bench", "tpu.kernel_costs", "doctor", "__main__", "engine",
     "engine.*", "explore", "tpu", "perf",
     "exercises", "exercises.*", ""),
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
