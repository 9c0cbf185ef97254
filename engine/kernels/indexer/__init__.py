"""The kpool lightning indexer: pooled keys and top-k pool selection for DSA layers."""
