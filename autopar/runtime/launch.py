"""Launching N CPU ranks (gloo): fail fast, say clearly which rank failed, leave nothing behind.

``spawn_ranks(fn, nproc, args)`` starts ``nproc`` processes (forkserver with torch preloaded, so a
rank starts in a fraction of a second), joins them into one gloo world on a free local port with
``timeout_s`` (every collective's timeout), runs ``fn(rank, world, *args)`` and returns every
rank's result, in rank order. ``autopar run`` (``autopar/cli_run.py``) is built on it.

Watching the run. Every rank stamps a shared board: its heartbeat thread every
``HEARTBEAT_INTERVAL_S``, and ``report_progress(step)`` whenever ``fn`` finishes a step (``ParallelModel.step``
reports each training step). The launcher waits on the ranks' result pipes and process
sentinels and ends the run when
  * a rank raises: that error is the cause; the others' errors that only say the connection to a
    peer broke or timed out (``RankCommunicationError``) are listed as its consequences;
  * a rank dies without a result (killed by a signal, ``os._exit``): at once, naming the rank, the
    signal and the last step it reported, with the Python stack of each of its threads when a fatal
    signal (SIGABRT, SIGSEGV, SIGBUS, SIGFPE, SIGILL) killed it (``faulthandler``, to a file per rank);
  * a rank's heartbeat stops for ``heartbeat_timeout_s`` (default 30 s): a stopped (SIGSTOP) or
    hung process, which its peers' collective timeout would only notice after ``timeout_s``;
  * no rank reports progress for ``progress_timeout_s`` (default ``timeout_s + grace_s``; a rank's
    start and its result count as progress, so for an ``fn`` that never reports, this bounds the
    whole run as before). A run that keeps progressing is never cut short.
Every rank still running is then killed and ``RankFailure`` says what happened, each line once.

Nothing is left behind. Ranks exit when the launcher does, however it ends, SIGKILL included: each
rank's heartbeat thread watches the launcher's pid (a pidfd) and each rank has PR_SET_PDEATHSIG on its
parent, the forkserver, which exits when the launcher does. SIGTERM and SIGHUP to the launcher (when
it has no handler of its own) stop the ranks and exit with status 128 + signal; Ctrl-C raises
KeyboardInterrupt in the launcher only (ranks ignore SIGINT), which stops them the same way. The
forkserver removes the launcher's ``pymp-*`` temp dir (its socket's) when it exits
(``forkserver_exit.py``). Results travel through one pipe per rank, so no named semaphore is made and
the resource tracker has nothing to clean.

Results are ``torch.save`` bytes loaded with ``torch.load(weights_only=True)``, never plain pickle:
``fn`` returns tensors, numbers, strings, None and lists, tuples and dicts of them.
"""
from __future__ import annotations

import contextlib
import gc
import datetime
import faulthandler
import io
import json
import multiprocessing as mp
import multiprocessing.connection as mp_connection
import os
import re
import select
import signal
import socket
import sys
import tempfile
import threading
import time
import traceback
from typing import Any, Callable, Optional, Sequence

DEFAULT_RUN_TIMEOUT_S = 300.0      # ``autopar run --timeout``'s default
HEARTBEAT_INTERVAL_S = 1.0
HEARTBEAT_TIMEOUT_S = 30.0         # a rank silent this long is stuck (a stopped or hung process)
SETTLE_S = 2.0                     # after a failure, how long the other ranks may report theirs
_POLL_S = 0.25
_FIELDS = 3                        # the board, per rank: heartbeat time, progress time, steps done
_BEAT, _PROGRESS, _STEPS = range(_FIELDS)
_ORPHANED_EXIT = 70                # a rank's exit status when its launcher is gone


