"""Example apps shipped with the kit: the default ``QUEUEING_APP`` (``queueing_core.examples.orders:app``)
behind ``queueing serve``, the Functions sample and the documentation."""
