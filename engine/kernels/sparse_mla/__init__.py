"""Sparse MLA in absorbed form over the latent cache: attend to selected pools plus the raw tail."""
