"""`swarm doctor`: check this machine (and its swarm, when a daemon runs) and explain the fix.

Pure check functions (``checks``) take plain facts and return a :class:`Check`; ``gather``
(``facts``) collects the facts; :func:`diagnose` runs both.
"""

from swarmp2p.doctor.checks import *  # noqa: F403
from swarmp2p.doctor.checks import __all__ as _checks
from swarmp2p.doctor.facts import diagnose, format_checks, gather, probe_worker, report

__all__ = [*_checks, "diagnose", "format_checks", "gather", "probe_worker", "report"]
