"""The expert's first kernels of a task, and a bench's next task built while this one runs.

A search's first batch waits for nvcc (1-1.5 s for a small task on the H200's host, about 10 s for a level-2
convolution) while the GPU sits idle, and the expert's first moves are deterministic. So a bench renders
its next task's first moves in a process of its own (rendering a level-3 plan takes seconds and holds the
GIL) and hands them to `compile.prefetch` while the current task runs; the next search finds them in the
compile cache, content-addressed as always. Only on a GPU machine, for the expert policy, with prefetch on.
A move the search does not make (its memory's lessons or a source hunt may reorder or change them) is a
build that went unused, nothing more.
"""

from __future__ import annotations

import concurrent.futures
import multiprocessing
import threading
import time
from pathlib import Path

from pipeline.config import Config
from pipeline.types import Candidate


def first_kernels(path: Path, n: int, arch: str = "sm_90a") -> list[Candidate] | str:
    """The expert's first n candidates for a task (a search's first expansion), or why there are none."""
    from pipeline.generate.base import Context, ProposalStatus
    from pipeline.generate.expert import ExpertPolicy
    from pipeline.tasks import TaskError, probe

    try:
        task = probe(path)
    except TaskError as e:
        return f"not probed: {e}"
    props = ExpertPolicy().propose(Context(task=task, reference=task.source, parent=None, arch=arch), n)
    cands = [p.candidate for p in props if p.status is ProposalStatus.OK and p.candidate is not None]
    return cands or "; ".join(p.reason for p in props) or "no proposal"


class NextTask:
    """Builds a bench's next task ahead: `start(path)` renders its first moves in a child process and
    prefetches them; `close()` drops what has not begun. Never raises into the bench."""

    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self._pool: concurrent.futures.ProcessPoolExecutor | None = None
        self._jobs: list[concurrent.futures.Future] = []
        self._handed = threading.Semaphore(0)  # released by each job's callback once it has prefetched
        self.prefetched = 0  # builds handed to compile.prefetch (not cached when their render came back)

    @staticmethod
    def wanted(cfg: Config, policy: str) -> bool:
        return policy == "expert" and cfg.prefetch and cfg.device == "cuda" and not cfg.ray

    def start(self, path: Path) -> None:
        from pipeline.compile import resolve_arch

        try:
            # spawned, not forked: the orchestrator runs threads (the nvcc ahead pool)
            if self._pool is None:
                self._pool = concurrent.futures.ProcessPoolExecutor(
                    1, mp_context=multiprocessing.get_context("spawn")
                )
            job = self._pool.submit(first_kernels, path, self.cfg.children_per_expand, resolve_arch(self.cfg))
        except Exception:  # a pool that cannot start only loses the head start
            return
        job.add_done_callback(self._built)
        self._jobs.append(job)

    def _built(self, job: concurrent.futures.Future) -> None:
        from pipeline.compile import prefetch

        try:
            cands = job.result()
            if isinstance(cands, list):
                self.prefetched += prefetch(cands, self.cfg)
        except Exception:  # a render that failed here fails again, with its reason, in the search
            pass
        finally:
            self._handed.release()

    def wait(self, timeout_s: float) -> bool:
        """Until the renders started so far are back and handed over (their builds may still run)."""
        deadline = time.monotonic() + timeout_s
        jobs, self._jobs = self._jobs, []
        return all(self._handed.acquire(timeout=max(0.0, deadline - time.monotonic())) for _ in jobs)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
