"""Preloaded only into ``spawn_ranks``' forkserver (``launch._context``): when the forkserver exits,
remove the launcher's multiprocessing temp dir (``pymp-*``) that holds the forkserver's socket.

The forkserver exits when the launcher is gone, however the launcher ended; a launcher killed with
SIGKILL cannot remove that directory itself. The forkserver then leaves with ``os._exit``: tearing
down torch would take seconds for nothing. Ranks, forked from the forkserver, leave with
``os._exit`` and never run this. In any other process that imports it (a test) it does nothing:
there multiprocessing removes the process's own ``pymp-*`` dir at exit, and removing it first made
that removal fail with a traceback.
"""
from __future__ import annotations

import atexit
import os
import shutil
import sys


def _remove_socket_dir() -> None:
    from multiprocessing import forkserver

    server = forkserver._forkserver
    address = getattr(server, "_forkserver_address", None)
    in_forkserver = address is not None and getattr(server, "_forkserver_pid", None) is None
    if not in_forkserver:        # (the launcher started it: there _forkserver_pid is set)
        return
    if isinstance(address, bytes):
        address = address.decode(errors="replace")
    if not isinstance(address, str) or not address or address.startswith("\0"):
        return
    directory = os.path.dirname(address)
    if os.path.basename(directory).startswith("pymp-"):
        shutil.rmtree(directory, ignore_errors=True)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


atexit.register(_remove_socket_dir)