class RankFailure(RuntimeError):
    """The run failed and every rank was stopped.

    ``causes`` maps the ranks whose failure ended the run to one line each (their error as "Type:
    message", or what happened to the process: "was killed by SIGKILL after step 3", "stopped
    responding ..."); ``consequences`` the ranks that then failed only because a peer did (their
    connection broke or timed out); ``errors`` both. ``str()`` adds every traceback."""

    def __init__(self, message: str, errors: Optional[dict[int, str]] = None, *,
                 causes: Optional[dict[int, str]] = None,
                 consequences: Optional[dict[int, str]] = None) -> None:
        super().__init__(message)
        self.causes = dict(causes if causes is not None else errors or {})
        self.consequences = dict(consequences or {})
        self.errors = dict(errors if errors is not None else {**self.consequences, **self.causes})

    def summary(self) -> str:
        """What the user must read, each line once: the causes (ranks with the same error share a
        line), then the consequences. The tracebacks stay in ``str(self)``."""
        if not self.causes:
            return str(self)
        lines = _grouped(self.causes)
        return "\n".join(lines + _consequence_lines(self.consequences))


def _grouped(by_rank: dict[int, str]) -> list[str]:
    """One line per distinct text: "ranks 0, 2: TEXT" (a text that starts with "was"/"exited"/...
    reads "rank 2 was killed ..."); what differs between ranks' copies of one error (their own
    rank, peer addresses) is dropped first."""
    groups: dict[str, list[int]] = {}
    for r, text in sorted(by_rank.items()):
        groups.setdefault(_normalized(text), []).append(r)
    out = []
    for text, ranks in groups.items():
        who = f"{'rank' if len(ranks) == 1 else 'ranks'} {', '.join(map(str, ranks))}"
        out.append(f"{who} {text}" if text.startswith(_EVENT_WORDS) else f"{who}: {text}")
    return out


_EVENT_WORDS = ("was ", "exited ", "stopped ", "made ")


def _normalized(text: str) -> str:
    text = re.sub(r"\brank \d+: ", "", text)
    text = re.sub(r"\[[^\]\s]*\.(cc|cpp|h):\d+\] ", "", text)       # a backend's source location
    return re.sub(r"\[?\d{1,3}(\.\d{1,3}){3}\]?:\d+", "[peer]", text)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---- in a rank -------------------------------------------------------------------------------

_BOARD: Optional[tuple[Any, int]] = None       # in a rank: (the shared board, this rank)


def in_launched_rank() -> bool:
    """True in a rank ``spawn_ranks`` started (it watches the rank's heartbeat itself)."""
    return _BOARD is not None


def report_progress(step: Optional[int] = None) -> None:
    """Tell the launcher this rank made progress: finished step ``step`` (or one more step). It resets
    ``spawn_ranks``' progress timeout and names the step in failure reports. Outside a rank started
    by ``spawn_ranks``, nothing."""
    if _BOARD is None:
        return
    board, rank = _BOARD
    i = rank * _FIELDS
    board[i + _STEPS] = float(step) if step is not None else board[i + _STEPS] + 1
    board[i + _PROGRESS] = time.monotonic()


