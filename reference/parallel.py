"""Independent pieces of NumPy work spread over the machine's cores, for the CPU backend's long prefills.

NumPy releases the GIL inside its loops and BLAS calls, so Python threads that each run NumPy on their own
slice of the data (attention's query tiles, row blocks of the MLP) keep every core busy, the elementwise
passes (exp, max, SiLU) included, which a multi-threaded BLAS alone leaves on one core. While the pieces
run, each BLAS call is held to one thread (threadpoolctl): a BLAS that also spread every small product
over all cores would have its threads wait on ours, and on each other on a busy machine. Attention's
pieces do not depend on the number of threads, so neither do its results; row blocks change only the
order of fp32 sums, as any other batch shape does.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Callable

from threadpoolctl import ThreadpoolController

WORKERS = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1

_pool: ThreadPoolExecutor | None = None
_blas: ThreadpoolController | None = None


def run_all(tasks: list[Callable[[], None]]) -> None:
    """Run every task (a function of no arguments, called for its effect) and return when all are done;
    in WORKERS threads, with single-threaded BLAS, when there are several. An exception in a task is
    raised here. Not reentrant: a task must not call run_all."""
    global _pool, _blas
    if WORKERS == 1 or len(tasks) < 2:
        for task in tasks:
            task()
        return
    if _pool is None:
        _pool = ThreadPoolExecutor(WORKERS, thread_name_prefix="reference")
        _blas = ThreadpoolController()
    with _blas.limit(limits=1, user_api="blas"):
        for future in [_pool.submit(task) for task in tasks]:
            future.result()


# Rows per piece of a row-wise step (norms, projections, the MLP), roughly: big enough that BLAS works at
# full speed on each piece's products (single-threaded, 256 rows ran 5% slower than 1024), small enough
# that each piece's arrays stay a few MB.
ROW_BLOCK = 1024


def for_row_blocks(function: Callable[[slice], None], num_rows: int) -> None:
    """function(rows) for consecutive slices of rows that cover range(num_rows): about ROW_BLOCK rows a
    slice, as many slices for each worker thread; one call, in this thread, for fewer than
    WORKERS * ROW_BLOCK / 2 rows (a decode step, a short prompt)."""
    pieces = max(1, WORKERS * round(num_rows / (WORKERS * ROW_BLOCK)))
    bounds = [num_rows * i // pieces for i in range(pieces + 1)]
    run_all([partial(function, slice(start, stop)) for start, stop in zip(bounds, bounds[1:])])
