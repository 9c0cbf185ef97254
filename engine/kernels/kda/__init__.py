"""KDA (Kimi delta attention): short causal convolution, chunked prefill and the recurrent decode step."""
