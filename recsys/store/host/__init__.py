"""Host-memory tricks of the store's tables (Linux, glibc, numba).

- ``pages``     large arrays on 2 MiB transparent huge pages.
- ``malloc``    keep freed heap memory in the process.
- ``prefetch``  a software prefetch hint for kernels that walk rows in data order.
"""
