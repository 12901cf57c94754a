"""DiLoCo: data parallelism across slow links -- local inner steps, a rare outer sync.

The door of this package (:class:`DiLoCo`, :func:`node_group`). Following one sync:

* ``api.py`` -- :class:`DiLoCo`: the step count, the outer weights and outer SGD, applying
  an averaged pseudo-gradient, buffers, ``state_dict``;
* ``_fragments.py`` -- which parameters sync together (Streaming DiLoCo's fragments) and when;
* ``_exchange.py`` -- one fragment's pseudo-gradient averaged over the replicas, launched
  asynchronously and waited through :func:`dptrain.comm.wait`; bytes counted;
* ``_codec.py`` -- the pseudo-gradient's form on the wire: fp32, bf16, int8 / int4 per block;
* ``_groups.py`` -- who exchanges with whom: the world, a group, or rails between nodes.
"""

from dptrain.parallel.diloco._codec import CODECS
from dptrain.parallel.diloco._groups import node_group
from dptrain.parallel.diloco.api import DiLoCo, check_trainer_settings

__all__ = ["DiLoCo", "node_group", "CODECS", "check_trainer_settings"]
