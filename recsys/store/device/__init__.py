"""The device tiers: rows in the compute device's memory.

- ``cache``  ``DeviceCache`` (a table's hot rows, LRU between device and host), ``DeviceArena``.
- ``table``  ``DeviceTable``: a whole table on the device, at the host table's slots; ``fits_whole``.
"""
