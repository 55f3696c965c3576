"""Hand-written kernels for the decode step where inductor's own code falls short (each file says by how much)."""
