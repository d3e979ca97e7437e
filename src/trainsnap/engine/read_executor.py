"""The executor of a load's read plan: every record of a plan is read through it.

:class:`ReadExecutor` runs the records of :mod:`trainsnap.engine.read_plan` on the I/O pool,
each by the strategy the reader's :class:`~trainsnap.engine.read_plan.ReadPolicy` picks, through
the :class:`~trainsnap.engine.reader.Reader`'s public reads (which verify every block);
:func:`read_payload` is a plan of one payload range run on the caller's thread.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from functools import partial
from operator import itemgetter
from types import TracebackType

from trainsnap import tunables
from trainsnap.engine.buffers import BouncePool
from trainsnap.engine.pool import TaskRunner
from trainsnap.engine.read_plan import CopyRead, ObjectRead, Record, object_reads
from trainsnap.engine.reader import Reader


class ReadExecutor:
    """Runs the records of a read plan on the I/O pool, each by the strategy of the reader's
    policy, as they are added (a caller may still be planning the rest):

    - an :class:`ObjectRead` of a block or more: a task of its own, :meth:`Reader.read`;
    - the smaller ones are kept until the block ends, then gathered per object into runs
      (cut only between blocks, where the gap exceeds a block or the run would span more
      than ``policy.coalesce_max`` bytes), a task each, :meth:`Reader.read_gathered`;
    - a windowed :class:`CopyRead`: a task with a bounce window of ``policy.window`` bytes
      (at least a block), :meth:`Reader.read_windows`;
    - any other :class:`CopyRead`: a task with a bounce buffer of its whole range, filled by
      :meth:`Reader.read` (one read per run), then handed to ``place`` once.

    Bounce buffers come from one :class:`~trainsnap.engine.buffers.BouncePool` within
    ``tunables.read_budget``. Leaving the ``with`` block waits for every task; the first
    failure cancels what has not started and is raised (see
    :class:`~trainsnap.engine.pool.TaskRunner`)."""

    def __init__(self, reader: Reader, threads: int) -> None:
        self.reader = reader
        self.pool = BouncePool(tunables.get().read_budget)
        self._runner = TaskRunner[None](threads)
        self._small: list[ObjectRead] = []
        self._block = reader.m.block_size

    def __enter__(self) -> ReadExecutor:
        return self

    def add(self, records: Iterable[Record]) -> None:
        reader, submit = self.reader, self._runner.submit
        for record in records:
            if isinstance(record, CopyRead):
                submit(partial(self._copy, record))
            elif record.stop - record.start >= self._block:
                submit(partial(reader.read, record))
            else:
                self._small.append(record)

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        try:
            if exc is None:
                try:
                    for run in self._gathered():
                        self._runner.submit(partial(self.reader.read_gathered, run, self.pool))
                except BaseException as e:
                    self._runner.__exit__(type(e), e, e.__traceback__)
                    raise
            self._runner.__exit__(exc_type, exc, traceback)
        finally:
            self.pool.close()

    def _gathered(self) -> Iterator[list[ObjectRead]]:
        """The small reads, per object, in runs each read and verified once."""
        bs, longest = self._block, self.reader.policy.coalesce_max
        by_object: dict[int, list[ObjectRead]] = {}
        for r in self._small:
            by_object.setdefault(r.obj, []).append(r)
        for reads in by_object.values():
            reads.sort(key=_START)
            run: list[ObjectRead] = []
            for r in reads:
                # a run is cut between blocks only: no two runs read and verify one block
                if (
                    run
                    and r.start // bs > (run[-1].stop - 1) // bs
                    and (r.start - run[-1].stop > bs or r.stop - run[0].start > longest)
                ):
                    yield run
                    run = []
                run.append(r)
            yield run

    def _copy(self, copy: CopyRead) -> None:
        if copy.windowed:
            with self.pool.buffer(max(self.reader.policy.window, self._block)) as window:
                self.reader.read_windows(copy, window)
            return
        with self.pool.buffer(copy.stop - copy.start) as buf:
            for read in object_reads(copy.runs, [buf], copy.key):
                self.reader.read(read)
            copy.place(copy.start, buf)


_START = itemgetter(1)


def read_payload(
    reader: Reader, owner: int, start: int, stop: int, out: memoryview, key: str
) -> None:
    """Fill ``out`` with bytes ``[start, stop)`` of payload ``owner`` (a shard's or value's
    bytes), every block verified: a plan of one read per chunk, run on the caller's thread."""
    with ReadExecutor(reader, 1) as executor:
        executor.add(object_reads(reader.payload_runs(owner, start, stop), [out], key))
