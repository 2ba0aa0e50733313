"""Who reads which sample when: the epoch order, each DDP rank's share, padding and resume.

Pure functions over integers and numpy arrays (no DALI, no I/O), in
:mod:`dali_pipes.sampling.rules` (permutations, the rank split) and
:mod:`dali_pipes.sampling.weighted` (weighted epochs) and :mod:`dali_pipes.sampling.mixture`
(mixtures of datasets) and :mod:`dali_pipes.sampling.windowed` (shard-windowed epochs for a
bounded cache) and :mod:`dali_pipes.sampling.partitioned` (windowed epochs in which each node reads only
its share of the shards; :mod:`~dali_pipes.sampling.node_order` binds them to a rank, :mod:`~dali_pipes.sampling.node_room`
sizes a node's windows; :mod:`~dali_pipes.sampling.stream_mixture` and :mod:`~dali_pipes.sampling.stream_weighted` draw
a mixture and a weighted draw from streamed orders, on :mod:`~dali_pipes.sampling.node_streams`); the
loader, the RAM cache and the public API all import them from here.
"""

# The names and their lists live once, in their modules.
from dali_pipes.sampling.mixture import *  # noqa: F403
from dali_pipes.sampling.mixture import __all__ as _mixture
from dali_pipes.sampling.node_order import *  # noqa: F403
from dali_pipes.sampling.node_order import __all__ as _node_order
from dali_pipes.sampling.node_room import *  # noqa: F403
from dali_pipes.sampling.node_room import __all__ as _node_room
from dali_pipes.sampling.node_streams import *  # noqa: F403
from dali_pipes.sampling.node_streams import __all__ as _node_streams
from dali_pipes.sampling.partitioned import *  # noqa: F403
from dali_pipes.sampling.partitioned import __all__ as _partitioned
from dali_pipes.sampling.rules import *  # noqa: F403
from dali_pipes.sampling.rules import __all__ as _rules
from dali_pipes.sampling.stream_mixture import *  # noqa: F403
from dali_pipes.sampling.stream_mixture import __all__ as _stream_mixture
from dali_pipes.sampling.stream_weighted import *  # noqa: F403
from dali_pipes.sampling.stream_weighted import __all__ as _stream_weighted
from dali_pipes.sampling.weighted import *  # noqa: F403
from dali_pipes.sampling.weighted import __all__ as _weighted
from dali_pipes.sampling.windowed import *  # noqa: F403
from dali_pipes.sampling.windowed import __all__ as _windowed

__all__ = [
    *_rules,
    *_weighted,
    *_mixture,
    *_windowed,
    *_partitioned,
    *_node_order,
    *_node_room,
    *_node_streams,
    *_stream_mixture,
    *_stream_weighted,
]
