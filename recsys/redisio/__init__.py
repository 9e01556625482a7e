"""Everything the project writes to Redis: the layouts, the one RESP packer, the client helpers.

No torch here: the lookup service imports these modules.

- ``published``     published versions (``recsys export``, the lookup service): keys, rows, manifests, alias.
- ``live``          live rows a training job pushes while it trains (``[publish]``).
- ``spill_layout``  the spill tier's keys, values and namespace owner record.
- ``resp``          Redis commands packed as arrays, sent on a pooled connection.
- ``client``        URL checks, passwords, connection options, ``connect``.
- ``redaction``     the one redaction of a password in a Redis URL.
"""