def _launcher_gone_waiter(pid: int) -> Callable[[float], bool]:
    """``wait(t)``: sleeps up to ``t`` s, True as soon as process ``pid`` has exited (a pidfd: no
    pid-reuse race; elsewhere a poll of the pid)."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return lambda t: True
    except (AttributeError, OSError):
        def poll(t: float) -> bool:
            time.sleep(t)
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return True
            except PermissionError:
                pass
            return False
        return poll
    return lambda t: bool(select.select([fd], [], [], t)[0])


def _heartbeat(board, rank: int, launcher_pid: int) -> None:
    gone = _launcher_gone_waiter(launcher_pid)
    while True:
        board[rank * _FIELDS + _BEAT] = time.monotonic()
        if gone(HEARTBEAT_INTERVAL_S):
            os._exit(_ORPHANED_EXIT)                # the launcher died: nobody wants this rank's result


def _die_with_parent() -> None:
    """PR_SET_PDEATHSIG(SIGKILL): the kernel kills this rank when its parent, the forkserver, dies,
    even if the rank is stopped or holds the GIL (Linux only). The forkserver exits when every
    holder of its "alive" pipe is gone: the launcher and, by multiprocessing's design, every rank;
    a rank closes its copy here (a rank that starts processes through a forkserver starts its own),
    so the launcher's death alone ends the forkserver and then the ranks."""
    from multiprocessing import forkserver

    server = getattr(forkserver, "_forkserver", None)
    alive = getattr(server, "_forkserver_alive_fd", None)
    if alive is not None and getattr(server, "_forkserver_pid", 1) is None:
        with contextlib.suppress(OSError):
            os.close(alive)
        server._forkserver_alive_fd = None
    if not sys.platform.startswith("linux"):
        return
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL), 0, 0, 0)   # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _rank_main(fn, rank: int, world: int, port: int, timeout_s: float, args: tuple, conn, board,
               launcher_pid: int, crash_path: str) -> None:
    global _BOARD
    signal.signal(signal.SIGINT, signal.SIG_IGN)        # Ctrl-C: the launcher stops the ranks
    crash = open(crash_path, "w")                       # kept open for the rank's life
    faulthandler.enable(crash, all_threads=True)        # a fatal signal: where each thread was
    _die_with_parent()
    i = rank * _FIELDS
    board[i + _BEAT] = board[i + _PROGRESS] = time.monotonic()
    _BOARD = (board, rank)
    threading.Thread(target=_heartbeat, args=(board, rank, launcher_pid), name="autopar-heartbeat",
                     daemon=True).start()
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world, timeout=datetime.timedelta(seconds=timeout_s))
        out = fn(rank, world, *args)
        # what fn made and dropped is finalized now (the rank leaves with os._exit: no atexit), e.g.
        # an NVMe offload's files (``runtime/nvme.py``) are removed
        gc.collect()
        buf = io.BytesIO()                   # tensors by value: the rank exits before the parent reads
        torch.save(out, buf)
        head, payload = {"status": "ok"}, buf.getvalue()
    except BaseException as e:  # reported to the parent, which raises RankFailure
        from autopar.runtime.failures import peer_failure_kind

        head = {"status": "error", "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc(),
                "peer": peer_failure_kind(e)}
        payload = b""
    try:
        conn.send_bytes(json.dumps(head).encode() + b"\n" + payload)
    except OSError:                          # the launcher is gone
        pass
    finally:
        conn.close()
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except RuntimeError:
                pass


# ---- in the launcher -------------------------------------------------------------------------

# What the forkserver imports once, so that each rank it forks starts with them: torch.export and
# dynamo (the trace), the solver, codegen and runtime, and what they import lazily on a rank's first
# trace (sympy, networkx, inductor's cache keys): without them every rank of every launch paid ~2 s
# of CPU importing them again; ``forkserver_warm`` then traces a tiny model once. An import that
# fails here is skipped (the rank imports it itself).
_PRELOAD = ("autopar.runtime.forkserver_exit", "torch", "torch.distributed", "torch._dynamo", "torch.export",
            "torch._inductor.codecache", "sympy", "networkx", "autopar.api", "autopar.build", "autopar.engine",
            "autopar.trace", "autopar.solver", "autopar.codegen", "autopar.codegen.emit", "autopar.models.zoo",
            "autopar.report", "autopar.runtime.pipeline", "autopar.runtime.reducer",
            "autopar.runtime.forkserver_warm")


def _context():
    """The forkserver with torch and autopar preloaded on CPU machines; plain spawn where CUDA is:
    the forkserver's warm-up trace initializes CUDA (dynamo saves its RNG state), and a process forked
    from one that did cannot use CUDA ("Cannot re-initialize CUDA in forked subprocess", seen on the
    first lent GPU)."""
    import torch

    if torch.cuda.is_available():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(_PRELOAD))
    return ctx


