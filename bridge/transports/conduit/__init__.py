"""Conduit: PHP-only classes run by Phorge's web tier, through the extension's methods.

``client`` speaks Conduit, ``handler`` is the proxy (``worker.execute``, several tasks a
request), ``request_slots`` bounds the requests a worker has in flight, ``feed`` is the
native feed hook (``worker.feedstory``), ``metrics`` shows the proxy's availability, and
``PhorgeBridgeConduitAPIMethods.php`` is the PHP side, installed as a Phorge extension.
"""
