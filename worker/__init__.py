"""glmflash worker: the OpenAI-compatible HTTP server around the engine."""
