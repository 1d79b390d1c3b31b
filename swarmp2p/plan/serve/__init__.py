"""Serving, planned like training (``planner``: ``plan_serve`` and its rules) over the records
``swarm serve`` asks and the planner answers (``records``). Pure, standard library only. The
public names are ``planner.__all__``."""

from swarmp2p.plan.serve import planner as _planner
from swarmp2p.plan.serve.planner import *  # noqa: F403

__all__ = list(_planner.__all__)
