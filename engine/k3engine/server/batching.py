"""`k3 serve --parallel N`: continuous batching.  Up to N requests share every engine step
(generate.decode_many: one pass over the trunk and the union of their experts for all of
them); a request joins at the next step boundary, its prompt prefilled in the step it joins
(alongside the others' decode rows), and leaves when it ends, when its stop string matches
or when its client goes away.  Requests beyond N wait in the queue; 429 only beyond the
queue.  Each request's ids equal the same request served alone (tests/test_serve_batch.py).

The same interface as engine.EngineThread (submit, withdraw, status, close), so the routes
do not know which one runs.
"""
from __future__ import annotations

import time

from .engine import ApiError, EngineThread, Fail, engine_error


class BatchingEngineThread(EngineThread):
    def __init__(self, backend, queue: int, parallel: int):
        self.parallel = parallel
        self._slots: list = []                  # the requests in the batch, joined in order
        super().__init__(backend, queue)
        engine = backend.engine
        engine.sink = self._progress(engine.sink)

    def _progress(self, sink):
        """Prefill progress (per layer, from a prompt pass that runs alone) goes to the
        request whose prompt it is; a prompt that shares steps reports at its end."""
        def on_event(ev) -> None:
            prefilling = [s for s in self._slots if s.run.summary is not None
                          and not s.run.summary.steps]
            if len(prefilling) == 1:
                self.backend._progress_to(prefilling[0].job, sink)(ev)
            else:
                sink(ev)
        return on_event

    def submit(self, job) -> None:
        from .engine import QueueFull
        with self._cv:
            if self._closing:
                raise QueueFull(5)
            job.no = next(self._numbers)
            if len(self._slots) >= self.parallel and len(self._waiting) >= self.capacity:
                self.counts["refused_busy"] += 1
                raise QueueFull(self._retry_after())
            self._waiting.append(job)
            self._cv.notify()

    def status(self) -> dict:
        out = super().status()
        with self._cv:
            out.update(busy=bool(self._slots), slots=self.parallel,
                       slots_busy=len(self._slots), slot_figures=self.steps.slots(
                           [(s.job.no, s.index) for s in self._slots]))
        return out

    def close(self) -> None:
        with self._cv:
            for slot in self._slots:
                slot.job.cancel.set()
        super().close()

    # -- the step loop ----------------------------------------------------------------
    def _admit(self, runs: list) -> None:
        """Waiting requests take the free slots (their refusals answered at once)."""
        while True:
            with self._cv:
                if self._closing or not self._waiting or len(self._slots) >= self.parallel:
                    return
                job = self._waiting.popleft()
            job.post = self._watched(job.post)
            job.t0 = time.monotonic()
            try:
                slot = self.backend.open_slot(job)
            except ApiError as e:                  # refused before it started (400)
                job.post(Fail(e))
                self._count("refused_invalid", job)
                continue
            except BaseException as e:              # an engine failure, or a bug
                job.post(Fail(engine_error(e)))
                self._count("failed", job)
                continue
            with self._cv:
                taken = {s.index for s in self._slots}
                slot.index = min(set(range(self.parallel)) - taken)   # lowest free slot
                self._slots.append(slot)
            runs.append(slot.run)

    def _count(self, outcome: str, job) -> None:
        self.steps.leave(job.no)
        with self._cv:
            self.counts[outcome] += 1
            self._recent.append(time.monotonic() - getattr(job, "t0", time.monotonic()))

    def _close_finished(self) -> None:
        for slot in [s for s in self._slots if s.run.finished]:
            with self._cv:
                self._slots.remove(slot)
            try:
                outcome = self.backend.close_slot(slot)
            except BaseException as e:  # noqa: BLE001 - an expert failure: this request's
                slot.job.post(Fail(engine_error(e)))
                outcome = "failed"
            self._count(outcome, slot.job)

    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._waiting and not self._slots and not self._closing:
                    self._cv.wait()
                if self._closing and not self._slots:
                    return
            runs: list = []
            self._admit(runs)
            if not runs:
                continue
            slot_of = {id(s.run): s for s in self._slots}
            def between() -> None:
                """A step boundary: runs of clients that left go, finished requests are
                answered (their last tokens were relayed after the step), waiting ones
                join."""
                for s in self._slots:                      # clients that left, shutdown
                    if s.job.cancel:
                        s.run.leave()
                self._close_finished()
                # finished runs leave the list (their sequences are back in the prompt
                # cache; a batch that never empties would hold them all)
                runs[:] = [r for r in runs if not r.finished]
                for gone in set(slot_of) - {id(r) for r in runs}:
                    del slot_of[gone]                      # nor may this map (its slots
                before = len(runs)                         # hold their sequences)
                self._admit(runs)
                for run in runs[before:]:
                    slot_of[id(run)] = next(s for s in self._slots if s.run is run)

            try:
                self.backend.decode(runs, lambda run: slot_of[id(run)], between)
            except BaseException as e:  # noqa: BLE001 - a failed step fails its requests
                err = engine_error(e)
                for s in list(self._slots):
                    s.run.finished = True
                    s.job.post(Fail(err))
                    self._count("failed", s.job)
                    s.seq.drop()
                with self._cv:
                    self._slots.clear()
                continue
            for run in runs:                               # the batch ended: all finished
                run.finished = True
            self._close_finished()


__all__ = ["BatchingEngineThread"]
