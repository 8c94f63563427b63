"""Watching a kernel run in TPU interpret mode: every copy it starts, every wait, and what
JAX printed, so that a checker can name a DMA bug instead of missing it.

TPU interpret mode simulates the DMA engine and the semaphores in Python. `watch_kernel()`
listens to that simulation while a kernel runs, and keeps a ledger:

  copies     every `make_async_copy(...).start()`: its source and destination, its
             semaphore, its bytes, and how many of them a `.wait()` took back;
  deadlock   a `.wait()` on a semaphore whose count is too low while no copy in flight will
             signal it: in interpret mode nothing else runs, so the kernel would hang for ever.
             The wait raises `KernelDeadlock` at once instead (on the chip it would hang);
  shared     a wait on a semaphore that two copies in flight, into different slots (or
             buffers), signal (the pages of one block, into one slot, may share one):
             the wait cannot tell which copy landed (the counts still balance at exit, and no
             race shows, so only the ledger sees it);
  overwrite  a copy started into a place that an earlier copy, not yet waited for, is still
             filling;
  output     whatever the interpreter printed (race reports, "Semaphore ... non-zero count ...
             at kernel exit") or logged, kept here instead of shown.

At exit, the copies whose bytes no wait took back were started and never waited for.

The simulation's classes moved between JAX versions (one module in 0.7, a package from 0.8):
`_interpreter_parts` finds them. The ledger patches two of their methods for the duration of
the watch and restores them after; the simulation itself runs unchanged.

The simulation keeps global state between kernels, and JAX asks for
`reset_tpu_interpret_mode_state()` after a kernel raised: `watch_kernel` resets it before and
after every run, so one run's leftovers never show in the next.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import io
import logging
import re
import threading

from minilib.ladder.interpret import races_found

__all__ = ["Copy", "Race", "Watch", "parse_races", "watch_kernel"]


class KernelDeadlock(RuntimeError):
    """Raised inside the interpreter by a wait that nothing will ever end."""


class KernelStopped(RuntimeError):
    """Raised inside the interpreter when the watcher stops a kernel that ran too long."""


@dataclasses.dataclass
class Copy:
    """One DMA the kernel started, as the ledger saw it.

    `source` and `destination` index the source and destination refs, one entry per axis: an
    int where the copy took one element of that axis (a page, a slot), a (start, stop) range
    where it took a part, and ":" where it took the whole axis.

    >>> c = Copy(0, source=(7, ":", ":"), destination=(1, ":", ":"), buffer=107,
    ...          semaphore=2001, core=0, nbytes=4096)
    >>> c.outstanding, c.slot, c.page
    (4096, 1, 7)
    """

    number: int  # the order it was started in: 0, 1, ...
    source: tuple
    destination: tuple
    buffer: int  # the destination buffer's id in the interpreter
    semaphore: int  # the id of the semaphore it signals
    core: int
    nbytes: int = 0
    waited: int = 0  # how many of its bytes waits have taken back
    dma_id: int = -1  # the interpreter's id of the DMA (the race detector names it)
    started_at: str = ""  # the line of code that started it, when JAX says
    step: int = -1  # the grid step that started it, when the grid steps are recorded
    in_flight: int = 0  # copies on its core not yet waited for when it started

    @property
    def outstanding(self) -> int:
        """Bytes that landed (or will) and that no wait has taken back yet."""
        return self.nbytes - self.waited

    @property
    def slot(self):
        """The first integer index of the destination (the slot of a `bufs[2, ...]`), or None
        for a copy into a whole buffer."""
        return next((x for x in self.destination if isinstance(x, int)), None)

    @property
    def page(self):
        """The first integer index of the source (the page of `kv_pages`), or None."""
        return next((x for x in self.source if isinstance(x, int)), None)


@dataclasses.dataclass(frozen=True)
class Race:
    """The first race the detector printed: the two accesses, as JAX describes them.

    `buffer` is the interpreter's id of the buffer, `where` its index range as JAX printed it;
    each access is (kind, who, line): kind "read" or "write", who the number JAX gives the
    accessor (a DMA's id, 100 and up, or the core's device id), line the code that made it.

    >>> race = Race(107, "(1, slice(0, 8, 1))", ("read", 0, "k.py:9:4 (kernel)"),
    ...             ("write", 100, "k.py:7:4 (kernel)"))
    >>> race.slot, race.second[1]   # slot 1, written by the DMA whose id is 100
    (1, 100)
    """

    buffer: int
    where: str
    first: tuple[str, int, str]
    second: tuple[str, int, str]

    @property
    def slot(self):
        """The first index of the range, when it is an int (a slot of `bufs[2, ...]`)."""
        m = re.match(r"\((\d+),", self.where)
        return int(m.group(1)) if m else None


# "from 0, 0, k.py:9:4 (kernel)"; from jax 0.12 "from (0, 0), k.py:9:4 (kernel)".
_RACE_ACCESS = re.compile(
    r"^\s*(read|write) of \(([^)]*)\)\[(.*)\] from \(?(\d+), (\d+)\)?,? ?(.*)$"
)


def parse_races(output: str) -> list[Race]:
    """The races in the race detector's printed report (one `RACE DETECTED` block each).

    >>> text = '''RACE DETECTED
    ...   read of ('vmem', 107, 0, 0)[(0, slice(0, 8, 1))] from 0, 0, k.py:9:4 (kernel)
    ...   write of ('vmem', 107, 0, 0)[(0, slice(0, 8, 1))] from 101, 0 k.py:7:4 (kernel)'''
    >>> race = parse_races(text)[0]
    >>> race.buffer, race.first, race.second
    (107, ('read', 0, 'k.py:9:4 (kernel)'), ('write', 101, 'k.py:7:4 (kernel)'))
    >>> newer = text.replace("from 0, 0,", "from (0, 0),").replace("from 101, 0", "from (101, 0),")
    >>> parse_races(newer) == parse_races(text)   # jax 0.12 writes the thread as a pair
    True
    """
    races, lines = [], output.splitlines()
    for i, line in enumerate(lines):
        if line.strip() != "RACE DETECTED":
            continue
        accesses = [m for m in (_RACE_ACCESS.match(x) for x in lines[i + 1 : i + 6]) if m]
        if len(accesses) < 2:
            continue
        (a, b) = accesses[:2]
        key = a.group(2).split(",")  # (memory space, buffer id, device, core)
        buffer = int(key[1]) if len(key) > 1 and key[1].strip().isdigit() else -1
        first = (a.group(1), int(a.group(4)), a.group(6).strip())
        second = (b.group(1), int(b.group(4)), b.group(6).strip())
        races.append(Race(buffer, a.group(3), first, second))
    return races


# --- the simulation's parts, in this JAX -----------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Parts:
    semaphore: type  # the simulated semaphore: signal(), wait()
    dma: type  # one simulated DMA, made by each start()
    modules: tuple  # the modules whose `_get_shared_memory` the simulation calls
    reset: object  # reset_tpu_interpret_mode_state


def _interpreter_parts() -> _Parts:
    for calls, memory in (
        ("jax._src.pallas.mosaic.interpret.interpret_pallas_call",  # jax 0.8 and later
         "jax._src.pallas.mosaic.interpret.shared_memory"),
        ("jax._src.pallas.mosaic.interpret", "jax._src.pallas.mosaic.interpret"),  # jax 0.7
    ):  # fmt: skip
        try:
            calls_module, memory_module = (importlib.import_module(m) for m in (calls, memory))
        except ImportError:
            continue
        if hasattr(memory_module, "Semaphore") and hasattr(calls_module, "DMA"):
            return _Parts(
                semaphore=memory_module.Semaphore,
                dma=calls_module.DMA,
                modules=(calls_module,),
                reset=calls_module.reset_tpu_interpret_mode_state,
            )
    raise RuntimeError("cannot find the TPU interpret mode's semaphores and DMAs in this JAX")


def _counts(sem):
    """A semaphore's count on each core (the array JAX keeps)."""
    counts = getattr(sem, "count_by_core", None)  # jax 0.8 and later
    return sem.counts if counts is None else counts


