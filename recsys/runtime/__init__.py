"""Process and device runtime helpers the trainer, the store and evaluation share.

- ``spawn``           run a function in N local processes forming a gloo group; ``free_port``.
- ``local_exchange``  all-to-alls between the ranks of one host through shared memory.
- ``priority``        background threads that take only the cores a step leaves idle.
- ``transfer``        host ↔ device copies that overlap the device's work.
- ``durable``         fsync of files and directories.
"""