def spawn_ranks(fn: Callable, nproc: int, args: Sequence[Any] = (), *, timeout_s: float = 60.0,
                grace_s: float = 30.0, heartbeat_timeout_s: float = HEARTBEAT_TIMEOUT_S,
                progress_timeout_s: Optional[float] = None) -> list:
    """Run ``fn(rank, nproc, *args)`` on ``nproc`` gloo ranks; results in rank order.

    ``fn`` must be importable (a module-level function) and return what ``torch.load(weights_only=
    True)`` accepts. ``timeout_s`` is the process groups' timeout. The run fails (``RankFailure``,
    every rank killed) as soon as a rank raises or dies, when a rank's heartbeat stops for
    ``heartbeat_timeout_s``, or when no rank reports progress (``report_progress``) for
    ``progress_timeout_s`` (default ``timeout_s + grace_s``)."""
    ctx = _context()
    board = ctx.RawArray("d", nproc * _FIELDS)
    port = free_port()
    run = _Run(nproc, board, heartbeat_timeout_s,
               progress_timeout_s if progress_timeout_s is not None else timeout_s + grace_s)
    with _signals_stop_ranks(), tempfile.TemporaryDirectory(prefix="autopar-ranks-") as crashes:
        try:
            for r in range(nproc):
                reader, writer = ctx.Pipe(duplex=False)
                run.crash_paths.append(os.path.join(crashes, f"rank{r}.stacks"))
                p = ctx.Process(target=_rank_main, name=f"autopar-rank-{r}", daemon=True,
                                args=(fn, r, nproc, port, timeout_s, tuple(args), writer, board, os.getpid(),
                                      run.crash_paths[r]))
                try:
                    p.start()
                finally:
                    writer.close()           # the rank holds the only write end: EOF when it dies
                run.procs.append(p)
                run.readers.append(reader)
            run.last_event = time.monotonic()    # (a cold forkserver start is not the ranks' time)
            run.wait()
        finally:
            run.stop()
        if run.failed():
            raise run.failure()
    return run.results()