def _count(sem, core: int) -> int:
    return int(_counts(sem)[core])


def release(sem, core: int, value: int) -> None:
    """End a wait on `sem` for `value` on `core` that nothing else would end: give the
    semaphore the count it waits for, and wake the waiter."""
    with sem.cv:
        _counts(sem)[core] += value
        sem.cv.notify_all()


def _copies_pending(sem, core: int, parts: _Parts) -> int:
    """Copies queued to signal `sem` later (dma_execution_mode="on_wait" only)."""
    if hasattr(sem, "tasks"):  # jax 0.8 and later
        return len(sem.tasks[core])
    memory = parts.modules[0]._get_shared_memory()
    return len(memory.dmas_by_sem.get(sem.id, ()))


def _num_cores(parts: _Parts) -> int:
    try:
        return int(parts.modules[0]._get_shared_memory().num_cores)
    except Exception:
        return 2  # unknown: assume another core might signal


def never_signalled(sem, value: int, core: int, is_dma: bool, parts: _Parts) -> bool:
    """Whether a wait for `value` on `sem` can never end: its count is too low, no copy is
    queued to signal it, and no other core could (a DMA semaphore, or a kernel on one core).
    In interpret mode nothing else runs while the wait waits, so it would wait for ever."""
    alone = is_dma or _num_cores(parts) == 1
    too_low = _count(sem, core) < value
    return too_low and _copies_pending(sem, core, parts) == 0 and alone


