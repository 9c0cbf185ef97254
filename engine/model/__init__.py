"""The glm5_next text model, one module per block of the model: mHC, KDA, DSA, MLP, MoE, assembly."""
