"""Expert parallelism inside a worker: DP attention + EP MoE over a group of rank processes. `EPEngine`
(engine.py) is the Engine API the workers use when `ep_size > 1`; `Placement` and `eplb` decide which rank
holds which experts; `Dispatcher` backends (dispatch/) move tokens to them."""

from libs.ep.placement import Placement

__all__ = ["Placement"]
