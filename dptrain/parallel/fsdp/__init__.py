"""FullyShardedDataParallel: ZeRO-3 style sharding of parameters, gradients and optimizer state.

- ``api.py`` -- the wrapper: construction, forward, ``no_sync``, clipping, state-dict methods;
- ``_plan.py`` -- which modules become units and which parameters each one owns;
- ``_unit.py`` -- one unit: the flat parameter, its shard, and the hooks that gather and free
  it and reduce its gradient (phases in :class:`UnitState`);
- ``_root.py`` -- what the units of one root share during an iteration;
- ``_collectives.py`` -- all-gather and reduce-scatter of flat tensors, with guarded waits;
- ``_state_dict.py`` -- full (plain-key) and sharded state dicts.
"""

from dptrain.parallel.fsdp._unit import ShardingStrategy, UnitState
from dptrain.parallel.fsdp.api import FSDP, FullyShardedDataParallel
from dptrain.parallel.wrap import ModuleTypePolicy, ParamCountPolicy

__all__ = ["FullyShardedDataParallel", "FSDP", "ModuleTypePolicy", "ParamCountPolicy", "ShardingStrategy", "UnitState"]
