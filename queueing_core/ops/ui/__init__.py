"""The operator's dashboard: pages under ``<prefix>/ui/``, served by the ops API's own app.

Server-rendered Jinja2 pages with htmx (vendored in ``static/``) for the live parts; no build step.
Every action goes through :class:`~..service.OpsService`, exactly as the API's routes do, and every
request passes the same :class:`~..guard.Guard` first: a signed-in session (:mod:`.session`) is one
more credential beside the API key, and without a key the API's loopback-only rule applies unchanged.
"""

from .dashboard import Dashboard

__all__ = ["Dashboard"]
