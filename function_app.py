"""Azure Functions entry point (Python v2 programming model); it sits next to host.json.

The app's types become queue triggers on the transport set by ``QUEUEING_PROVIDER``; see the
``functions`` package and the README's "Azure Functions" section. Nothing connects at import.
"""

from functions import build_app

app = build_app()
