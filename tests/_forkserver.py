"""What the harness's fork server (tests/_dist.py) imports before it forks ranks: torch and
dptrain, with the garbage collector off while they load and their objects frozen out of it
afterwards (``gc.freeze``), as dptrain's warm template does (``spare._collector_off``, see
dptrain/launcher/template.py).

Without the freeze every forked rank (each pooled world's, each fresh call's) met the fork
server's million-odd imported objects again in its first full collection: seconds of CPU per
rank spent walking them, and a copy of every page they live on (a collection writes to each
object's header). With the collector off during the imports, the fork server's own start skips
the dozens of collections an import of this size sets off (a quarter of its CPU).
"""
import gc

from dptrain.launcher.spare import _collector_off

with _collector_off():
    import numpy  # noqa: F401
    import torch  # noqa: F401
    import torch.distributed  # noqa: F401

    import dptrain  # noqa: F401
    import dptrain.comm  # noqa: F401
    import dptrain.parallel  # noqa: F401
    import dptrain.runtime.env  # noqa: F401
    import dptrain.train  # noqa: F401
    gc.freeze()
