"""The update worker: one CPU thread that updates the optimizer's parts one at a time, in
the order they are submitted, on state borrowed from the store.

A part's update borrows its master weights, moments and gradient from the store
(``TensorStore.borrow``: the host tier's bytes themselves when they are in host memory),
runs the arithmetic (``optim/host_update.py``), hands the new working weights on
(``publish``) and gives the state back to its tier. Under master-weight remainders the
working weights are state as well (the masters' high halves): borrowed with the rest and
replaced in place. A *speculative* update (the clip
coefficient taken as 1 before the step's norm is known) writes the new state out of place,
into records of their own (``parts.next_key``, from ``TensorStore.borrow_new``), and leaves
the state it read and its gradient as they were: the optimizer keeps the new state when the
norm allows it and otherwise updates the part again from the old. When an update starts, the reads of
the one queued after it start, so its reads overlap this one's arithmetic; at most two
updates' inputs are in memory however far the worker falls behind. The worker's seconds are
counted by phase: waiting for the reads, the clip, the AdamW (in the chunked update also its
loads, clip and roundings), and the new weights handed on with the gradient dropped.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future

import megatron_snake.timeline as timeline
from megatron_snake.optim.adamw import STATES
from megatron_snake.optim.cpu_threads import budgeted_worker
from megatron_snake.optim.parts import next_key

UPDATE_PHASES = ("read", "clip", "adamw", "weights")


class UpdateWorker:
    """Runs the parts' updates of ``host_update`` (a HostUpdate) on a worker with
    ``threads`` CPU threads, on state in ``store`` given back to ``tier_of(key)``. ``publish(key,
    part, weights, lent, soon, name)``: the new working weights of a part (1-D pieces, read
    only during the call) for the record ``(name, key, part)``, before its state is given
    back."""

    def __init__(self, store, host_update, *, tier_of, threads: int, publish, weights_sink):
        self.store, self.host_update, self.tier_of = store, host_update, tier_of
        self.remainders = host_update.precision.remainders
        self.publish = publish
        # weights_sink(key, part, numel, soon, name, lent=None): the new weights record's
        # pieces for the kernel to write into, and the call that stores them; or None where
        # ``publish`` stores them. ``lent``: the record's pieces, borrowed and changed in
        # place (under remainders): the sink returns them, with the call that gives it back
        self.weights_sink = weights_sink
        self.threads = threads
        self.executor = budgeted_worker(threads, "snake-adamw")
        self._lock = threading.Lock()
        self._running: dict = {}     # (key, part) -> Future on the worker
        self._queued: list = []      # submitted updates not yet started, in order
        # Seconds the worker spent updating, and seconds the caller waited for an update it
        # needed: 1 - blocked_s / update_s of the step is hidden behind compute.
        self.update_s = self.blocked_s = 0.0
        # update_s by phase (a phase is added as it ends, update_s as the whole update does)
        self.update_phase_s = dict.fromkeys(UPDATE_PHASES, 0.0)

    def submit(self, key, part: str, hyper, clip_coef=None, soon: bool = False,
               speculative: bool = False, inline: bool = False) -> None:
        """Queue one part's update. ``soon``: a deferred part, run one unit ahead of its
        weights' next read (the new weights are kept close for it). ``speculative``: out
        of place, without a clip (above). ``inline``: run it now, on the calling thread
        (state on the device: its kernels go on that thread's stream, in order)."""
        with self._lock:
            previous = self._running.get((key, part))
        if previous is not None:  # its writes come first: the reads of this one follow them
            previous.result()
        job = {"key": key, "part": part, "reads": None, "speculative": speculative}
        if inline:
            job["reads"] = self._read_inputs(key, part)
            fut = Future()
            try:
                self._update(job, hyper, clip_coef, soon)
                fut.set_result(None)
            except BaseException as exc:  # noqa: BLE001 - raised by finish(), as a worker's
                fut.set_exception(exc)
            with self._lock:
                self._running[(key, part)] = fut
            return
        with self._lock:
            self._queued.append(job)
            if len(self._queued) == 1:   # the worker is free for it: read its inputs now
                job["reads"] = self._read_inputs(key, part)
            fut: Future = self.executor.submit(self._update, job, hyper, clip_coef, soon)
            self._running[(key, part)] = fut

    def republish(self, key, part: str) -> None:
        """Queue publishing a part's working weights again from its stored fp32 master
        weights, unchanged (a skipped step after a speculative update published others)."""
        with self._lock:
            reads = {"master": self.store.borrow(("master", key, part))}
            self._running[(key, part)] = self.executor.submit(self._republish, key, part,
                                                              reads)

    def running(self, key, part: str | None = None) -> bool:
        """Whether an update of ``key`` (of its ``part`` only, when given) is running or
        queued."""
        with self._lock:
            return any(k == key and (part is None or p == part) and not f.done()
                       for (k, p), f in self._running.items())

    def finish(self, key, part: str) -> None:
        """Block until the submitted update of ``part`` of ``key`` is done (none: return),
        counting the wait as blocked; raises its error."""
        with self._lock:
            fut = self._running.pop((key, part), None)
        if fut is not None and not fut.done():
            t0 = time.perf_counter()
            with timeline.span("optimizer.wait", "wait", unit=str(key)):
                fut.result()
            self.blocked_s += time.perf_counter() - t0
        elif fut is not None:
            fut.result()

    def wait_running(self) -> None:
        """Wait for the updates submitted so far."""
        with self._lock:
            running = list(self._running.values())
        for fut in running:
            fut.result()

    def close(self) -> None:
        self.executor.shutdown(wait=True)

    # --- on the worker -------------------------------------------------------------------
    def _read_inputs(self, key, part) -> dict:
        """Start borrowing one part's state and gradient (handles): the update changes the
        host tier's bytes in place, so state read ahead into host memory is neither copied
        out nor copied again into staging on its way back to the drive. With master-weight
        remainders the working weights (the masters' high halves) are borrowed too, in host
        memory (a copy of those on the device: the kernel runs on the CPU)."""
        reads = {name: self.store.borrow((name, key, part)) for name in STATES + ("grad",)}
        if self.remainders:
            reads["w"] = self.store.borrow(("w", key, part), on_host=True)
        return reads

    def _next_job(self, job: dict) -> None:
        """As ``job`` starts: read the inputs of the update queued after it."""
        with self._lock:
            if not any(j is job for j in self._queued):   # run inline: nothing behind it
                return
            self._queued.remove(job)
            if job["reads"] is None:
                job["reads"] = self._read_inputs(job["key"], job["part"])
            if self._queued and self._queued[0]["reads"] is None:
                following = self._queued[0]
                following["reads"] = self._read_inputs(following["key"], following["part"])

    def _update(self, job: dict, hyper, clip_coef, soon: bool) -> None:
        key, part = job["key"], job["part"]
        updated = False
        try:
            self._next_job(job)
            with timeline.span(f"update {key} {part}", "optimizer",
                               speculative=job["speculative"]):
                if job["speculative"]:
                    self._speculate(key, part, hyper, job["reads"])
                else:
                    self._update_part(key, part, hyper, clip_coef, soon, job["reads"])
            updated = True
        finally:
            if job["reads"] is not None and job["speculative"]:
                self._end_speculative_loans(key, part, updated)
            elif job["reads"] is not None:
                self._end_loans(key, part, updated)

    def _end_loans(self, key, part: str, updated: bool) -> None:
        """The new state goes back to its tier and the gradient is deleted (under
        remainders the working weights went back as they were published). After a failure
        the state is deleted too, working weights included: its bytes may be half updated
        in place, and a later read must fail (KeyError) rather than return them; the
        update's error is raised by its future."""
        if ("grad", key, part) in self.store:
            self.store.delete(("grad", key, part))
        for name in STATES:
            if updated:
                self.store.give_back((name, key, part), tier=self.tier_of(key))
            else:
                self.store.delete((name, key, part))
        if self.remainders and not updated:
            self.store.delete(("w", key, part))

    def _update_part(self, key, part: str, hyper, clip_coef, soon: bool, reads: dict) -> None:
        t0 = time.perf_counter()
        lent = {name: h.wait() for name, h in reads.items()}
        self._phase("read", t0)
        publish = self._run(key, part, hyper, clip_coef, lent, soon, "w")
        t = time.perf_counter()
        self.store.delete(("grad", key, part))   # its host buffers are free now
        publish()   # before the master is given back
        self._phase("weights", t)
        self.update_s += time.perf_counter() - t0

    def _run(self, key, part: str, hyper, clip_coef, lent: dict, soon: bool, name: str,
             out: dict | None = None):
        """``host_update.run`` of one part, its new working weights written straight into
        the record ``weights_sink`` lends (the store's host buffers when it has room: no
        converted copy, no second pass) where it lends one; under remainders, updated in
        place, into the working weights borrowed (the old high halves, replaced in the same
        pass), which the sink gives back. Returns the call that stores them as record
        ``(name, key, part)``: the sink's, else ``publish``."""
        master = lent["master"]
        numel = sum(p.numel() for p in master)
        sink = None
        if self.remainders and out is None:
            sink = self.weights_sink(key, part, numel, soon, name, lent=lent["w"])
        # not for the device share: its update (and the cast of its weights) is the device's
        elif master and self.tier_of(key) != "gpu":
            sink = self.weights_sink(key, part, numel, soon, name)
        try:
            weights = self.host_update.run(key, part, hyper, clip_coef, lent, self._phase,
                                           out=out, weights_out=sink and sink[0])
        except BaseException:
            if sink:   # half written: no reader may take it
                self.store.delete((name, key, part))
            raise
        if sink:
            return sink[1]
        return lambda: self.publish(key, part, weights, out or lent, soon, name)

    def _speculate(self, key, part: str, hyper, reads: dict) -> None:
        """The update without a clip, out of place: the new state into next records, the
        new working weights published (under remainders, as the next "w" record: they
        are the masters' high halves)."""
        t0 = time.perf_counter()
        lent = {name: h.wait() for name, h in reads.items()}
        self._phase("read", t0)
        out = {name: self.store.borrow_new(next_key(name, key, part),
                                           (sum(p.numel() for p in lent[name]),),
                                           lent[name][0].dtype, kind="optim",
                                           tier=self.tier_of(key))
               for name in STATES}
        publish = self._run(key, part, hyper, None, lent, False,
                            "w.next" if self.remainders else "w", out=out)
        t = time.perf_counter()
        publish()
        self._phase("weights", t)
        self.update_s += time.perf_counter() - t0

    def _republish(self, key, part: str, reads: dict) -> None:
        try:
            master = reads["master"].wait()
            self.publish(key, part, master, {"master": None}, False, "w")
        finally:
            self.store.end_loan(("master", key, part))

    def _end_speculative_loans(self, key, part: str, updated: bool) -> None:
        """The state read (working weights too, under remainders) and the gradient stay as
        they were, for an update again; the next state goes to its tier, or is deleted
        after a failure."""
        self.store.end_loan(("grad", key, part))
        if self.remainders:
            self.store.end_loan(("w", key, part))
        for name in STATES:
            # its host copy (read for the update, when the pool had room) stays until the
            # verdict: an update again would read it
            self.store.end_loan((name, key, part))
            if updated:
                self.store.give_back(next_key(name, key, part), tier=self.tier_of(key))
            elif next_key(name, key, part) in self.store:
                self.store.delete(next_key(name, key, part))

    def _phase(self, name: str, since: float) -> None:
        self.update_phase_s[name] += time.perf_counter() - since
