"""Dense towers and interactions (DLRM, DCN-v2), fed pooled embeddings. Never sees the store."""
