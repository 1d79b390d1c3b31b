"""The web dashboard the daemon serves on 127.0.0.1: nodes, devices, jobs, curves, served models.

Light plane: aiohttp and the stdlib only, no build step and nothing fetched by the browser
(the page inlines its script and style and draws charts as SVG).
"""

from swarmp2p.dashboard.server import (
    DASHBOARD_PORT_ENV,
    DEFAULT_DASHBOARD_PORT,
    DashboardServer,
    parse_dashboard_port,
    start_dashboard,
)
from swarmp2p.dashboard.view import MAX_POINTS, VIEW_FORMAT, dashboard_view, metric_points

__all__ = [
    "DASHBOARD_PORT_ENV",
    "DEFAULT_DASHBOARD_PORT",
    "MAX_POINTS",
    "VIEW_FORMAT",
    "DashboardServer",
    "dashboard_view",
    "metric_points",
    "parse_dashboard_port",
    "start_dashboard",
]