def _index(indexers) -> tuple:
    """A transform of the interpreter (NDIndexers) as a tuple: int, (start, stop) or ":"."""
    if not indexers:
        return ()
    indexer = indexers[-1]
    out = []
    for x, dim in zip(indexer.indices, indexer.shape, strict=False):
        if isinstance(x, int):
            out.append(int(x))
        elif int(x.start) == 0 and int(x.size) == dim:
            out.append(":")
        else:
            out.append((int(x.start), int(x.start) + int(x.size)))
    return tuple(out)


def _overlap(a: tuple, b: tuple) -> bool:
    def axis(x, y):
        if x == ":" or y == ":":
            return True
        x = (x, x + 1) if isinstance(x, int) else x
        y = (y, y + 1) if isinstance(y, int) else y
        return x[0] < y[1] and y[0] < x[1]

    return all(axis(x, y) for x, y in zip(a, b, strict=False))


def _line(source_info) -> str:
    if source_info is None:
        return ""
    try:
        from jax._src import source_info_util

        return source_info_util.summarize(source_info)
    except Exception:  # pragma: no cover - only a nicer message is lost
        return ""


# --- the watch ---------------------------------------------------------------------------------


class Watch:
    """The ledger of one kernel run (see the module docstring). Made by `watch_kernel`.

    >>> import jax, jax.numpy as jnp
    >>> from jax.experimental import pallas as pl
    >>> from jax.experimental.pallas import tpu as pltpu
    >>> def copy_kernel(x_hbm_ref, o_ref, buf, sem):
    ...     copy = pltpu.make_async_copy(x_hbm_ref, buf, sem)
    ...     copy.start()
    ...     copy.wait()
    ...     o_ref[...] = buf[...]
    >>> call = pl.pallas_call(copy_kernel, out_shape=jax.ShapeDtypeStruct((8, 128), jnp.float32),
    ...     in_specs=[pl.BlockSpec(memory_space=pl.ANY)],
    ...     scratch_shapes=[pltpu.VMEM((8, 128), jnp.float32), pltpu.SemaphoreType.DMA(())],
    ...     interpret=pltpu.InterpretParams(dma_execution_mode="eager"))
    >>> with watch_kernel() as watch:
    ...     _ = jax.block_until_ready(call(jnp.ones((8, 128))))
    >>> [(c.nbytes, c.outstanding) for c in watch.copies], watch.never_waited()
    ([(4096, 0)], [])
    """

    def __init__(self, parts: _Parts):
        self.parts = parts
        self.copies: list[Copy] = []
        self.deadlock: dict | None = None
        self.shared: list[Copy] | None = None  # two copies in flight on one semaphore
        self.overwrite: tuple[Copy, Copy] | None = None  # (new copy, the one it overwrites)
        self.stopped = False
        self.semaphore_ids: list[int] = []
        self._output = io.StringIO()
        self._lock = threading.RLock()
        self._starting = threading.local()  # the copy whose start is running in this thread
        self._blocked: dict[int, tuple] = {}  # thread -> (semaphore, value, core) it waits on
        self.raced = False  # the race detector's verdict, read before the state is reset
        self.found: dict[str, int] = {}  # "deadlock", "shared", "overwrite": copies started by then
        self.step = -1  # the grid step running now, when a grid point recorder says so

    # What the kernel printed or logged, as text.
    @property
    def output(self) -> str:
        return self._output.getvalue()

    def never_waited(self) -> list[Copy]:
        """The copies some of whose bytes no wait took back: in flight at kernel exit."""
        return [c for c in self.copies if c.outstanding > 0]

    def races(self) -> list[Race]:
        return parse_races(self.output)

    def copy_by_dma_id(self, dma_id: int) -> Copy | None:
        return next((c for c in self.copies if c.dma_id == dma_id), None)

    def semaphore_index(self, sem_id: int) -> int:
        """The semaphore's place among the kernel's semaphores (0 for sems[0], ...)."""
        ids = sorted(set(self.semaphore_ids) | {sem_id})
        return ids.index(sem_id)

    def stop(self) -> None:
        """Make the running kernel raise KernelStopped at its next memory access, DMA or
        wait, and release a wait it is stuck in (by signalling that semaphore)."""
        self.stopped = True

        def refuse():
            raise KernelStopped("stopped by the checker: it ran past its time limit")

        for module in self.parts.modules:
            module._get_shared_memory = refuse
        for sem, value, core in list(self._blocked.values()):
            release(sem, core, value)

    # --- what the patched methods call ---

    def _started(self, dma) -> None:
        if self.stopped:
            raise KernelStopped("stopped by the checker: it ran past its time limit")
        with self._lock:
            copy = Copy(
                number=len(self.copies),
                source=_index(dma.src_transforms),
                destination=_index(dma.dst_transforms),
                buffer=int(dma.dst_buffer_id),
                semaphore=int(dma.dst_sem.id),
                core=int(dma.dst_local_core_id),
                dma_id=int(dma.id),
                started_at=_line(getattr(dma, "source_info", None)),
                step=self.step,
                in_flight=sum(
                    old.outstanding > 0 or old.nbytes == 0  # started, not yet landed
                    for old in self.copies
                    if old.core == int(dma.dst_local_core_id)
                ),
            )
            for old in self.copies:
                if (
                    self.overwrite is None
                    and old.outstanding > 0
                    and old.buffer == copy.buffer
                    and old.core == copy.core
                    and _overlap(old.destination, copy.destination)
                ):
                    self.overwrite = (copy, old)
                    self.found["overwrite"] = copy.number
            self.copies.append(copy)
            self._remember_semaphores()
        self._starting.dma, self._starting.copy = dma, copy

    def _signalled(self, sem, inc) -> None:
        dma, copy = getattr(self._starting, "dma", None), getattr(self._starting, "copy", None)
        if copy is not None and sem is dma.dst_sem:
            copy.nbytes += int(inc)
            self._starting.dma = self._starting.copy = None

    def _waiting(self, sem, value, core, is_dma: bool) -> None:
        if self.stopped:
            raise KernelStopped("stopped by the checker: it ran past its time limit")
        value, core = int(value), int(core)
        with self._lock:
            self._remember_semaphores()
            mine = [c for c in self.copies if c.semaphore == sem.id and c.core == core]
            in_flight = [c for c in mine if c.outstanding > 0]
            places = {(c.buffer, c.destination if c.slot is None else c.slot) for c in in_flight}
            if self.shared is None and len(places) > 1:
                self.shared = in_flight
                self.found["shared"] = len(self.copies)
            if never_signalled(sem, value, core, is_dma, self.parts):
                count = _count(sem, core)
                self.deadlock = dict(
                    semaphore=sem.id,
                    core=core,
                    wanted=value,
                    count=count,
                    copies=mine,
                )
                self.found["deadlock"] = len(self.copies)
                raise KernelDeadlock(
                    f"a wait on semaphore {sem.id} for {value} bytes, which has {count}, and "
                    "no copy in flight will signal it"
                )

    def _waited(self, sem, value, core) -> None:
        if self.stopped:
            raise KernelStopped("stopped by the checker: it ran past its time limit")
        value, core = int(value), int(core)
        with self._lock:
            for c in self.copies:
                if c.semaphore == sem.id and c.core == core and c.outstanding > 0 and value > 0:
                    taken = min(value, c.outstanding)
                    c.waited += taken
                    value -= taken

    def _remember_semaphores(self) -> None:
        try:
            memory = self.parts.modules[0]._get_shared_memory()
            self.semaphore_ids = sorted(memory.sem)
        except Exception:
            pass


