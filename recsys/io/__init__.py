"""Parquet streaming reader. Import ``recsys.io.reader`` for the reader itself (it imports torch)."""
