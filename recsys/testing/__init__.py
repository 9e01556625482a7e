"""What only the tests and the benchmarks use; no product module imports this package.

- ``harness``     processes launched and found again, Redis and lookup-service starters, waits.
- ``deepfm_ref``  a reference DeepFM written from its paper, and a plain PyTorch loop for it.
"""