_ACTIVE = threading.Lock()  # one watch at a time: the patches are global


_RACE_LOGGER = "jax._src.pallas.mosaic.interpret.race_detection_state"


def _races_found() -> bool:
    try:
        return races_found()
    except RuntimeError:  # a JAX without the race detector
        return False


@contextlib.contextmanager
def watch_kernel():
    """Keep the ledger of the kernels run inside this block (one at a time), and capture
    what they print. Resets the interpreter's state before and after.

    The deadlock check assumes what the checkers run: one device, and DMAs that land when
    they start (`dma_execution_mode="eager"`) or wait in the simulation's queues.

    >>> import jax, jax.numpy as jnp
    >>> from jax.experimental import pallas as pl
    >>> from jax.experimental.pallas import tpu as pltpu
    >>> def waits_for_nothing(x_hbm_ref, o_ref, buf, sem):
    ...     pltpu.make_async_copy(x_hbm_ref, buf, sem).wait()   # no copy was ever started
    ...     o_ref[...] = buf[...]
    >>> call = pl.pallas_call(waits_for_nothing,
    ...     out_shape=jax.ShapeDtypeStruct((8, 128), jnp.float32),
    ...     in_specs=[pl.BlockSpec(memory_space=pl.ANY)],
    ...     scratch_shapes=[pltpu.VMEM((8, 128), jnp.float32), pltpu.SemaphoreType.DMA(())],
    ...     interpret=pltpu.InterpretParams(dma_execution_mode="eager"))
    >>> with watch_kernel() as watch:   # what the kernel prints goes to watch.output
    ...     try:
    ...         _ = jax.block_until_ready(call(jnp.ones((8, 128))))
    ...     except Exception as err:   # the wait raised at once, instead of hanging
    ...         raised = err
    >>> "KernelDeadlock" in str(raised)
    True
    >>> watch.deadlock["wanted"], watch.deadlock["count"], watch.deadlock["copies"]
    (4096, 0, [])
    """
    parts = _interpreter_parts()
    watch = Watch(parts)
    semaphore, dma = parts.semaphore, parts.dma
    original = dict(
        wait=semaphore.wait, signal=semaphore.signal, init=dma.__init__,
        shared=[m._get_shared_memory for m in parts.modules],
    )  # fmt: skip

    def init(self, *args, **kwargs):
        original["init"](self, *args, **kwargs)
        watch._started(self)

    def signal(self, inc, *args, **kwargs):
        watch._signalled(self, inc)
        return original["signal"](self, inc, *args, **kwargs)

    def wait(self, value, global_core_id, *args, **kwargs):
        is_dma = bool(kwargs.get("is_dma") or kwargs.get("has_tasks"))
        watch._waiting(self, value, global_core_id, is_dma)
        watch._blocked[threading.get_ident()] = (self, int(value), int(global_core_id))
        try:
            result = original["wait"](self, value, global_core_id, *args, **kwargs)
        finally:
            watch._blocked.pop(threading.get_ident(), None)
        watch._waited(self, value, global_core_id)
        return result

    class Keep(logging.Filter):  # the interpreter's logged tracebacks go to the ledger
        def filter(self, record):
            watch._output.write(record.getMessage() + "\n")
            return False

    keep = Keep()
    # From jax 0.12 the race detector logs its reports (race_detection_state) instead of printing.
    names = ("jax._src.callback", "jax._src.dispatch", _RACE_LOGGER)
    loggers = [logging.getLogger(name) for name in names]
    with _ACTIVE:
        parts.reset()
        semaphore.wait, semaphore.signal, dma.__init__ = wait, signal, init
        for logger in loggers:
            logger.addFilter(keep)
        try:
            with contextlib.redirect_stdout(watch._output):
                try:
                    yield watch
                finally:
                    watch.raced = _races_found()
        finally:
            semaphore.wait, semaphore.signal = original["wait"], original["signal"]
            dma.__init__ = original["init"]
            for module, get in zip(parts.modules, original["shared"], strict=True):
                module._get_shared_memory = get
            for logger in loggers:
                logger.removeFilter(keep)
            parts.reset()
