"""Planning: pure functions from gathered rosters to one rank's plan."""

from .holdings import Holdings, TensorInfo
from .planner import Planner, Region
from .roster import Roster, decode_roster, encode_roster
from .types import LocalCopy, RankPlan, Transfer

__all__ = ["Holdings", "TensorInfo", "Planner", "Region", "Roster", "encode_roster",
           "decode_roster", "LocalCopy", "RankPlan", "Transfer"]
