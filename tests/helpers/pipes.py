"""A guard for tests that pass a named pipe where a regular file is expected."""

import os
import threading


class PipeWatchdog:
    """Unblocks a process stuck opening a FIFO after a few seconds, so that a regression fails instead of hanging.

    After ``after`` seconds it opens the FIFO's other ends (for writing, which releases a reader waiting in
    ``open``; for reading, which releases a writer), sets ``fired`` when it finds someone there, and keeps both
    ends served until ``stop``.
    """

    def __init__(self, fifo, after=5.0):
        self.fifo, self.fired, self._stop = fifo, False, threading.Event()
        self._thread = threading.Thread(target=self._run, args=(after,), daemon=True)
        self._thread.start()

    def _run(self, after):
        if self._stop.wait(after):
            return
        reader = os.open(self.fifo, os.O_RDONLY | os.O_NONBLOCK)  # a writer blocked in open() goes on now
        try:
            while not self._stop.is_set():
                try:
                    os.close(os.open(self.fifo, os.O_WRONLY | os.O_NONBLOCK))  # succeeds once a reader waits
                    self.fired = True
                except OSError:
                    pass
                try:
                    if os.read(reader, 1 << 16):  # a writer got in and wrote
                        self.fired = True
                except BlockingIOError:  # a writer holds the pipe open
                    self.fired = True
                self._stop.wait(0.05)
        finally:
            os.close(reader)

    def stop(self):
        self._stop.set()
        self._thread.join(timeout=5)
