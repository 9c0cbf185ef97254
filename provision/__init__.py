"""Provisioning: snapshot sources and the prepared on-disk format (knows files, not tensors or HTTP)."""
