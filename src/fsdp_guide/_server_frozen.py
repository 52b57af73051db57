"""Imported last by the warm server, and only there: what it imported is frozen for the garbage collector.

Every rank is forked from the server. A collection in a rank walks every object it tracks,
the server's modules' objects too, and writing their collector fields makes the kernel copy
each page they lie on: the rank pays, in each launch, for memory it only shares.
``gc.freeze`` moves them to a generation no collection walks (the use the gc module's
documentation gives it: before ``fork()``, in a parent whose children live on).
"""

import gc

gc.collect()
gc.freeze()
