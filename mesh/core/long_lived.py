"""What a serving process has built by the time it serves lives as long as the process: frozen out of the cyclic
collector's generations, a full collection while serving walks only what serving made since.

In a `mesh up` process (torch, Ray, FastAPI, the tokenizer: ~240k tracked objects) one full collection takes 71-79 ms
on a 2-core VM, the wave loop and every stream stopped meanwhile; with them frozen, ~0 ms
(bench/out/gc_freeze_s30.txt). A station does the same after its load (station/actor.py).
"""
from __future__ import annotations

import gc


def freeze_long_lived(collect: bool = True) -> int:
    """Freeze every object alive now into the collector's permanent generation (gc.freeze); with `collect`, first
    collect the garbage the start-up left (a frozen cycle is never freed). Returns how many objects are frozen."""
    if collect:
        gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
