"""`freeze_startup_heap`: what a serving process holds from startup leaves the collector's full passes, and
what it makes afterwards is still collected (in a subprocess: freezing the test runner's heap would keep the
cycles of later tests' engines alive)."""

from __future__ import annotations

import subprocess
import sys

SCRIPT = """
import gc, weakref
from conveyor.startup import freeze_startup_heap

class Node:
    pass

kept = Node(); kept.me = kept  # alive at startup: frozen
frozen = freeze_startup_heap()
assert frozen == gc.get_freeze_count() > 1000, frozen
tracked = len(gc.get_objects())
later = Node(); later.me = later  # a cycle made after startup
ref = weakref.ref(later)
del later
gc.collect()
assert ref() is None, "a cycle made after the freeze was not collected"
assert len(gc.get_objects()) <= tracked + 10, (tracked, len(gc.get_objects()))
print("ok", frozen, tracked)
"""


def test_the_startup_heap_is_frozen_and_later_garbage_still_collected():
    r = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.startswith("ok"), r.stdout + r.stderr
    frozen, tracked = map(int, r.stdout.split()[1:])
    assert tracked < frozen / 10, "the collector's full passes still walk the startup heap"