@contextlib.contextmanager
def _signals_stop_ranks():
    """While ranks run, SIGTERM and SIGHUP (left at their default action) raise SystemExit(128 +
    signal) in the launcher, so its cleanup stops the ranks before it exits."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum, frame):
        sys.stderr.write(f"spawn_ranks: {signal.Signals(signum).name} received; stopping every rank\n")
        raise SystemExit(128 + signum)

    old = {}
    for sig in (signal.SIGTERM, signal.SIGHUP):
        if signal.getsignal(sig) == signal.SIG_DFL:
            old[sig] = signal.signal(sig, stop)
    try:
        yield
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)


class _Run:
    """The launcher's view of one run: results, errors, exits and the board, until done or failed."""

    def __init__(self, nproc: int, board, heartbeat_timeout_s: float, progress_timeout_s: float) -> None:
        self.n, self.board = nproc, board
        self.heartbeat_timeout_s, self.progress_timeout_s = heartbeat_timeout_s, progress_timeout_s
        self.procs: list = []
        self.readers: list = []
        self.crash_paths: list[str] = []             # rank -> where faulthandler writes its stacks
        self.payloads: dict[int, bytes] = {}         # rank -> its result (torch.save bytes)
        self.errors: dict[int, dict] = {}            # rank -> {"error", "traceback", "peer"}
        self.exits: dict[int, int] = {}              # rank -> exit code of a rank that died without a message
        self.stalled: dict[int, tuple] = {}          # rank -> (seconds since its last heartbeat, process state)
        self.no_progress: Optional[float] = None     # seconds without progress when the run was ended
        self.stopped: list[int] = []                 # ranks still running when the launcher stopped them
        self.last_event = time.monotonic()

    def _pending(self) -> list[int]:
        return [r for r in range(self.n) if r not in self.payloads and r not in self.errors
                and r not in self.exits]

    def failed(self) -> bool:
        return bool(self.errors or self.exits or self.stalled or self.no_progress is not None)

    def wait(self) -> None:
        """Until every rank returned a result, or the first failure (then ``failed()``)."""
        while self._pending():
            self._poll(_POLL_S)
            self._check_board()
            if self.failed():
                if not self.stalled and self.no_progress is None:
                    self._settle()
                return

    def _poll(self, timeout: float) -> None:
        pending = self._pending()
        readers = {self.readers[r]: r for r in pending if not self.readers[r].closed}
        sentinels = {self.procs[r].sentinel: r for r in pending}
        ready = mp_connection.wait(list(readers) + list(sentinels), timeout=timeout)
        for obj in ready:
            if obj in readers:
                self._read(readers[obj])
        for obj in ready:
            r = sentinels.get(obj)
            if r is not None and r in self._pending():
                self._exited(r)

    def _read(self, r: int) -> None:
        reader = self.readers[r]
        try:
            data = reader.recv_bytes()
        except (EOFError, OSError):          # the rank died: its sentinel says how
            reader.close()
            return
        reader.close()
        head, _, payload = data.partition(b"\n")
        msg = json.loads(head)
        self.last_event = time.monotonic()
        if msg["status"] == "ok":
            self.payloads[r] = payload
        else:
            self.errors[r] = msg

    def _exited(self, r: int) -> None:
        reader = self.readers[r]
        if not reader.closed and reader.poll(0):
            self._read(r)                    # its message came just before its exit
        if r in self._pending():
            self.procs[r].join(1)
            self.exits[r] = self.procs[r].exitcode

    def _check_board(self) -> None:
        now = time.monotonic()
        for r in self._pending():
            beat = self.board[r * _FIELDS + _BEAT]
            if beat and now - beat > self.heartbeat_timeout_s and self.procs[r].is_alive():
                self.stalled[r] = (now - beat, _process_state(self.procs[r].pid))
        last = max([self.last_event] + [self.board[r * _FIELDS + _PROGRESS] for r in range(self.n)])
        if now - last > self.progress_timeout_s:
            self.no_progress = now - last

    def _settle(self) -> None:
        """After a failure, let the other ranks report theirs (a peer's death makes their
        collectives fail at once) for up to ``SETTLE_S``."""
        end = time.monotonic() + SETTLE_S
        while self._pending() and time.monotonic() < end:
            self._poll(min(_POLL_S, max(0.0, end - time.monotonic())))

    def stop(self) -> None:
        """Every rank still running is killed (stopped ones too: SIGKILL); all are joined."""
        failed = self.failed() or len(self.payloads) < len(self.procs)
        alive = [r for r, p in enumerate(self.procs) if p.is_alive()]
        if not failed:                        # every result is in: let the ranks exit by themselves
            end = time.monotonic() + 10.0
            for r in alive:
                self.procs[r].join(max(0.0, end - time.monotonic()))
        now = time.monotonic()
        for r, p in enumerate(self.procs):
            if p.is_alive():
                beat = self.board[r * _FIELDS + _BEAT]
                if r in self._pending() and r not in self.stalled:
                    if beat and now - beat > 3 * HEARTBEAT_INTERVAL_S:   # silent too: the likelier cause
                        self.stalled[r] = (now - beat, _process_state(p.pid))
                    else:
                        self.stopped.append(r)
                p.kill()
        for p in self.procs:
            p.join(5)
        for reader in self.readers:
            reader.close()

    def _step(self, r: int) -> str:
        steps = int(self.board[r * _FIELDS + _STEPS])
        return f" after step {steps}" if steps else ""

    def failure(self) -> RankFailure:
        causes: dict[int, str] = {}
        for r, code in sorted(self.exits.items()):
            causes[r] = _exit_text(code) + self._step(r)
        for r, (age, state) in sorted(self.stalled.items()):
            limit = f" (heartbeat_timeout_s={self.heartbeat_timeout_s:g})" if age >= self.heartbeat_timeout_s else ""
            causes[r] = f"stopped responding{self._step(r)}: no heartbeat for {age:.0f} s{limit}{state}"
        if self.no_progress is not None:
            steps = {r: int(self.board[r * _FIELDS + _STEPS]) for r in self._pending()}
            for r in steps:
                causes[r] = (f"made no progress for {self.no_progress:.0f} s while alive (no step reported; "
                             f"steps done: {steps}; progress timeout {self.progress_timeout_s:g} s); if a step "
                             f"or the setup legitimately takes longer, raise it (`autopar run --timeout "
                             f"SECONDS`, or spawn_ranks(timeout_s=..., progress_timeout_s=...))")
        first = {r: e["error"] for r, e in self.errors.items() if not e["peer"]}
        peer = {r: e["error"] for r, e in self.errors.items() if e["peer"]}
        causes.update(first)
        promoted = not causes
        if promoted:                          # only peer errors (a rank timed out waiting): they are the news
            causes, peer = peer, {}
        lines = RankFailure("", causes=causes, consequences=peer).summary().splitlines()
        stop = "every other rank was stopped" if len(causes) == 1 else "every rank still running was stopped"
        if "\n" in _grouped(causes)[0]:
            lines.append(stop)
        else:
            lines[0] += f"; {stop}"
        running = ", ".join(f"rank {r}{self._step(r)}" for r in self.stopped if r not in causes)
        if running:
            lines.append(f"still running when stopped{', so likely what the others waited for' if promoted else ''}"
                         f": {running}")
        details = [f"--- rank {r} ---\n{e['error']}\n{e['traceback']}" for r, e in sorted(self.errors.items())]
        details += [f"--- rank {r} ({causes[r]}): its threads at the signal ---\n{stacks}"
                    for r in sorted(self.exits) if (stacks := self._fatal_stacks(r))]
        return RankFailure("\n".join(lines + details), causes=causes, consequences=peer)

    def _fatal_stacks(self, r: int) -> str:
        """What faulthandler wrote for rank ``r`` (killed by a fatal signal), its last 60 lines."""
        try:
            with open(self.crash_paths[r]) as f:
                return "".join(f.readlines()[-60:]).rstrip()
        except (OSError, IndexError):
            return ""

    def results(self) -> list:
        import torch

        out = []
        for r in range(self.n):
            try:
                out.append(torch.load(io.BytesIO(self.payloads[r]), weights_only=True))
            except Exception as e:
                what = re.search(r"Unsupported global: GLOBAL (\S+)", str(e))
                msg = (f"returned a result that torch.load(weights_only=True) refuses ("
                       f"{f'it holds {what.group(1)}' if what else type(e).__name__}); return tensors, numbers, "
                       f"strings, None and lists, tuples and dicts of them (a plan as plan.to_json())")
                raise RankFailure(f"rank {r} {msg}", causes={r: msg}) from None
        return out


_KIND_WORDS = {"broken": "their connection to a failed rank broke",
               "timeout": "a peer did not answer within timeout_s"}


def _consequence_lines(peer: dict[int, str]) -> list[str]:
    """The ranks that failed only because another did: one line per kind (connection broke, timed
    out), with the first one's error, shortened."""
    by_kind: dict[str, list[int]] = {}
    for r in sorted(peer):
        low = peer[r].lower()
        timeout = any(w in low for w in ("did not answer", "timed out", "timeout")) and "connection" not in low
        by_kind.setdefault("timeout" if timeout else "broken", []).append(r)
    out = []
    for kind, ranks in by_kind.items():
        text = _normalized(peer[ranks[0]]).split(". ", 1)[0].rstrip(".")
        who = f"{'rank' if len(ranks) == 1 else 'ranks'} {', '.join(map(str, ranks))}"
        out.append(f"{who} then failed as a consequence ({_KIND_WORDS.get(kind, kind)}): {text}")
    return out


def _exit_text(code: Optional[int]) -> str:
    if code is None:
        return "exited without returning a result (its exit status is unknown)"
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"was killed by {name}"
    if code == _ORPHANED_EXIT:
        return f"exited (status {code}): it saw its launcher die"
    return (f"exited with status {code} without returning a result (its stderr may say why: an error "
            f"while starting, such as fn not importable, os._exit, or a crash in native code)")


_STATES = {"T": "; its process was stopped (SIGSTOP or SIGTSTP)", "t": "; its process is stopped by a debugger",
           "D": "; its process is blocked in the kernel (uninterruptible I/O)",
           "R": "; its process runs but its Python threads do not (a native call holding the GIL?)",
           "S": "; its process sleeps but its Python threads do not run (a native call holding the GIL?)"}


def _process_state(pid: Optional[int]) -> str:
    """What /proc says about a silent rank's process (Linux), as a clause; '' elsewhere."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return ""
    return _STATES.get(state, "")
